"""``daca credit``: the mean DPS multiplier of a run's recorded tokens by role (table + plot);
with ``--model``, of a model's own fresh rollouts, sampled as a training step would and never
trained on (the credit of one fixed policy, free of learning noise)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("run_dir", nargs="?", help="a run whose recorded rollouts to read")
    p.add_argument("--first-step", type=int, help="the first recorded step to count")
    p.add_argument("--last-step", type=int, help="the last recorded step to count")
    p.add_argument("--model", help="instead of a run: a model whose rollouts to sample")
    p.add_argument("--task", default="sudoku-trace", help="with --model: the task")
    p.add_argument("--config", help="with --model: a training recipe for the sampling settings")
    p.add_argument(
        "--batches", type=int, default=10, help="with --model: training steps' worth of rollouts"
    )
    p.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="with --model: config overrides"
    )
    p.add_argument("--out", help="output folder (default: RUN_DIR/credit, or credit-MODEL-TASK)")
    p.add_argument(
        "--resamples",
        type=int,
        default=1000,
        help="bootstrap resamples of the separation's intervals (trace tasks; 0: none)",
    )


def run(args) -> int:
    from daca.tasks import get_task
    from daca.tasks.credit_labels import has_graded_units
    from daca.tools.credit import credit_rows, credit_table, load_records, plot_credit
    from daca.tools.separation import (
        graded_tokens,
        separation_table,
        separations,
        sequence_line,
        sequence_weights,
    )

    if (args.run_dir is None) == (args.model is None):
        print("error: give a RUN_DIR or --model (one of them)", file=sys.stderr)
        return 2
    try:
        if args.model is None:
            records = load_records(Path(args.run_dir), args.first_step, args.last_step)
            out = Path(args.out or Path(args.run_dir) / "credit")
        else:
            records = _sampled_records(args)
            out = Path(args.out or f"credit-{Path(args.model).name}-{args.task}")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    task = records[0].get("task", "")
    try:
        task_obj = get_task(task)
    except ValueError:  # a task registered by the run's own code: roles without steps
        task_obj = None
    rows = credit_rows(records, task_obj.trace_steps if task_obj else None)
    if not rows:
        print("error: the recorded completions hold no token", file=sys.stderr)
        return 2
    steps = sorted({r["step"] for r in records})
    completions = sum(len(r["tokens"]) for r in records)
    title = f"{task}: {completions} completions of steps {steps[0]}..{steps[-1]}"
    table = credit_table(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "credit.md").write_text(f"{title}\n\n{table}")
    plot_credit(rows, out / "credit.png", title)
    print(f"{title}\n\n{table}\nwrote {out / 'credit.md'} and {out / 'credit.png'}")
    if task_obj is not None and has_graded_units(task_obj):
        tokens = graded_tokens(records, task_obj)
        table = separation_table(separations(tokens, resamples=args.resamples))
        table += "\n" + sequence_line(sequence_weights(records))
        (out / "separation.md").write_text(f"{title}\n\n{table}")
        heading = "Does DPS tell right tokens from wrong ones?"
        print(f"\n{heading}\n\n{table}\nwrote {out / 'separation.md'}")
    return 0


def _sampled_records(args) -> list[dict]:
    """``--batches`` training steps' rollouts of ``--model`` with DPS on, no update between."""
    from daca.train.config import load_config
    from daca.train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="daca-credit-") as tmp:
        cfg = load_config(
            args.config,
            [
                f"model={args.model}",
                f"task={args.task}",
                "dps.enabled=true",
                f"output_dir={tmp}",
                "name=credit",
                "tensorboard=false",
                "eval_size=1",
                *args.set,
            ],
        )
        trainer = Trainer(cfg, progress=False)
        return [r for step in range(args.batches) for r in trainer.rollout_records(step)]
