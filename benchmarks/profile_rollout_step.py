"""Where a rollout step's time goes (docs/rollouts.md, "Where a step's time goes"; issue 36).

One traced rollout with the dual cache (``cache="dual"``, ``dps_stride`` 4, scope "all") of the
random LLaDA models of ``bench_rollout_cache.py`` (d 128, 256, 512; P 64, L 256, T 128, block
32, V 64), timed by part with process CPU clocks around each (one thread):

- model: the forwards, split into the linear layers (every ``nn.Linear``, the LM head included),
  attention (``scaled_dot_product_attention``) and the rest of the forward (norms, RoPE, SwiGLU,
  the cache layers' update, transformers' Python per layer);
- cache: ``BlockCache`` outside the model (building the cache of a refresh, masks, copies);
- trace: ``TraceRecorder.step`` (gathers, held rows, log-softmax);
- candidates: Gumbel noise and the float64 softmax of the masked block positions, the top-k;
- sampler: the rest of each step (Python, commits, births).

Printed: ms per step of each part and its share (the timers themselves add a little to
"model, rest": a hook per linear layer), a refresh's time over a dual block step's, which
the cost model takes to be (P + L) / block = 10, and the share of a block step that a model of
the same depth at width 16 also spends ("fixed": its arithmetic is negligible, so what is
left is what a forward pays per call whatever its width: the layers' Python and dispatch).

    python benchmarks/profile_rollout_step.py              # batch 1 and 8
    python benchmarks/profile_rollout_step.py --batch 8
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from bench_rollout_cache import SETTING, SIZES, prompts, random_llada

from daca.core import block_cache, sampler, trace
from daca.core.sampler import generate

PARTS = ("linear", "attention", "model, rest", "cache", "trace", "candidates", "sampler")


class Clock:
    """Process CPU seconds per part; a part's time excludes the parts timed inside it."""

    def __init__(self):
        self.seconds = dict.fromkeys(PARTS + ("model",), 0.0)
        self.stack: list[list] = []  # [part, start, time of the parts inside]

    def start(self, part: str) -> None:
        self.stack.append([part, time.process_time(), 0.0])

    def stop(self) -> None:
        part, start, inner = self.stack.pop()
        spent = time.process_time() - start
        self.seconds[part] += spent - inner
        if self.stack:
            self.stack[-1][2] += spent

    @contextmanager
    def part(self, name: str):
        self.start(name)
        try:
            yield
        finally:
            self.stop()


def timed_function(clock: Clock, part: str, fn):
    def wrapper(*args, **kwargs):
        with clock.part(part):
            return fn(*args, **kwargs)

    return wrapper


@contextmanager
def instrumented(model, clock: Clock):
    """Timers around each part for the duration of the block (originals restored after)."""
    patches = [
        (F, "scaled_dot_product_attention", "attention"),
        (block_cache.BlockCache, "refresh", "cache"),
        (block_cache.BlockCache, "refresh_suffix", "cache"),
        (block_cache.BlockCache, "block", "cache"),
        (trace.TraceRecorder, "step", "trace"),
        (sampler._Sampler, "_candidates", "candidates"),
        (sampler, "top_confidence_mask", "candidates"),
        (sampler._Sampler, "_step", "sampler"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    hooks = []
    for module, part in [(model, "model")] + [
        (m, "linear") for m in model.modules() if isinstance(m, torch.nn.Linear)
    ]:
        hooks.append(module.register_forward_pre_hook(lambda *_, p=part: clock.start(p)))
        hooks.append(module.register_forward_hook(lambda *_: clock.stop()))
    try:
        for owner, name, part in patches:
            setattr(owner, name, timed_function(clock, part, getattr(owner, name)))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        for hook in hooks:
            hook.remove()


def profile(name: str, batch: int, stride: int) -> None:
    size = SETTING | SIZES[name]
    model = random_llada(**SIZES[name], vocab=size["vocab"], positions=size["prompt"] + size["L"])
    prompt = prompts(size, batch)
    run = lambda L, T: generate(  # noqa: E731
        model, prompt, mask_id=size["vocab"] - 1, gen_length=L, steps=T,
        block_length=size["block"], cache="dual", dps_stride=stride,
    )  # fmt: skip
    run(size["block"], size["T"] * size["block"] // size["L"])  # warm-up: one block
    clock = Clock()
    with instrumented(model, clock):
        t0 = time.process_time()
        run(size["L"], size["T"])
        total = time.process_time() - t0
    seconds = clock.seconds
    seconds["model, rest"] += seconds.pop("model")
    per_step = 1e3 / size["T"]
    cells = "".join(f"{seconds[p] * per_step:>8.2f} {seconds[p] / total:>4.0%}" for p in PARTS)
    full, block = forward_times(model, size, prompt)
    narrow = random_llada(SIZES[name]["layers"], 16, 2, size["vocab"], size["prompt"] + size["L"])
    fixed = forward_times(narrow, size, prompt)[1] / block
    row = f"{name:<6}{batch:>6}{total * per_step:>9.2f}{cells}{full / block:>12.1f}{fixed:>7.0%}"
    print(row, flush=True)


def forward_times(model, size, prompt, repeats=5) -> tuple[float, float]:
    """Seconds of a refresh and of a dual block step (the cost model takes their ratio to be
    (P + L) / block)."""
    P, L, bl = size["prompt"], size["L"], size["block"]
    x = torch.cat([prompt, torch.full((prompt.shape[0], L), size["vocab"] - 1)], 1)
    cache = block_cache.BlockCache(model, "dual", None, P, P + L)
    lo, hi = L // 2 - bl, L // 2  # a block in the middle of the completion

    def seconds(fn) -> float:
        fn()
        t0 = time.process_time()
        for _ in range(repeats):
            fn()
        return (time.process_time() - t0) / repeats

    with torch.no_grad():
        return seconds(lambda: cache.refresh(x, lo, hi, L)), seconds(lambda: cache.block(x, lo, hi))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--stride", type=int, default=4)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"dual cache, trace stride {args.stride}, {SETTING}; ms per step (share of the step)")
    head = f"{'size':<6}{'batch':>6}{'step':>9}" + "".join(f"{p:>13}" for p in PARTS)
    print(head + f"{'full/block':>12}{'fixed':>7}")
    for batch in args.batch:
        for name in args.sizes:
            profile(name, batch, args.stride)


if __name__ == "__main__":
    main()
