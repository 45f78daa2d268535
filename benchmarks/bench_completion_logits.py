"""The LM head on the positions read only, against the head on every position.

``forward_logits(..., last=L)`` passes ``logits_to_keep`` to transformers' Llama/Qwen2 classes,
so the head (hidden x vocabulary) runs on the L completion rows the likelihoods read instead of
the P + L rows of prompt ++ completion. Times ``mean_field_logp`` forward+backward (an update's
likelihood) on a random hub-layout LLaDA with the real vocabulary (126,464), once as loaded and
once behind a wrapper that hides its class (so every position's logits are computed and the
prompt's thrown away, as before). Repetitions alternate and medians are reported. Prints a ratio.

``--rollout`` times the sampler's uncached rollout instead (``generate``, cache "none", the
default): each step's head runs on the current block's rows (``forward_logits(..., stop=)``),
against every row and against the rows from the block to the end (as before); the three must
commit the same tokens.

    python benchmarks/bench_completion_logits.py                    # d 64, fp32, P 128, L 64
    python benchmarks/bench_completion_logits.py --dtype bfloat16   # the recipes' dtype
    python benchmarks/bench_completion_logits.py --d-model 1024     # a wider body: smaller gain
    python benchmarks/bench_completion_logits.py --rollout          # L 64, 2 blocks, 32 steps
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from daca.core.likelihood import mean_field_logp
from daca.core.sampler import generate
from daca.models import load

ROOT = Path(__file__).resolve().parent.parent


class HiddenClass(torch.nn.Module):
    """The same model, its class hidden: ``forward_logits`` computes every position's logits."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


class ToTheEnd(torch.nn.Module):
    """The same model, asked for positions a..b-1, runs the head from a to the end (seen through
    as DDP's ``.module``) and drops the rest: the rollout's head as it ran before ``stop=``."""

    def __init__(self, inner):
        super().__init__()
        self.module = inner

    def forward(self, input_ids, logits_to_keep=0, **kwargs):
        if not isinstance(logits_to_keep, torch.Tensor):
            return self.module(input_ids, logits_to_keep=logits_to_keep, **kwargs)
        first, rows = int(logits_to_keep[0]), len(logits_to_keep)
        out = self.module(input_ids, logits_to_keep=input_ids.shape[1] - first, **kwargs)
        out.logits = out.logits[:, :rows]
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt", type=int, default=128, help="P, prompt tokens")
    ap.add_argument("--completion", type=int, default=64, help="L, completion tokens")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rollout", action="store_true", help="time the uncached rollout instead")
    ap.add_argument("--block", type=int, default=32, help="--rollout: block length (steps L/2)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "tests"))
    from _hub import write_llada

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_llada(
            Path(tmp) / "llada", d_model=args.d_model, mlp_hidden_size=2 * args.d_model,
            n_layers=args.layers,
        )  # fmt: skip
        bundle = load(str(folder), device="cpu", dtype=getattr(torch, args.dtype))
    model = bundle.model.train()
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 100_000, (args.batch, args.prompt), generator=g)
    o = torch.randint(0, 100_000, (args.batch, args.completion), generator=g)
    variants = {"completion rows": model, "every row": HiddenClass(model)}
    if args.rollout:
        variants["to the end"] = ToTheEnd(model)

    def update(m) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        mean_field_logp(m, q, o, mask_id=bundle.mask_id).sum().backward()
        return time.perf_counter() - start

    tokens = []

    @torch.no_grad()
    def rollout(m) -> float:
        start = time.perf_counter()
        out = generate(
            m.eval(), q, mask_id=bundle.mask_id, gen_length=args.completion,
            steps=args.completion // 2, block_length=args.block,
        )  # fmt: skip
        tokens.append(out.completion_ids)
        return time.perf_counter() - start

    run = rollout if args.rollout else update
    first = [run(m) for m in variants.values()]  # warm-up
    times = {name: [] for name in variants}
    for r in range(args.reps):
        for name in list(variants)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(run(variants[name]))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(
        f"LLaDA layout, d {args.d_model}, {args.layers} layers, vocabulary 126,464, {args.dtype}; "
        f"B {args.batch}, P {args.prompt}, L {args.completion}; {args.threads} thread(s), "
        f"{args.reps} alternating reps, medians (warm-up {' / '.join(f'{t:.2f}' for t in first)} s)"
    )
    ratio = med["every row"] / med["completion rows"]
    if args.rollout:
        if not all(torch.equal(t, tokens[0]) for t in tokens):
            raise SystemExit("the rollouts committed different tokens")
        tail = med["to the end"] / med["completion rows"]
        print(
            f"uncached rollout, block {args.block}, {args.completion // 2} steps: head on every "
            f"row / on the block's rows = {ratio:.2f}x; from the block to the end / on the "
            f"block's rows = {tail:.2f}x (same tokens)"
        )
    else:
        print(
            "mean-field likelihood forward+backward: head on every row / on the completion's "
            f"rows = {ratio:.2f}x"
        )


if __name__ == "__main__":
    main()
