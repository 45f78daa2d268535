"""Trainer step time: wd1 + DPS and wd1 + SML (K=4) against the wd1 base (issue 4, "Speed");
with ``--setting trace``, the step of the paper's regime in miniature (sudoku-trace, L 64 in
two blocks of 32, 32 steps, DPS stride 2) with the block KV cache against without, and with
the cache and parallel decoding at threshold 0.9 against the cache alone (issue 20); with
``--setting grid``, a cell of the trace grids (docs/results.md: Diffu-GRPO, μ 2, the dual cache,
temperature 0.9): + DPS, + SML (K 4) and full DACA against the base (issue 34, "Speed").

Builds one ``daca.train.trainer.Trainer`` per variant on the shipped tiny model (or, while
``src/daca/assets/tiny`` does not exist yet, a random model of the same size) with the tiny
Sudoku recipe's sizes, and runs ``train_step`` on each in turn: the order rotates every round,
so that noise from a shared machine hits every variant alike; one warm-up step each is dropped.
Prints the median step time of each variant, its ratio to the base (target for DPS: <= 1.03x;
the paper reports +11.7 % for SML at scale), and the share of the step spent in rollout,
reward and update (the trainer's time_rollout / time_reward / time_update).

    python benchmarks/bench_train_step.py --quick   # batch 48, 4 rounds (about a minute)
    python benchmarks/bench_train_step.py           # batch 96 (the recipe's), 8 rounds
    python benchmarks/bench_train_step.py --setting trace   # the trace task, cache vs none
    python benchmarks/bench_train_step.py --setting trace --task countdown-trace
    python benchmarks/bench_train_step.py --setting grid    # the trace grids' cell
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from daca.tools.compare import METHOD_OVERRIDES, VARIANTS

STEP_VARIANTS = {
    "wd1": ["dps.enabled=false"],
    "wd1+dps": ["dps.enabled=true"],
    "wd1+sml4": ["dps.enabled=false", "sml.enabled=true", "sml.num_strata=4"],
    "wd1+dps+sml4": ["dps.enabled=true", "sml.enabled=true", "sml.num_strata=4"],
}


# The trace setting: the cache on and off, both with the DPS trace of the paper's stride, and the
# cache with confidence-threshold parallel decoding (docs/rollouts.md) on top.
TRACE_VARIANTS = {
    "wd1+dps": ["dps.enabled=true", "generation.cache=none"],
    "wd1+dps dual": ["dps.enabled=true", "generation.cache=dual"],
    "wd1+dps dual t0.9": [
        "dps.enabled=true",
        "generation.cache=dual",
        "generation.parallel_threshold=0.9",
    ],
}


# A cell of the trace grids (`daca compare --task sudoku-trace ... generation.cache=dual`): the
# grid's own variant switches and Diffu-GRPO's settings (its compare_iterations μ), SML at the
# default K = 4.
GRID_VARIANTS = {"base": VARIANTS["base"], **{f"+{v}": VARIANTS[v] for v in ("dps", "sml", "daca")}}
GRID = [
    *METHOD_OVERRIDES["diffu_grpo"], "learning_rate=1e-4", "generation.cache=dual",
    "generation.temperature=0.9",
]  # fmt: skip


def stand_in_model(folder: Path, task: str) -> Path:
    """A random model in the shipped tiny models' format and size for ``task``."""
    from transformers.utils import logging as hf_logging

    from daca.models.tiny import new_tiny, save_tiny
    from daca.tasks import get_task

    hf_logging.disable_progress_bar()
    model, tok = new_tiny(words=get_task(task).compact_vocabulary, seed=0)
    return save_tiny(folder, model, tok)


def settings(setting: str, task: str | None) -> tuple[str, dict, list[str]]:
    """(task, variants, overrides) of a setting."""
    if setting == "grid":
        return task or "sudoku-trace", GRID_VARIANTS, GRID
    if setting == "trace":
        return task or "sudoku-trace", TRACE_VARIANTS, [
            "generation.gen_length=64", "generation.steps=32", "generation.block_length=32",
        ]  # fmt: skip
    return "sudoku", STEP_VARIANTS, [
        "generation.gen_length=16", "generation.steps=8", "generation.block_length=16",
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 48, 4 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="timed steps per variant")
    ap.add_argument("--batch", type=int, default=None, help="completions per step")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--setting", choices=["tiny", "trace", "grid"], default="tiny")
    ap.add_argument("--model", help="model folder (default: the task's shipped tiny model)")
    ap.add_argument(
        "--task", help="with --setting trace or grid: sudoku-trace (default), countdown-trace"
    )
    args = ap.parse_args()
    if args.task and args.setting == "tiny":
        ap.error("--task goes with --setting trace or grid")
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (4 if args.quick else 8)
    batch = args.batch or (48 if args.quick or args.setting != "tiny" else 96)
    task, variants, overrides = settings(args.setting, args.task)

    from daca.shipped import tiny_for_task
    from daca.train.config import load_config
    from daca.train.trainer import Trainer

    tmp = Path(tempfile.mkdtemp(prefix="bench-train-step-"))
    try:
        model = args.model or tiny_for_task("tiny", task) or "tiny"
        which = args.model or f"the shipped tiny model of {task}"
    except ValueError:  # no shipped model for the task yet
        model = str(stand_in_model(tmp / "model", task))
        which = f"a random model of the tiny model's size ({task} has no shipped model)"
    common = [
        f"model={model}",
        f"output_dir={tmp}",
        f"task={task}",
        "method=wd1",  # the grid's overrides name their own
        "device=cpu",
        "num_generations=6",
        f"per_device_train_batch_size={batch}",
        *overrides,
        "dps.stride=2",
        "dps.lam=0.5",
        "train_size=500",
        "eval_size=1",
        "tensorboard=false",
    ]
    trainers = {
        name: Trainer(load_config(None, [*common, *over, f"name={name}"]), progress=False)
        for name, over in variants.items()
    }
    names = list(trainers)
    times: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds + 1):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            stats = trainers[n].train_step()
            stats["time_step"] = time.perf_counter() - t0
            if r > 0:  # round 0 warms up
                times[n].append(stats)

    def med(n: str, key: str) -> float:
        return statistics.median(s[key] for s in times[n])

    cfg = trainers[names[0]].cfg
    gen = cfg.generation
    print(
        f"trainer step on {which}: {task}, {cfg.method} (μ {cfg.num_iterations}), {batch} "
        f"completions (G=6), L={gen.gen_length}, cache {gen.cache},"
    )
    print(f"DPS stride 2, {args.threads} thread(s), median of {rounds} alternated steps")
    heads = ("step s", "ratio", "rollout", "reward", "update", "T_b")
    print(f"{'variant':18s} " + " ".join(f"{h:>8s}" for h in heads))
    base = med(names[0], "time_step")
    for n in names:
        step = med(n, "time_step")
        shares = [med(n, f"time_{k}") / step for k in ("rollout", "reward", "update")]
        print(
            f"{n:18s} {step:8.3f} {step / base:7.3f}x "
            + " ".join(f"{100 * s:7.1f}%" for s in shares)
            + f" {med(n, 'rollout_steps'):8.2f}"  # denoising steps a completion took
        )
    if args.setting == "trace":
        for label, slow, fast in (
            ("without the cache / with it (dual)", "wd1+dps", "wd1+dps dual"),
            ("with dual / dual + parallel decoding at 0.9", "wd1+dps dual", "wd1+dps dual t0.9"),
        ):
            step = med(slow, "time_step") / med(fast, "time_step")
            ro = med(slow, "time_rollout") / med(fast, "time_rollout")
            print(f"step {label}: {step:.3f}x; rollout: {ro:.3f}x")
        return
    if args.setting == "grid":
        up = med("+sml", "time_update") / med("base", "time_update")
        ro = med("+dps", "time_rollout") / med("base", "time_rollout")
        print(f"rollout with the DPS trace / without: {ro:.3f}x")
        print(f"update with SML K=4 / without: {up:.3f}x")
        return
    # Ratios of the phases the plug-ins touch (DPS: the traced rollout; SML: the update).
    ro = med("wd1+dps", "time_rollout") / med("wd1", "time_rollout")
    up = med("wd1+sml4", "time_update") / med("wd1", "time_update")
    print(f"rollout with the DPS trace / without: {ro:.3f}x")
    print(f"update with SML K=4 / without: {up:.3f}x")


if __name__ == "__main__":
    main()
