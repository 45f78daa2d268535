"""``daca train``: with no arguments, wd1 + DPS on Sudoku with the shipped tiny model.

Overrides are ``key=value`` with dotted keys for sections: ``dps.lam=0.5 max_steps=50``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from daca.train.config import ConfigError, describe, load_config


def add_arguments(p) -> None:
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="e.g. dps.lam=0.5 max_steps=50"
    )
    p.add_argument("--config", help="YAML recipe (configs/...)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR exactly")
    p.add_argument("--dry-run", action="store_true", help="resolve and check the config, then exit")
    p.add_argument("--help-config", action="store_true", help="list every config key")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    if args.help_config:
        print("\n".join(describe()))
        return 0
    config_path = args.config
    if args.resume:
        config_path = Path(args.resume) / "config.yaml"
        if not config_path.is_file():
            print(f"error: {args.resume} holds no run (no config.yaml)", file=sys.stderr)
            return 2
    try:
        cfg = load_config(config_path, args.overrides)
        if args.resume:
            # The run folder is where it is, whatever the saved config says.
            cfg.output_dir, cfg.name = str(Path(args.resume).parent), Path(args.resume).name
    except ConfigError as e:
        where = f" in {config_path}" if config_path else ""
        print(f"config error{where}: {e}", file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_rank = cfg.per_device_train_batch_size // cfg.num_generations
    prompts = per_rank * world * cfg.gradient_accumulation_steps
    print(
        f"{cfg.name}: {cfg.method} on {cfg.task} with {cfg.model}; "
        f"effective batch {prompts} prompts x {cfg.num_generations} = "
        f"{prompts * cfg.num_generations} completions per step over {world} process(es); "
        f"DPS {'on' if cfg.dps.enabled else 'off'}, SML {'on' if cfg.sml.enabled else 'off'}"
    )
    if args.dry_run:
        from daca.train.config import published_differences
        from daca.train.memory import estimate_text

        differ = published_differences(cfg)
        if differ:
            print(f"differs from {cfg.method}'s published settings: {', '.join(differ)}")
        print(estimate_text(cfg))
        return 0
    from daca.tasks.rewards import RewardError
    from daca.train.trainer import InputError, TrainingError, train

    try:
        summary = train(cfg, resume=bool(args.resume), progress=not args.no_progress)
    except (ConfigError, InputError, FileExistsError) as e:
        # Found before training: the input must change. No traceback: the message says it all.
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TrainingError, RewardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _end_distributed()
    print(
        f"held-out {cfg.task}: {summary['held_out_before']:.4f} before, "
        f"{summary['held_out_after']:.4f} after ({summary['steps']} steps); "
        f"outputs in {summary['run_dir']}"
    )
    return 0


def _end_distributed() -> None:
    """Destroy the process group of a finished multi-process run before the interpreter exits:
    left to interpreter teardown, gloo's threads could abort a rank (SIGABRT, "terminate called
    without an active exception") after a successful run. Errors are left alone: a rank that
    failed may have left the others waiting in a collective."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
