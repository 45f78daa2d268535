"""``daca train``: with no arguments, wd1 + DPS on Sudoku with the shipped tiny model.

Overrides are ``key=value`` with dotted keys for sections: ``dps.lam=0.5 max_steps=50``.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from daca.cli import preflight
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
        check_inputs(cfg, dry_run=args.dry_run)
    except (ConfigError, preflight.UsageError) as e:  # the values of the file or overrides
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
        from daca.tools.memory import estimate_text
        from daca.train.config import published_differences

        differ = published_differences(cfg)
        if differ:
            print(f"differs from {cfg.method}'s published settings: {', '.join(differ)}")
        print(estimate_text(cfg))
        return 0
    from daca.tasks.rewards import RewardError
    from daca.train.interrupts import Interrupted
    from daca.train.trainer import InputError, TrainingError, train

    try:
        summary = train(cfg, resume=bool(args.resume), progress=not args.no_progress)
    except Interrupted as e:
        # The trainer saved the last finished step; one line, on one process, says how to go on.
        _on_main_process(f"{e}")
        _end_distributed(barrier=True)  # the line is out before a launcher ends any rank
        return e.exit_code
    except KeyboardInterrupt:
        # Ctrl-C while the model and data load (before the trainer's own handler): no step ran.
        run_dir = Path(cfg.output_dir) / cfg.name
        again = (
            f"daca train --resume {shlex.quote(str(run_dir))}"
            if (run_dir / "config.yaml").is_file()
            else "the same command"
        )
        _on_main_process(
            f"interrupted before the first step: nothing to save; start again with: {again}"
        )
        return 130
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


def check_inputs(cfg, *, dry_run: bool) -> None:
    """The config's task, model, files, output folder and sandbox, checked before anything
    loads or is written: a ``UsageError`` naming the key. A dry run checks what it names, not
    the machine (the sandbox, a hub model in the offline cache): it may plan another's run."""
    task = preflight.check_task(cfg.task, "task=")
    preflight.check_model(cfg.model, "model=", offline_cache=not dry_run)
    preflight.check_model_does_task(cfg.model, task, "model=")
    preflight.check_data_file(cfg.data_file, "data_file=")
    preflight.check_data_file(cfg.eval_file, "eval_file=")
    preflight.check_output_folder(cfg.output_dir, "output_dir=")
    if cfg.sandbox != "unsafe" and not dry_run:
        preflight.check_sandbox(task, "task=")


def _on_main_process(line: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, file=sys.stderr)


def _end_distributed(*, barrier: bool = False) -> None:
    """Destroy the process group of a finished multi-process run before the interpreter exits:
    left to interpreter teardown, gloo's threads could abort a rank (SIGABRT, "terminate called
    without an active exception") after a successful run. Errors are left alone: a rank that
    failed may have left the others waiting in a collective."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if barrier:  # every rank stopped at the same step (an agreed stop): all get here
            dist.barrier()
        dist.destroy_process_group()
