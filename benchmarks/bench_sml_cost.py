"""Cost of the Stratified Masking Likelihood against the mean-field estimate (METHOD.md §3).

Times ``stratified_logp(K)`` with the K views stacked in one batch and run one after another
(``views_per_forward=1``) against ``mean_field_logp`` on the same random model and inputs, for
the forward alone (no grad, as for the old/reference policies) and forward+backward (the current
policy). Repetitions of the variants are interleaved (the order rotates every round) and medians
are reported, so that noise from a shared machine hits all variants alike. Prints ratios only.

    python benchmarks/bench_sml_cost.py            # small default (about a minute on 1 CPU core)
    python benchmarks/bench_sml_cost.py --full     # 4 layers, d=256, V=4096, P=32, L=128, B=4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from daca.core.likelihood import mean_field_logp, stratified_logp
from daca.models.tiny import build_model, tiny_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the full size (see above)")
    ap.add_argument("--quick", action="store_true", help="the small default (kept for symmetry)")
    ap.add_argument("--num-strata", type=int, default=4)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.full:
        size = dict(layers=4, d=256, vocab=4096, P=32, L=128, B=4, reps=args.reps or 7)
    else:
        size = dict(layers=2, d=128, vocab=4096, P=16, L=64, B=2, reps=args.reps or 7)
    dev = torch.device(args.device)
    cfg = tiny_config(
        size["vocab"],
        hidden_size=size["d"],
        num_layers=size["layers"],
        num_heads=4,
        intermediate_size=2 * size["d"],
    )
    model = build_model(cfg, seed=0).to(dev)
    g = torch.Generator().manual_seed(0)
    mask_id = size["vocab"] - 1
    q = torch.randint(1, mask_id, (size["B"], size["P"]), generator=g).to(dev)
    o = torch.randint(1, mask_id, (size["B"], size["L"]), generator=g).to(dev)
    K = args.num_strata

    variants = {
        "mean_field": lambda gen: mean_field_logp(model, q, o, mask_id=mask_id),
        "sml_stacked": lambda gen: stratified_logp(
            model, q, o, mask_id=mask_id, num_strata=K, generator=gen
        ),
        "sml_sequential": lambda gen: stratified_logp(
            model, q, o, mask_id=mask_id, num_strata=K, generator=gen, views_per_forward=1
        ),
    }

    def run(fn, backward: bool) -> float:
        gen = torch.Generator(device=dev).manual_seed(1)
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if backward:
            fn(gen).sum().backward()
        else:
            with torch.no_grad():
                fn(gen)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    print(
        f"model: {size['layers']} layers, d={size['d']}, V={size['vocab']}; "
        f"B={size['B']}, P={size['P']}, L={size['L']}, K={K}; device={dev}, "
        f"threads={args.threads}, {size['reps']} interleaved reps, medians"
    )
    names = list(variants)
    for backward in (False, True):
        for name in names:  # warm-up
            run(variants[name], backward)
        times = {name: [] for name in names}
        for r in range(size["reps"]):
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                times[name].append(run(variants[name], backward))
        med = {name: statistics.median(ts) for name, ts in times.items()}
        mode = "forward+backward" if backward else "forward (no grad)"
        base = med["mean_field"]
        print(
            f"{mode:18s} mean_field {base * 1e3:8.1f} ms | "
            f"sml stacked / mean_field = {med['sml_stacked'] / base:.2f}x | "
            f"sml one view at a time / mean_field = {med['sml_sequential'] / base:.2f}x"
        )


if __name__ == "__main__":
    main()
