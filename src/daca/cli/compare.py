"""``daca compare``: the ablation grid, methods x variants x seeds, as tables and plots."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from daca.tools.compare import (
    ABLATION_METHOD,
    ABLATIONS,
    VARIANTS,
    parse_seeds,
    parse_variants,
    run_grid,
)
from daca.train.config import ConfigError
from daca.train.interrupts import Interrupted
from daca.train.methods import METHODS, paper_methods


def add_arguments(p) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every cell")
    p.add_argument("--task", default="sudoku")
    p.add_argument(
        "--methods",
        help=f"base methods, from {', '.join(METHODS)} (default: the paper's three; with "
        "--quick every registered method)",
    )
    p.add_argument(
        "--variants",
        default="base,dps,sml,daca",
        help="base,dps,sml,daca or custom name:key=value;key=value",
    )
    p.add_argument(
        "--reference",
        metavar="VARIANT",
        help="the variant each Δ and interval is taken against (default: base), e.g. a sweep's "
        "current default",
    )
    p.add_argument(
        "--ablation",
        choices=sorted(ABLATIONS),
        help=f"the DPS ablation grid on {ABLATION_METHOD} (overrides --methods/--variants)",
    )
    p.add_argument(
        "--seeds",
        default="3",
        help="a count (3: seeds 0, 1, 2) or the seeds to run: 2-4, 0,3, one seed 4-4 (to "
        "complete a grid)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=100,
        help="training steps per cell (100: the 4 × 2 × 3 Sudoku grid on the tiny LLaDA took "
        "55 min with --jobs 2, docs/results.md)",
    )
    p.add_argument("--config", help="base YAML recipe for every cell")
    p.add_argument("--out", default="compare", help="output folder")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="cells run at once, each in its own process with an equal share of the CPU threads",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: write the tables and plots from the cells finished so far",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="one seed, 60 steps, base and dps of each method, every registered method unless "
        "--methods says otherwise (Sudoku: 8.6 min on 2 CPU cores, docs/results.md)",
    )


def grid_methods(names: str | None, *, quick: bool) -> list[str]:
    """The methods of the grid: ``names`` (comma-separated), else the paper's three, or with
    ``--quick`` every registered method (so a new registry entry shows in the quick table)."""
    if names:
        return [m.strip() for m in names.split(",") if m.strip()]
    return list(METHODS) if quick else paper_methods()


def run(args) -> int:
    try:
        methods = grid_methods(args.methods, quick=args.quick)
        variants = parse_variants(args.variants)
        seeds, steps = parse_seeds(args.seeds), args.steps
        if args.ablation:
            methods, variants = [ABLATION_METHOD], ABLATIONS[args.ablation]
        if args.quick:
            seeds, steps = 1, 60
            variants = {k: VARIANTS[k] for k in ("base", "dps")}
        out = Path(args.out) / (args.ablation or args.task)
        run_grid(
            task=args.task,
            methods=methods,
            variants=variants,
            seeds=seeds,
            steps=steps,
            out=out,
            config=args.config,
            overrides=tuple(args.overrides),
            jobs=args.jobs,
            report_only=args.report_only,
            reference=args.reference,
        )
    except (ConfigError, FileNotFoundError, FileExistsError) as e:  # e.g. two grids, one cell
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        again = shlex.join(["daca", *sys.argv[1:]]) if sys.argv[1:2] == ["compare"] else ""
        print(f"{e}{': ' + again if again else ''}", file=sys.stderr)
        return e.exit_code
    print((out / f"{args.task}-table.md").read_text())
    return 0
