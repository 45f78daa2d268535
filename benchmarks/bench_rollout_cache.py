"""Rollout time with the block KV cache (docs/rollouts.md), with and without the DPS trace.

A random LLaDA-architecture model (transformers' Llama run bidirectionally through
``daca.models.native``) generates one completion per prompt with ``cache`` "none", "prefix" and
"dual", each without and with ``dps_stride`` (scope "all"), and "dual" with the trace's
``trace_refresh="suffix"`` (a recorded step recomputes only the block and its suffix). Printed
per variant: the median
process CPU time of the runs (one thread), its speed-up over "none" without the trace, the
forwards the sampler ran (full / block) and the cost model's bound on that speed-up: the ratio
of token-forwards, none's T (P + L) over the variant's sum of query lengths (a full forward
P + L, a dual block step block_length, a prefix block step or a suffix refresh L - block
start). Targets of the
issue at the full size: dual >= 4x, dual with s = 4 >= 2.5x.

    python benchmarks/bench_rollout_cache.py            # 8 layers, d 512, V 32k, L 256, T 128
    python benchmarks/bench_rollout_cache.py --quick    # 4 layers, d 256, V 8k, L 64, T 32
"""

import argparse
import statistics
import time

import torch

from daca.core.sampler import generate
from daca.models.native import LLaDAForDiffusionLM, llama_config

FULL = dict(layers=8, d=512, heads=8, vocab=32000, L=256, T=128, block=32, prompt=128)
QUICK = dict(layers=4, d=256, heads=4, vocab=8000, L=64, T=32, block=16, prompt=32)


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes (minutes on 2 cores)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--stride", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    size = QUICK if args.quick else FULL
    P, L, T, bl = size["prompt"], size["L"], size["T"], size["block"]
    model = random_llada(size["layers"], size["d"], size["heads"], size["vocab"], P + L)
    mask_id = size["vocab"] - 1
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, mask_id, (args.batch, P), generator=g)
    print(f"random LLaDA {size}, batch {args.batch}, one thread, median of {args.repeats}")
    variants = [(m, s, "full") for m in ("none", "prefix", "dual") for s in (None, args.stride)]
    variants.append(("dual", args.stride, "suffix"))
    times = {v: [] for v in variants}
    forwards = {}
    for _ in range(args.repeats):
        for v in variants:
            mode, stride, trace_refresh = v
            t0 = time.process_time()
            out = generate(
                model, prompt, mask_id=mask_id, gen_length=L, steps=T, block_length=bl,
                cache=mode, dps_stride=stride, trace_refresh=trace_refresh,
            )  # fmt: skip
            times[v].append(time.process_time() - t0)
            forwards[v] = out.forwards
    base = statistics.median(times[("none", None, "full")])
    print(f"{'variant':<22}{'CPU s':>8}{'speed-up':>10}{'bound':>8}  forwards")
    for v in variants:
        mode, stride, trace_refresh = v
        t = statistics.median(times[v])
        name = f"{mode}" + (f", s={stride}" if stride else "")
        name += ", suffix" if trace_refresh == "suffix" else ""
        bound = cost_bound(P, L, T, bl, stride, mode, trace_refresh)
        print(f"{name:<22}{t:>8.1f}{base / t:>9.2f}x{bound:>7.2f}x  {forwards[v]}")


if __name__ == "__main__":
    main()
