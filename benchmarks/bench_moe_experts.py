"""The routed experts' loop (``daca.models.native_moe._Experts``, LLaDA-MoE's and LLaDA 2.x's)
against the per-expert scan it replaced (transformers' eager expert loop: ``torch.where`` over
every (token, slot) pair and a host sync per expert), on one MoE layer's random experts and
random top-k routing, forward and forward + backward. Checks the outputs and the gradients equal
to the bit, prints the speed-up (median over interleaved rounds, so that noise from a shared
machine hits both alike).

    python benchmarks/bench_moe_experts.py           # 64 and 256 experts, d 256, 3072 tokens
    python benchmarks/bench_moe_experts.py --quick   # fewer rounds
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from daca.models.native_moe import _Experts

# (experts, top k): LLaDA-MoE-7B-A1B's and LLaDA2.0-mini's routing, at small widths.
SETTINGS = {"64 experts, top 8": (64, 8), "256 experts, top 8": (256, 8)}


def scan_per_expert(experts, hidden_states, top_k_index, top_k_weights):
    """The loop before: every pair scanned for each expert present, a host sync each."""
    out = torch.zeros_like(hidden_states)
    for j in top_k_index.unique().tolist():
        token, slot = torch.where(top_k_index == j)
        y = experts[j](hidden_states[token]) * top_k_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def routed(experts: int, k: int, tokens: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=g)
    weights, index = torch.randn(tokens, experts, generator=g).softmax(-1).topk(k, dim=-1)
    return x, index, weights


def timed(fn, backward: bool) -> float:
    start = time.process_time()
    out = fn()
    if backward:
        out.square().sum().backward()
    return time.process_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of 9")
    ap.add_argument("--tokens", type=int, default=3072, help="6 sequences of 512 tokens")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--expert-width", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rounds = 3 if args.quick else 9
    print(f"one thread, CPU time, {args.tokens} tokens, d {args.hidden}, width {args.expert_width}")
    for label, (E, k) in SETTINGS.items():
        compare(label, E, k, args, rounds)


def compare(label: str, E: int, k: int, args, rounds: int) -> None:
    """One setting: bit-equality of outputs and gradients, then the speed-up printed."""
    config = SimpleNamespace(
        num_experts=E, moe_intermediate_size=args.expert_width, hidden_size=args.hidden,
        hidden_act="silu",
    )  # fmt: skip
    torch.manual_seed(0)
    experts = _Experts(config)
    x, index, weights = routed(E, k, args.tokens, args.hidden)
    variants = {
        "scan": lambda: scan_per_expert(experts, x, index, weights),
        "sorted": lambda: experts(x, index, weights),
    }
    grads = {}
    for name, fn in variants.items():
        experts.zero_grad()
        out = fn()
        out.square().sum().backward()
        grads[name] = (out, [p.grad.clone() for p in experts.parameters()])
    same = torch.equal(grads["scan"][0], grads["sorted"][0]) and all(
        torch.equal(a, b) for a, b in zip(grads["scan"][1], grads["sorted"][1], strict=True)
    )
    for backward in (False, True):
        times = {name: [] for name in variants}
        for r in range(rounds):
            for name in list(variants)[r % 2 :] + list(variants)[: r % 2]:
                experts.zero_grad()
                with torch.set_grad_enabled(backward):
                    times[name].append(timed(variants[name], backward))
        ratio = statistics.median(times["scan"]) / statistics.median(times["sorted"])
        phase = "forward + backward" if backward else "forward"
        print(f"{label:20s} {phase:20s} sorted {ratio:5.2f}x the scan; bit-equal: {same}")


if __name__ == "__main__":
    main()
