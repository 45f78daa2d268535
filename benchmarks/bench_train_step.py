"""Trainer step time: wd1 + DPS and wd1 + SML (K=4) against the wd1 base (issue 4, "Speed").

Builds one ``daca.train.trainer.Trainer`` per variant on the shipped tiny model (or, while
``src/daca/assets/tiny`` does not exist yet, a random model of the same size) with the tiny
Sudoku recipe's sizes, and runs ``train_step`` on each in turn: the order rotates every round,
so that noise from a shared machine hits every variant alike; one warm-up step each is dropped.
Prints the median step time of each variant, its ratio to the base (target for DPS: <= 1.03x;
the paper reports +11.7 % for SML at scale), and the share of the step spent in rollout,
reward and update (the trainer's time_rollout / time_reward / time_update).

    python benchmarks/bench_train_step.py --quick   # batch 48, 4 rounds (about a minute)
    python benchmarks/bench_train_step.py           # batch 96 (the recipe's), 8 rounds
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

VARIANTS = {
    "wd1": ["dps.enabled=false"],
    "wd1+dps": ["dps.enabled=true"],
    "wd1+sml4": ["dps.enabled=false", "sml.enabled=true", "sml.num_strata=4"],
    "wd1+dps+sml4": ["dps.enabled=true", "sml.enabled=true", "sml.num_strata=4"],
}


def stand_in_model(folder: Path) -> Path:
    """A random model in the shipped tiny model's format and size (daca.tools.pretrain defaults)."""
    from transformers.utils import logging as hf_logging

    from daca.models.tiny import new_tiny, save_tiny
    from daca.tools.pretrain import PretrainConfig

    hf_logging.disable_progress_bar()
    p = PretrainConfig()
    model, tok = new_tiny(
        hidden_size=p.hidden_size,
        num_layers=p.num_layers,
        num_heads=p.num_heads,
        intermediate_size=p.intermediate_size,
        prompt_width=p.prompt_width,
        gen_length=p.gen_length,
        seed=0,
    )
    return save_tiny(folder, model, tok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 48, 4 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="timed steps per variant")
    ap.add_argument("--batch", type=int, default=None, help="completions per step")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (4 if args.quick else 8)
    batch = args.batch or (48 if args.quick else 96)

    from daca.shipped import TINY_PATH
    from daca.train.config import load_config
    from daca.train.trainer import Trainer

    tmp = Path(tempfile.mkdtemp(prefix="bench-train-step-"))
    if TINY_PATH.is_dir():
        model, which = "tiny", "the shipped tiny model"
    else:
        model = str(stand_in_model(tmp / "model"))
        which = "a random model of the tiny model's size (src/daca/assets/tiny not found)"
    common = [
        f"model={model}",
        f"output_dir={tmp}",
        "task=sudoku",
        "method=wd1",
        "device=cpu",
        "num_generations=6",
        f"per_device_train_batch_size={batch}",
        "generation.gen_length=16",
        "generation.steps=8",
        "generation.block_length=16",
        "dps.stride=2",
        "dps.lam=0.5",
        "train_size=500",
        "eval_size=1",
        "tensorboard=false",
    ]
    trainers = {
        name: Trainer(load_config(None, [*common, *over, f"name={name}"]), progress=False)
        for name, over in VARIANTS.items()
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

    print(f"trainer step on {which}: Sudoku, wd1, {batch} completions (G=6), T=8, L=16,")
    print(f"DPS stride 2, SML K=4, {args.threads} thread(s), median of {rounds} alternated steps")
    heads = ("step s", "ratio", "rollout", "reward", "update")
    print(f"{'variant':14s} " + " ".join(f"{h:>8s}" for h in heads))
    base = med("wd1", "time_step")
    for n in names:
        step = med(n, "time_step")
        shares = [med(n, f"time_{k}") / step for k in ("rollout", "reward", "update")]
        print(
            f"{n:14s} {step:8.3f} {step / base:7.3f}x "
            + " ".join(f"{100 * s:7.1f}%" for s in shares)
        )
    # Ratios of the phases the plug-ins touch (DPS: the traced rollout; SML: the update).
    ro = med("wd1+dps", "time_rollout") / med("wd1", "time_rollout")
    up = med("wd1+sml4", "time_update") / med("wd1", "time_update")
    print(f"rollout with the DPS trace / without: {ro:.3f}x")
    print(f"update with SML K=4 / without: {up:.3f}x")


if __name__ == "__main__":
    main()
