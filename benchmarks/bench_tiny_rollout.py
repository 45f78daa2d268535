"""Rollout throughput of the shipped tiny model (completions per CPU second), with and without
DPS recording, at the default sampler settings (L 16, 8 steps, one block, temperature 0.9).

    python benchmarks/bench_tiny_rollout.py [--batch 96] [--repeats 7] [--stride 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from daca.models.loading import load
from daca.tasks import get_task
from daca.train.config import GenerationConfig
from daca.train.rollout import rollout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--stride", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bundle = load("tiny")
    task = get_task("sudoku")
    rows = task.load(split="train", limit=args.batch, seed=0)
    gen = GenerationConfig()

    def once(stride):
        g = torch.Generator().manual_seed(0)
        # CPU time of this process: robust to other jobs sharing the machine.
        t = time.process_time()
        rollout(bundle, task, rows, gen, generator=g, dps_stride=stride)
        return time.process_time() - t

    once(None), once(args.stride)  # warm-up
    plain, traced = [], []
    for _ in range(args.repeats):  # alternate so that machine noise hits both alike
        plain.append(once(None))
        traced.append(once(args.stride))
    p, d = statistics.median(plain), statistics.median(traced)
    print(f"batch {args.batch}, L {gen.gen_length}, {gen.steps} steps, block {gen.block_length}")
    print(f"without DPS: {args.batch / p:8.1f} completions/s (median {p * 1e3:.1f} ms CPU)")
    rate = args.batch / d
    print(f"with DPS s={args.stride}: {rate:8.1f} completions/s (median {d * 1e3:.1f} ms CPU)")
    print(f"DPS recording time ratio: {d / p:.3f}x")


if __name__ == "__main__":
    main()
