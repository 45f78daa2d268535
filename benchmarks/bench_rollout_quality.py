"""What the fast-rollout options change on the shipped tiny models: held-out accuracy and mean
number of steps at temperature 0 with each option (no cache, the block KV cache, confidence-
threshold parallel decoding), the paired difference to no option over the same problems (with
its 95 % t interval), and the DPS multipliers of the same prompts with and without the
cache (Spearman rank correlation over tokens, stride 2; recorded steps as full refreshes or as
suffix refreshes, ``trace_refresh="suffix"``). See docs/rollouts.md.

    python benchmarks/bench_rollout_quality.py                # sudoku and countdown, 200 each
    python benchmarks/bench_rollout_quality.py --tasks countdown --limit 50
    python benchmarks/bench_rollout_quality.py --tasks sudoku-trace countdown-trace   # L 64
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from daca.core import dps
from daca.models.loading import load
from daca.shipped import tiny_for_task
from daca.tasks import get_task
from daca.tasks.rewards import score_completions
from daca.tools.compare import paired_interval
from daca.train.config import GenerationConfig
from daca.train.rollout import rollout

SETTINGS = [
    ("none", {}),
    ("dual", {"cache": "dual"}),
    ("dual r4", {"cache": "dual", "refresh_every": 4}),
    ("dual r2", {"cache": "dual", "refresh_every": 2}),
    ("prefix", {"cache": "prefix"}),
    ("none τ0.9", {"parallel_threshold": 0.9}),
    ("dual τ0.9", {"cache": "dual", "parallel_threshold": 0.9}),
    ("dual τ0.7", {"cache": "dual", "parallel_threshold": 0.7}),
    ("none τ0.5", {"parallel_threshold": 0.5}),
]

TRACED = [  # with the DPS trace at stride 2; the first is the reference
    ("none s2", {}),
    ("dual s2", {"cache": "dual"}),
    ("dual s2 sfx", {"cache": "dual", "trace_refresh": "suffix"}),
]


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def measure(name: str, limit: int) -> None:
    bundle = load(tiny_for_task("tiny", name))
    task = get_task(name)
    rows = task.load(split="test", limit=limit, seed=0)
    known = {f.name for f in dataclasses.fields(GenerationConfig)}
    base = GenerationConfig(**{k: v for k, v in bundle.meta["generation"].items() if k in known})
    columns = {c: [r.get(c) for r in rows] for c in task.columns}
    print(f"{name}: {len(rows)} problems, L {base.gen_length}, {base.steps} steps, "
          f"block {base.block_length}")  # fmt: skip
    reference = None  # the scores of the first setting ("none"), per problem
    for label, options in SETTINGS:
        done = rollout(bundle, task, rows, dataclasses.replace(base, **options), temperature=0.0)
        scores = score_completions(task.score, done.texts, columns, on_error="zero", timeout=30)
        steps = done.rollout.steps_taken.float().mean()
        reference = scores if reference is None else reference
        diffs = [a - b for a, b in zip(scores, reference, strict=True)]
        delta = f"{sum(diffs) / len(diffs):+.3f} ± {paired_interval(diffs) or 0:.3f}"
        print(f"  {label:<11} accuracy {sum(scores) / len(scores):.3f} ({delta} vs none, paired)  "
              f"mean steps {steps:.2f}  forwards {done.rollout.forwards}")  # fmt: skip
    traced = {}
    for label, options in TRACED:
        gen = dataclasses.replace(base, **options)
        done = rollout(bundle, task, rows, gen, temperature=0.0, dps_stride=2)
        scores = score_completions(task.score, done.texts, columns, on_error="zero", timeout=30)
        print(f"  {label:<11} accuracy {sum(scores) / len(scores):.3f}  "
              f"forwards {done.rollout.forwards} (DPS stride 2)")  # fmt: skip
        traced[label] = done.rollout
    plain = traced[TRACED[0][0]]
    a = dps.rollout_multipliers(plain, lam=0.5)
    for label, _ in TRACED[1:]:
        b = dps.rollout_multipliers(traced[label], lam=0.5)
        same = (plain.completion_ids == traced[label].completion_ids).all(1)
        # on the rows whose completions agree, what differs is only the trace's logits
        agree = spearman(a[same].flatten(), b[same].flatten()) if same.sum() > 1 else float("nan")
        print(f"  DPS multipliers (stride 2), {label} vs none: Spearman "
              f"{spearman(a.flatten(), b.flatten()):.3f} over {a.numel()} tokens; identical "
              f"completions {same.float().mean():.3f}, Spearman on those {agree:.3f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="*", default=["sudoku", "countdown"])
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.tasks:
        measure(name, args.limit)


if __name__ == "__main__":
    main()
