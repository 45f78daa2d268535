"""Rollout time of a block-causal model (LLaDA 2.x) with the block KV cache, with and without
the DPS trace, against no cache (docs/rollouts.md, "Block-causal models").

Random dense models in LLaDA 2.x's layout (``daca.models.native_llada2``, every layer below
``first_k_dense_replace``, so that the attention and the cache, not a Python loop over experts,
set the cost) at d 128, 256 and 512 (4, 4 and 8 layers) generate one completion per prompt at
P 64, L 256, T 128, blocks of 32, V 64: ``cache`` "none", "dual" and "dual" with the trace at
``dps_stride`` 4 (scope "all"). Under block-causal attention every cached step is exact, so
each cached rollout must give none's tokens (checked, printed as "same tokens"). Printed per
size: the median process CPU time of each (one thread), the speed-up over "none", the cost
model's bound on it and the fraction of the bound reached.

The bound counts token-forwards (a forward's cost taken as its query length). Every forward
stops at the last position its logits are read from (nothing after it changes anything before
it): none runs P + the blocks up to the one it decodes, at every step; dual runs P + the block
at the first block's start (P + L when recorded: the trace reads every later block), at each
later block c's start an extension from the block before it (2 blocks; L - (c - 1) block when
recorded), at each recorded step within a block a suffix refresh (L - c block; in the last
block the block alone), and the block alone at every other step.

    python benchmarks/bench_block_causal_cache.py                 # d 128/256/512, batch 8
    python benchmarks/bench_block_causal_cache.py --sizes d128    # one size
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rollout_cache import (  # noqa: E402
    SETTING,
    SIZES,
    interleaved,
    prompts,
    speedup_row,
    with_steady_allocator,
)

from daca.core.sampler import generate  # noqa: E402
from daca.models.native_llada2 import LLaDA2ForDiffusionLM, llada2_config  # noqa: E402


def random_llada2(layers, d, heads, vocab, block, seed=0):
    hub = dict(
        hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, head_dim=d // heads, intermediate_size=3 * d,
        moe_intermediate_size=d, num_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1,
        num_shared_experts=1, first_k_dense_replace=layers, vocab_size=vocab,
        attention_block_size=block, use_bias=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LLaDA2ForDiffusionLM(llada2_config(hub)).eval()


def token_forwards(P, L, T, bl, stride, mode):
    """The query positions a rollout's forwards run (the module docstring's count)."""
    k = T // (L // bl)
    total = 0
    for t in range(T):
        c, i = divmod(t, k)
        recorded = stride is not None and t % stride == 0
        if mode == "none":
            total += P + (L if recorded else (c + 1) * bl)
        elif i == 0 and c == 0:
            total += P + (L if recorded else bl)
        elif i == 0:
            total += L - (c - 1) * bl if recorded else 2 * bl
        elif recorded:
            total += L - c * bl
        else:
            total += bl
    return total


def block_causal_bound(P, L, T, bl, stride, mode):
    """none's token-forwards (without the trace) over the variant's."""
    return token_forwards(P, L, T, bl, None, "none") / token_forwards(P, L, T, bl, stride, mode)


def bound_of(size, mode, stride):
    return block_causal_bound(size["prompt"], size["L"], size["T"], size["block"], stride, mode)


def timed(model, prompt, size, mode, stride):
    t0 = time.process_time()
    with torch.no_grad():
        out = generate(
            model, prompt, mask_id=size["vocab"] - 1, gen_length=size["L"], steps=size["T"],
            block_length=size["block"], cache=mode, dps_stride=stride,
        )  # fmt: skip
    return time.process_time() - t0, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--stride", type=int, default=4)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--as-is", action="store_true", help="keep glibc's default allocator settings")
    args = ap.parse_args()
    with_steady_allocator()
    torch.set_num_threads(1)
    print(
        f"random dense LLaDA 2.x layout, {SETTING}, batch {args.batch}, one thread, median of "
        f"{args.repeats}, trace stride {args.stride}"
    )
    head = f"{'size':<6}{'none s':>8}{'dual s':>8}{'speed-up':>10}{'bound':>7}{'frac':>6}"
    print(head + f"{'dual+trace s':>14}{'speed-up':>10}{'bound':>7}{'frac':>6}  same tokens")
    variants = [("none", None), ("dual", None), ("dual", args.stride)]
    for name in args.sizes:
        arch = SIZES[name]
        size = SETTING | arch
        model = random_llada2(**arch, vocab=size["vocab"], block=size["block"])
        prompt = prompts(size, args.batch)
        runs = interleaved(model, prompt, size, variants, args.repeats, timed)
        median = {v: statistics.median(r[0] for r in runs[v]) for v in variants}
        none = runs[("none", None)][0][1].sequences
        same = all(torch.equal(r[1].sequences, none) for v in variants for r in runs[v])
        row = speedup_row(name, median, variants, lambda v, size=size: bound_of(size, *v))
        print(row + f"  {same}", flush=True)


if __name__ == "__main__":
    main()
