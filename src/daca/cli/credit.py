"""``daca credit``: the mean DPS multiplier of a run's recorded tokens by role (table + plot)."""

from __future__ import annotations

import sys
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("run_dir")
    p.add_argument("--first-step", type=int, help="the first recorded step to count")
    p.add_argument("--last-step", type=int, help="the last recorded step to count")
    p.add_argument("--out", help="output folder (default: RUN_DIR/credit)")


def run(args) -> int:
    from daca.tasks import get_task
    from daca.tools.credit import credit_rows, credit_table, load_records, plot_credit

    run_dir = Path(args.run_dir)
    try:
        records = load_records(run_dir, args.first_step, args.last_step)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    task = records[0].get("task", "")
    try:
        trace_steps = get_task(task).trace_steps
    except ValueError:  # a task registered by the run's own code: roles without steps
        trace_steps = None
    rows = credit_rows(records, trace_steps)
    if not rows:
        print(f"error: {run_dir}: the recorded completions hold no token", file=sys.stderr)
        return 2
    steps = sorted({r["step"] for r in records})
    completions = sum(len(r["tokens"]) for r in records)
    title = f"{task}: {completions} completions of steps {steps[0]}..{steps[-1]}"
    table = credit_table(rows)
    out = Path(args.out or run_dir / "credit")
    out.mkdir(parents=True, exist_ok=True)
    (out / "credit.md").write_text(f"{title}\n\n{table}")
    plot_credit(rows, out / "credit.png", title)
    print(f"{title}\n\n{table}\nwrote {out / 'credit.md'} and {out / 'credit.png'}")
    return 0
