"""``daca inspect``: draw a recorded rollout coloured by DPS multipliers (PNG and HTML)."""

from __future__ import annotations

import sys
from pathlib import Path

from daca.tools.inspect_run import load_record, render_html, render_png


def add_arguments(p) -> None:
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, help="recorded step (default: the last)")
    p.add_argument("--out", help="output folder (default: RUN_DIR/inspect)")


def run(args) -> int:
    try:
        rec = load_record(Path(args.run_dir), args.step)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or Path(args.run_dir) / "inspect")
    out.mkdir(parents=True, exist_ok=True)
    png = out / f"rollout-step-{rec['step']}.png"
    render_png(rec, png)
    page = out / f"rollout-step-{rec['step']}.html"
    render_html(rec, page, png.name)
    print(f"wrote {png} and {page}")
    return 0
