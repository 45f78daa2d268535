"""Rollout time with the block KV cache (docs/rollouts.md), with and without the DPS trace.

Random LLaDA-architecture models (transformers' Llama run bidirectionally through
``daca.models.native``) generate one completion per prompt. Default (issue 36): for d 128, 256
and 512 (4, 4 and 8 layers) at P 64, L 256, T 128, block 32, V 64, ``cache`` "none", "dual" and
"dual" with the trace at ``dps_stride`` 4 (scope "all"); printed per size: the median process
CPU time of each (one thread), the speed-up over "none", the cost model's bound on it and the
fraction of the bound reached (target >= 90 % with the trace), and the share of the traced
rollout spent inside the model's forwards (the rest is the sampler and the trace).

``--memory``: the peak resident memory one rollout adds (a fresh process per variant, glibc's
defaults, so that freed activations leave the process), "none" against "dual", at d 512 and
batch 8 (T 16): the dual rollout's extra memory over "none", as a multiple of the cache's own
bytes (2 x layers x B x heads x (P + L) x head width x 4): 1.0 would be the cache alone.

``--variants``: one size (8 layers, d 512, V 32k, P 128; ``--quick`` smaller), every variant:
"none", "prefix" and "dual", each without and with ``dps_stride``, and "dual" with
``trace_refresh="suffix"`` (a recorded step recomputes only the block and its suffix), with the
forwards the sampler ran (full / block).

The script re-runs itself with glibc's allocator told to keep freed memory (``STEADY_MALLOC``;
``--as-is`` keeps the defaults), since otherwise "none" varies by up to +-20 % between runs.

The bound is the ratio of token-forwards, none's T (P + L) over the variant's sum of query
lengths (a full forward P + L, a dual block step block_length, a prefix block step or a suffix
refresh L - block start): what the cache saves if a forward's cost were its query length.

    python benchmarks/bench_rollout_cache.py                # d 128/256/512, batch 8
    python benchmarks/bench_rollout_cache.py --batch 1      # the same, one sequence
    python benchmarks/bench_rollout_cache.py --variants     # 8 layers, d 512, V 32k, every variant
    python benchmarks/bench_rollout_cache.py --variants --quick   # 4 layers, d 256, V 8k, L 64
    python benchmarks/bench_rollout_cache.py --memory       # d 512, batch 8: peak memory
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from daca.core.sampler import generate
from daca.models.native import LLaDAForDiffusionLM, llama_config

SIZES = {  # issue 36: small models, where per-step overhead would show
    "d128": dict(layers=4, d=128, heads=4),
    "d256": dict(layers=4, d=256, heads=4),
    "d512": dict(layers=8, d=512, heads=8),
}
SETTING = dict(vocab=64, L=256, T=128, block=32, prompt=64)
FULL = dict(layers=8, d=512, heads=8, vocab=32000, L=256, T=128, block=32, prompt=128)
QUICK = dict(layers=4, d=256, heads=4, vocab=8000, L=64, T=32, block=16, prompt=32)


# glibc returns a large forward's freed activations to the system and faults them in again by an
# amount that differs from run to run (docs/rollouts.md): "none" then varies by +-20 % between
# runs. These settings keep freed memory in the process, so each ratio measures compute.
STEADY_MALLOC = {
    "MALLOC_TRIM_THRESHOLD_": "4000000000",
    "MALLOC_MMAP_THRESHOLD_": "4000000000",
    "MALLOC_TOP_PAD_": "268435456",
}


def with_steady_allocator() -> None:
    """Re-run this script under ``STEADY_MALLOC`` unless it already runs so (or --as-is)."""
    if "--as-is" in sys.argv or all(os.environ.get(k) == v for k, v in STEADY_MALLOC.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | STEADY_MALLOC)


def random_llada(layers, d, heads, vocab, positions, seed=0):
    hub = dict(
        d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=heads, mlp_hidden_size=3 * d,
        vocab_size=vocab, embedding_size=vocab, max_sequence_length=positions,
        rope_theta=10000.0, block_type="llama", layer_norm_type="rms", activation_type="silu",
        rope=True, mask_token_id=vocab - 1,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LLaDAForDiffusionLM(llama_config(hub)).eval()


def cost_bound(P, L, T, bl, stride, mode, trace_refresh="full"):
    """none's token-forwards over the variant's: a refresh at each block start (and at each
    recorded step with trace_refresh "full") costs P + L; a suffix refresh and a prefix block
    step L - block start; a dual block step bl."""
    k = T // (L // bl)
    total = 0
    for t in range(T):
        c, i = divmod(t, k)
        recorded = stride is not None and t % stride == 0
        if mode == "none" or i == 0 or (recorded and trace_refresh == "full"):
            total += P + L
        elif recorded or mode == "prefix":
            total += L - c * bl
        else:
            total += bl
    return T * (P + L) / total


def timed(model, prompt, size, mode, stride, trace_refresh="full"):
    """(process CPU seconds of one rollout, of them inside the model's forwards, the rollout)."""
    in_model = [0.0]
    start = []
    pre = model.register_forward_pre_hook(lambda *_: start.append(time.process_time()))
    post = model.register_forward_hook(
        lambda *_: in_model.__setitem__(0, in_model[0] + time.process_time() - start.pop())
    )
    t0 = time.process_time()
    out = generate(
        model, prompt, mask_id=size["vocab"] - 1, gen_length=size["L"], steps=size["T"],
        block_length=size["block"], cache=mode, dps_stride=stride, trace_refresh=trace_refresh,
    )  # fmt: skip
    seconds = time.process_time() - t0
    pre.remove()
    post.remove()
    return seconds, in_model[0], out


def prompts(size, batch):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, size["vocab"] - 1, (batch, size["prompt"]), generator=g)


def bound_of(size, mode, stride, trace_refresh="full"):
    P, L, T, bl = size["prompt"], size["L"], size["T"], size["block"]
    return cost_bound(P, L, T, bl, stride, mode, trace_refresh)


def interleaved(model, prompt, size, variants, repeats, run) -> dict:
    """{variant: [run(model, prompt, size, *variant) per repeat]}, the variants interleaved
    so that a busy spell hits every one."""
    runs = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            runs[v].append(run(model, prompt, size, *v))
    return runs


def speedup_row(name, median, variants, bound) -> str:
    """A table row: none's seconds, then each cached variant's seconds, speed-up over none,
    its bound (``bound(variant)``) and the fraction of the bound reached."""
    base = median[variants[0]]
    row = f"{name:<6}{base:>8.1f}"
    for v in variants[1:]:
        up, limit = base / median[v], bound(v)
        row += f"{median[v]:>{8 if v[1] is None else 14}.1f}{up:>9.2f}x{limit:>6.2f}x"
        row += f"{up / limit:>6.0%}"
    return row


def by_size(args):
    """The default table: none, dual and dual with the trace at each of ``SIZES``."""
    print(
        f"random LLaDA, {SETTING}, batch {args.batch}, one thread, median of {args.repeats}, "
        f"trace stride {args.stride}"
    )
    head = f"{'size':<6}{'none s':>8}{'dual s':>8}{'speed-up':>10}{'bound':>7}{'frac':>6}"
    print(head + f"{'dual+trace s':>14}{'speed-up':>10}{'bound':>7}{'frac':>6}{'in model':>10}")
    variants = [("none", None), ("dual", None), ("dual", args.stride)]
    for name in args.sizes:
        arch = SIZES[name]
        size = SETTING | arch
        model = random_llada(**arch, vocab=size["vocab"], positions=size["prompt"] + size["L"])
        prompt = prompts(size, args.batch)
        runs = interleaved(model, prompt, size, variants, args.repeats, timed)
        median = {v: statistics.median(r[0] for r in runs[v]) for v in variants}
        row = speedup_row(name, median, variants, lambda v, size=size: bound_of(size, *v))
        in_model = statistics.median(r[1] / r[0] for r in runs[variants[2]])
        print(row + f"{in_model:>10.0%}", flush=True)


def every_variant(args):
    """The ``--variants`` table: every cache mode with and without the trace, one size."""
    size = QUICK if args.quick else FULL
    model = random_llada(size["layers"], size["d"], size["heads"], size["vocab"],
                         size["prompt"] + size["L"])  # fmt: skip
    prompt = prompts(size, args.batch)
    print(f"random LLaDA {size}, batch {args.batch}, one thread, median of {args.repeats}")
    variants = [(m, s, "full") for m in ("none", "prefix", "dual") for s in (None, args.stride)]
    variants.append(("dual", args.stride, "suffix"))
    times = {v: [] for v in variants}
    forwards = {}
    for _ in range(args.repeats):
        for v in variants:
            seconds, _, out = timed(model, prompt, size, *v)
            times[v].append(seconds)
            forwards[v] = out.forwards
    base = statistics.median(times[("none", None, "full")])
    print(f"{'variant':<22}{'CPU s':>8}{'speed-up':>10}{'bound':>8}  forwards")
    for v in variants:
        mode, stride, trace_refresh = v
        t = statistics.median(times[v])
        name = f"{mode}" + (f", s={stride}" if stride else "")
        name += ", suffix" if trace_refresh == "suffix" else ""
        bound = bound_of(size, *v)
        print(f"{name:<22}{t:>8.1f}{base / t:>9.2f}x{bound:>7.2f}x  {forwards[v]}")


def peak_added(mode: str, name: str, batch: int) -> None:
    """(child) Print the peak RSS, in bytes, that one rollout of ``mode`` adds."""
    arch = SIZES[name]
    size = SETTING | arch | {"T": 16}  # 2 steps per block: every refresh, fewer steps
    model = random_llada(**arch, vocab=size["vocab"], positions=size["prompt"] + size["L"])
    prompt = prompts(size, batch)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    timed(model, prompt, size, mode, None)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)  # KiB on Linux


def by_memory(args):
    """The ``--memory`` table: none and dual, each in a fresh process."""
    name, batch = "d512", args.batch
    arch, size = SIZES[name], SETTING | SIZES[name]
    cache_bytes = 2 * arch["layers"] * batch * (size["prompt"] + size["L"]) * arch["d"] * 4
    added = {}
    for mode in ("none", "dual"):
        cmd = [sys.executable, __file__, "--as-is", "--memory-child", mode, name, str(batch)]
        added[mode] = int(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    extra = added["dual"] - added["none"]
    print(f"random LLaDA {name}, {SETTING | {'T': 16}}, batch {batch}: peak RSS a rollout adds")
    print(f"none {added['none'] / 2**20:.0f} MiB, dual {added['dual'] / 2**20:.0f} MiB; "
          f"dual - none {extra / 2**20:.0f} MiB = {extra / cache_bytes:.2f}x the cache's "
          f"{cache_bytes / 2**20:.0f} MiB")  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variants", action="store_true", help="every variant at one size")
    ap.add_argument("--quick", action="store_true", help="with --variants: smaller sizes")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--batch", type=int, default=None, help="sequences (default 8; --variants 1)")
    ap.add_argument("--stride", type=int, default=4)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--as-is", action="store_true", help="keep glibc's default allocator settings")
    ap.add_argument("--memory", action="store_true", help="peak memory of none and dual")
    ap.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory or args.memory_child:
        torch.set_num_threads(1)
        if args.memory_child:
            peak_added(args.memory_child[0], args.memory_child[1], int(args.memory_child[2]))
        else:
            args.batch = args.batch or 8
            by_memory(args)
        return
    with_steady_allocator()
    torch.set_num_threads(1)
    if args.variants:
        args.batch = args.batch or 1
        every_variant(args)
    else:
        args.batch = args.batch or 8
        by_size(args)


if __name__ == "__main__":
    main()
