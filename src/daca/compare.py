"""``daca compare``: the paper's ablation grid at small scale (methods × variants × seeds).

Every cell is a ``daca train`` run with the same budget, seeds and data order; a finished cell
(its ``summary.json`` exists) is never run again, an interrupted one resumes from its last
checkpoint. The table reports the held-out metric at temperature 0, mean ± std over seeds, and
the difference to the method's base row, like the paper's main table.
"""

from __future__ import annotations

import contextlib
import csv
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from daca.config import load_config

VARIANTS = {
    "base": ["dps.enabled=false", "sml.enabled=false"],
    "dps": ["dps.enabled=true", "sml.enabled=false"],
    "sml": ["dps.enabled=false", "sml.enabled=true"],
    "daca": ["dps.enabled=true", "sml.enabled=true"],
}
# The paper's two DPS ablations, on wd1 + DPS (METHOD.md §2).
ABLATIONS = {
    "last_step": {
        m: ["dps.enabled=true", f"dps.last_step={m}"]
        for m in ("extrapolate", "neutral", "raw", "mean", "measured")
    },
    "norm_axis": {
        a: ["dps.enabled=true", f"dps.norm_axis={a}"]
        for a in ("per_step", "trajectory", "group", "none")
    },
}
# Per-method settings of the tiny runs (μ for the ratio methods, as the reference codes do
# for short tasks, scaled down).
METHOD_OVERRIDES = {
    "wd1": ["method=wd1", "num_iterations=1"],
    "diffu_grpo": ["method=diffu_grpo", "num_iterations=2"],
    "gdpo": ["method=gdpo", "num_iterations=2"],
}


@dataclass
class Cell:
    method: str
    variant: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.method}-{self.variant}-seed{self.seed}"


def parse_variants(text: str) -> dict[str, list[str]]:
    """``base,dps`` or custom ``name:key=value;key=value`` entries."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        if ":" in item:
            name, spec = item.split(":", 1)
            out[name] = [kv for kv in spec.split(";") if kv]
        elif item in VARIANTS:
            out[item] = VARIANTS[item]
        else:
            raise ValueError(f"unknown variant {item!r}; use {sorted(VARIANTS)} or name:key=value")
    return out


def cell_overrides(cell: Cell, variants, out: Path, task: str, steps: int, extra) -> list[str]:
    return [
        *METHOD_OVERRIDES[cell.method],
        *variants[cell.variant],
        f"task={task}",
        f"seed={cell.seed}",
        f"max_steps={steps}",
        f"output_dir={out / 'runs'}",
        f"name={cell.name}",
        *extra,
    ]


def run_grid(
    *,
    task: str,
    methods: list[str],
    variants: dict[str, list[str]],
    seeds: int,
    steps: int,
    out: Path,
    config: str | None = None,
    overrides: tuple[str, ...] = (),
    progress: bool = True,
    log=print,
) -> list[dict]:
    """Run (or resume, or skip) every cell; return one result row per cell."""
    from daca.checkpoint import latest_checkpoint
    from daca.trainer import train

    for m in methods:
        if m not in METHOD_OVERRIDES:
            raise ValueError(f"unknown method {m!r}; choose from {sorted(METHOD_OVERRIDES)}")
    cells = [Cell(m, v, s) for m in methods for v in variants for s in range(seeds)]
    # Check every cell's config before the first run starts.
    configs = {
        c.name: load_config(config, cell_overrides(c, variants, out, task, steps, overrides))
        for c in cells
    }
    results = []
    for i, cell in enumerate(cells, 1):
        run_dir = out / "runs" / cell.name
        summary_file = run_dir / "summary.json"
        if summary_file.is_file():
            log(f"[{i}/{len(cells)}] {cell.name}: finished earlier, skipped")
        else:
            resume = latest_checkpoint(run_dir) is not None
            log(f"[{i}/{len(cells)}] {cell.name}: {'resuming' if resume else 'running'}")
            if not resume and run_dir.exists():  # started but no checkpoint: start again
                import shutil

                shutil.rmtree(run_dir)
            train(configs[cell.name], resume=resume, progress=progress)
        summary = json.loads(summary_file.read_text())
        evals = [json.loads(x) for x in (run_dir / "evals.jsonl").read_text().splitlines() if x]
        results.append(
            {
                "method": cell.method,
                "variant": cell.variant,
                "seed": cell.seed,
                "held_out": summary["held_out_after"],
                "held_out_before": summary["held_out_before"],
                "curve": [(e["step"], e["held_out"]) for e in evals],
            }
        )
    write_reports(results, out, task)
    return results


def table_rows(results: list[dict]) -> list[dict]:
    """Mean ± std (population; 0 for one seed) per (method, variant), and Δ to the base row."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in results:
        groups.setdefault((r["method"], r["variant"]), []).append(r["held_out"])
    rows = []
    for (method, variant), vals in groups.items():
        mean = statistics.fmean(vals)
        rows.append(
            {
                "method": method,
                "variant": variant,
                "mean": mean,
                "std": statistics.pstdev(vals),
                "seeds": len(vals),
            }
        )
    base = {r["method"]: r["mean"] for r in rows if r["variant"] == "base"}
    for r in rows:
        r["delta"] = r["mean"] - base[r["method"]] if r["method"] in base else None
    return rows


def write_reports(results: list[dict], out: Path, task: str) -> None:
    rows = table_rows(results)
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{task}-table.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["method", "variant", "mean", "std", "seeds", "delta"])
        w.writeheader()
        w.writerows(rows)
    lines = [
        f"| method | variant | held-out {task} (mean ± std) | Δ vs base | seeds |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        delta = "" if r["delta"] is None or r["variant"] == "base" else f"{100 * r['delta']:+.1f}"
        lines.append(
            f"| {r['method']} | {r['variant']} | {100 * r['mean']:.1f} ± "
            f"{100 * r['std']:.1f} | {delta} | {r['seeds']} |"
        )
    (out / f"{task}-table.md").write_text("\n".join(lines) + "\n")
    (out / f"{task}-results.json").write_text(json.dumps(results, indent=1) + "\n")
    with contextlib.suppress(ImportError):  # matplotlib is an extra: tables only without it
        _plots(results, rows, out, task)


def _plots(results, rows, out: Path, task: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({r["method"] for r in results})
    fig, axes = plt.subplots(1, len(methods), figsize=(4.5 * len(methods), 3.5), squeeze=False)
    for ax, m in zip(axes[0], methods, strict=True):
        for v in dict.fromkeys(r["variant"] for r in results if r["method"] == m):
            curves = [r["curve"] for r in results if r["method"] == m and r["variant"] == v]
            steps = [s for s, _ in curves[0]]
            mean = [statistics.fmean(c[i][1] for c in curves) for i in range(len(steps))]
            ax.plot(steps, mean, marker="o", label=v)
        ax.set(title=f"{task}: {m}", xlabel="step", ylabel="held-out metric")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{task}-curves.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 2, 3.5))
    labels = [f"{r['method']}\n{r['variant']}" for r in rows]
    ax.bar(labels, [r["mean"] for r in rows], yerr=[r["std"] for r in rows], capsize=3)
    ax.set(ylabel=f"held-out {task}", title=f"{task}: final held-out metric")
    fig.tight_layout()
    fig.savefig(out / f"{task}-bars.png", dpi=110)
    plt.close(fig)


def add_arguments(p) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every cell")
    p.add_argument("--task", default="sudoku")
    p.add_argument("--methods", default="diffu_grpo,wd1,gdpo")
    p.add_argument(
        "--variants",
        default="base,dps,sml,daca",
        help="base,dps,sml,daca or custom name:key=value;key=value",
    )
    p.add_argument(
        "--ablation",
        choices=sorted(ABLATIONS),
        help="the DPS ablation grid on wd1 (overrides --methods/--variants)",
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=200, help="training steps per cell")
    p.add_argument("--config", help="base YAML recipe for every cell")
    p.add_argument("--out", default="compare", help="output folder")
    p.add_argument(
        "--quick",
        action="store_true",
        help="one seed, 60 steps, wd1 only, base and dps (≈ 15 min on 2 cores)",
    )


def run(args) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    variants = parse_variants(args.variants)
    seeds, steps = args.seeds, args.steps
    if args.ablation:
        methods, variants = ["wd1"], ABLATIONS[args.ablation]
    if args.quick:
        methods, seeds, steps = ["wd1"], 1, 60
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
    )
    print((out / f"{args.task}-table.md").read_text())
    return 0
