"""``daca compare``: the paper's ablation grid at small scale (methods × variants × seeds).

Every cell is a ``daca train`` run with the same budget, seeds and data order; a finished cell
(its ``summary.json`` exists, or, its run folder gone, its row in the grid's ``results.json``)
is never run again, an interrupted one resumes from its last checkpoint. SIGINT or SIGTERM
stops the grid: every running cell saves its last finished step (the workers of ``--jobs``
too), and running the same command again resumes them. The table reports the held-out metric
at temperature 0, mean ± std over seeds, and the difference to the method's base row (or
``--reference``), like the paper's main table. ``--jobs N`` runs N cells side by side;
``--report-only`` tabulates a partial grid without running anything.
"""

from __future__ import annotations

import contextlib
import csv
import json
import multiprocessing
import os
import signal
import statistics
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from daca.core.options import LAST_STEP_MODES, NORM_AXES
from daca.tasks.formats import read_records
from daca.train.config import VARIANT_SWITCHES, ConfigError, TrainConfig, load_config
from daca.train.interrupts import Interrupted, StopSignals, signal_name
from daca.train.methods import METHODS, get_method

# The grid's variants: the config's ``variant`` switch (config.VARIANT_SWITCHES).
VARIANTS = {name: [f"variant={name}"] for name in VARIANT_SWITCHES}
# The paper's two DPS ablations (METHOD.md §2): every mode of the core, on the default run's
# method with DPS (wd1 + DPS).
ABLATIONS = {
    key: {mode: ["dps.enabled=true", f"dps.{key}={mode}"] for mode in modes}
    for key, modes in (("last_step", LAST_STEP_MODES), ("norm_axis", NORM_AXES))
}
ABLATION_METHOD = TrainConfig.method
# Per-method settings of the tiny runs (μ for the ratio methods, as the reference codes do
# for short tasks, scaled down; daca.train.methods).
METHOD_OVERRIDES = {
    name: [f"method={name}", f"num_iterations={m.compare_iterations}"]
    for name, m in METHODS.items()
}


@dataclass
class Cell:
    method: str
    variant: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.method}-{self.variant}-seed{self.seed}"


def parse_seeds(text: str) -> int | list[int]:
    """``5`` (seeds 0 … 4), or the seeds themselves: ``2-4``, ``0,3`` or both (``0,2-4``)."""
    text = text.strip()
    if text.isdigit():
        if int(text) < 1:
            raise ConfigError(f"--seeds {text}: need at least one seed")
        return int(text)
    seeds: list[int] = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        low, dash, high = part.partition("-")
        high = high if dash else low
        if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
            raise ConfigError(f"--seeds {text!r}: use a count (5), a range (2-4) or a list (0,3)")
        seeds.extend(s for s in range(int(low), int(high) + 1) if s not in seeds)
    if not seeds:
        raise ConfigError(f"--seeds {text!r}: no seed")
    return seeds


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
            raise ConfigError(f"unknown variant {item!r}; use {sorted(VARIANTS)} or name:key=value")
    return out


def cell_overrides(cell: Cell, variants, out: Path, task: str, steps: int, extra) -> list[str]:
    return [
        *METHOD_OVERRIDES[cell.method],
        *variants[cell.variant],
        f"task={task}",
        f"seed={cell.seed}",
        f"max_steps={steps}",
        f"eval_every={max(1, steps // 2)}",  # a midpoint on the learning curves
        f"output_dir={out / 'runs'}",
        f"name={cell.name}",
        *extra,
    ]


def run_grid(
    *,
    task: str,
    methods: list[str],
    variants: dict[str, list[str]],
    seeds: int | list[int],
    steps: int,
    out: Path,
    config: str | None = None,
    overrides: tuple[str, ...] = (),
    progress: bool = True,
    jobs: int = 1,
    report_only: bool = False,
    reference: str | None = None,
    log=print,
) -> list[dict]:
    """Run (or resume, or skip) every cell; return one result row per finished cell.

    jobs > 1 runs that many cells at once, each in its own process with an equal share of the
    CPU threads: the tiny model does not use many threads well, so on a CPU this is the faster
    way through a grid. Every cell is seeded, so the numbers do not depend on ``jobs``.
    report_only: run nothing, and write the tables from the cells finished so far.
    reference: the variant every Δ is taken against (default ``base``; a sweep's default).
    seeds: a count (seeds 0 … n−1) or the seeds themselves, so that a grid can be completed
    seed by seed (the cell of seed k is the same run whichever way it was asked for).
    """
    from daca.train.checkpointing import latest_checkpoint

    if jobs < 1:
        raise ConfigError(f"jobs must be >= 1, got {jobs}")
    if reference is not None and reference not in variants:
        raise ConfigError(
            f"--reference {reference!r} is not a variant of the grid: {list(variants)}"
        )
    for m in methods:
        try:
            get_method(m)
        except KeyError as e:
            raise ConfigError(e.args[0]) from None
    # Seed-major order: an interrupted grid still has whole seeds' tables.
    seed_list = range(seeds) if isinstance(seeds, int) else seeds
    cells = [Cell(m, v, s) for s in seed_list for m in methods for v in variants]
    # Check every cell's config before the first run starts.
    configs = {
        c.name: load_config(config, cell_overrides(c, variants, out, task, steps, overrides))
        for c in cells
    }
    recorded = _recorded_rows(out / f"{task}-results.json")
    pending = []
    for i, cell in enumerate(cells, 1):
        run_dir = out / "runs" / cell.name
        if (run_dir / "summary.json").is_file():
            log(f"[{i}/{len(cells)}] {cell.name}: finished earlier, skipped")
            continue
        if cell.name in recorded and not run_dir.exists():
            log(f"[{i}/{len(cells)}] {cell.name}: recorded in {task}-results.json, skipped")
            continue
        if report_only:
            log(f"[{i}/{len(cells)}] {cell.name}: not finished, left out of the tables")
            continue
        # Started before: resumed, or started over with its files set aside (no checkpoint).
        resume = run_dir.exists()
        began = latest_checkpoint(run_dir) is not None
        label = f"[{i}/{len(cells)}] {cell.name}: {'resuming' if began else 'running'}"
        pending.append((cell.name, label, configs[cell.name], resume))
    if jobs == 1:
        _run_serial(pending, progress, log)
    else:
        _run_parallel(pending, jobs, log)
    results = []
    for c in cells:
        run_dir = out / "runs" / c.name
        if (run_dir / "summary.json").is_file():
            results.append(_result(c, run_dir))
        elif c.name in recorded and not run_dir.exists():  # a run folder outranks the record
            results.append(recorded[c.name])
    if not results:
        raise FileNotFoundError(f"no finished cell under {out / 'runs'} to report")
    names = {c.name for c in cells}
    others = [row for name, row in recorded.items() if name not in names]
    write_reports(results, out, task, reference or "base", also_recorded=others)
    return results


def _recorded_rows(path: Path) -> dict[str, dict]:
    """The cells a grid's ``results.json`` records, by cell name. A finished cell's row is
    all its table needs, so a grid whose run folders are gone (another machine, a cleaned
    disk) still reports and completes from its record, and never reruns those cells."""
    if not path.is_file():
        return {}
    try:
        rows = json.loads(path.read_text())
        return {Cell(r["method"], r["variant"], r["seed"]).name: r for r in rows}
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{path}: not a grid's record of cells ({type(e).__name__}: {e})"
        ) from None


def _result(cell: Cell, run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = read_records(run_dir / "evals.jsonl")
    steps = read_records(run_dir / "metrics.jsonl")
    return {
        "method": cell.method,
        "variant": cell.variant,
        "seed": cell.seed,
        "held_out": summary["held_out_after"],
        "held_out_before": summary["held_out_before"],
        "curve": [(e["step"], e["held_out"]) for e in evals],
        # Training time (rollouts, rewards, updates; not the evaluations), for the grid's cost.
        "train_seconds": sum(
            h["time_rollout"] + h["time_reward"] + h["time_update"] for h in steps
        ),
    }


def _grid_interrupted(signum: int) -> Interrupted:
    return Interrupted(
        signum,
        f"stopped by {signal_name(signum)}: each running cell saved its last finished step; "
        f"run the same `daca compare` command again to resume them (finished cells are skipped)",
    )


def _run_serial(pending, progress: bool, log) -> None:
    from daca.train.trainer import train

    # One request for the grid and its current cell (StopSignals nests): a signal between two
    # cells stops the grid before the next one.
    with StopSignals("the running cell saves at the end of its step") as stop:
        for _, label, cfg, resume in pending:
            if stop.requested:
                break
            log(label)
            try:
                train(cfg, resume=resume, progress=progress)
            except Interrupted as e:
                raise _grid_interrupted(e.signum) from None
        if stop.requested:
            raise _grid_interrupted(stop.signum)


# A worker's stop request, for its lifetime: a cell queued after the signal does not start.
_WORKER_STOP: StopSignals | None = None


def _train_cell(cfg, resume: bool, threads: int) -> str:
    import torch

    from daca.train.trainer import train

    if _WORKER_STOP is not None and _WORKER_STOP.requested:
        return "not started"
    torch.set_num_threads(threads)
    try:
        train(cfg, resume=resume, progress=False)
    except Interrupted as e:
        return f"stopped by {signal_name(e.signum)}, saved; resumes when the grid runs again"
    return "finished"


def _init_worker(parent: int) -> None:
    """A worker's initializer. Its own process group: a Ctrl-C in the terminal reaches the grid's
    process only, which passes it on once (a second one would quit the cell at once). Its stop
    request holds for its lifetime. And it ends when the grid's process is gone: a SIGKILL to
    ``daca compare`` would otherwise leave the workers training their cells, unseen (a killed
    cell resumes from its last checkpoint when the grid is run again)."""
    global _WORKER_STOP
    os.setpgrp()
    _WORKER_STOP = StopSignals("saving the cell at the end of its step", announce=False)
    _WORKER_STOP.__enter__()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def _signal_workers(pool: ProcessPoolExecutor, signum: int) -> None:
    for pid in list(getattr(pool, "_processes", None) or {}):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _run_parallel(pending, jobs: int, log) -> None:
    threads = max(1, (os.cpu_count() or 1) // jobs)
    context = multiprocessing.get_context("spawn")  # no forked torch thread pools
    with ProcessPoolExecutor(
        max_workers=jobs,
        mp_context=context,
        initializer=_init_worker,
        initargs=(os.getpid(),),
    ) as pool:
        stop = StopSignals(
            "each running cell saves at the end of its step",
            on_first=lambda signum: _signal_workers(pool, signum),
            on_second=lambda signum: _signal_workers(pool, signal.SIGKILL),
        )
        with stop:
            futures = {}
            for name, label, cfg, resume in pending:
                futures[pool.submit(_train_cell, cfg, resume, threads)] = name
                log(f"{label} (queued, {jobs} at a time)")
            try:
                _wait_for_cells(futures, stop, log)
            except BaseException:
                # A failed cell stops the grid; finished cells stay.
                pool.shutdown(cancel_futures=True)
                if stop.requested:  # e.g. a worker hit by the signal before its handler was set
                    raise _grid_interrupted(stop.signum) from None
                raise
            if stop.requested:
                raise _grid_interrupted(stop.signum)


def _wait_for_cells(futures: dict, stop: StopSignals, log) -> None:
    """Report each cell as it ends; after a stop request, cancel the cells not yet started."""
    remaining = set(futures)
    while remaining:
        done, remaining = wait(remaining, timeout=1.0, return_when=FIRST_COMPLETED)
        for future in done:
            log(f"{futures[future]}: {future.result()}")
        if stop.requested:
            remaining = {f for f in remaining if not f.cancel()}


TABLE_FIELDS = [
    "method", "variant", "mean", "std", "seeds", "reference", "delta", "delta_std", "delta_ci95",
    "wins", "minutes",
]  # fmt: skip

# Student's t, two-sided 95 % (the 0.975 quantile), by degrees of freedom; beyond 30, 1.96.
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042]  # fmt: skip


def paired_interval(diffs: list[float]) -> float | None:
    """Half-width of the 95 % t interval of the mean of paired differences (one per seed):
    t_{0.975, n-1} · s / √n with s the sample standard deviation; None for fewer than 2."""
    n = len(diffs)
    if n < 2:
        return None
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96
    return t * statistics.stdev(diffs) / n**0.5


def table_rows(results: list[dict], reference: str = "base") -> list[dict]:
    """Mean ± std (population; 0 for one seed) per (method, variant), and Δ to the reference
    row (the base method, or a sweep's default): where every seed has its reference run, the
    mean of the per-seed differences, their std, the 95 % t interval of that mean
    (``paired_interval``) and the seeds where the variant won."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["method"], r["variant"]), []).append(r)
    rows = []
    for (method, variant), runs in groups.items():
        vals = [r["held_out"] for r in runs]
        seconds = [r["train_seconds"] for r in runs if "train_seconds" in r]
        rows.append(
            {
                "method": method,
                "variant": variant,
                "mean": statistics.fmean(vals),
                "std": statistics.pstdev(vals),
                "seeds": len(vals),
                "minutes": statistics.fmean(seconds) / 60 if seconds else None,
            }
        )
    ref_mean = {r["method"]: r["mean"] for r in rows if r["variant"] == reference}
    # A seed shares its data order and held-out problems with the reference run of the same
    # seed, so the spread of the per-seed differences is the fair error bar on Δ.
    ref_of = {
        (r["method"], r["seed"]): r["held_out"]
        for r in results
        if r["variant"] == reference and "seed" in r
    }
    for row in rows:
        runs = groups[(row["method"], row["variant"])]
        keys = [(row["method"], r.get("seed")) for r in runs]
        row["reference"] = reference
        row["delta_ci95"] = row["wins"] = None
        if all(k in ref_of for k in keys):  # the same seeds as the reference: mean of pairs
            diffs = [r["held_out"] - ref_of[k] for r, k in zip(runs, keys, strict=True)]
            row["delta"], row["delta_std"] = statistics.fmean(diffs), statistics.pstdev(diffs)
            row["delta_ci95"] = paired_interval(diffs)
            row["wins"] = sum(d > 0 for d in diffs)
        else:
            row["delta"] = (
                row["mean"] - ref_mean[row["method"]] if row["method"] in ref_mean else None
            )
            row["delta_std"] = None
    return rows


def _delta_cells(r: dict) -> tuple[str, str, str]:
    """The table's Δ, 95 % interval and wins cells of a row (blank for the reference row)."""
    if r["delta"] is None or r["variant"] == r["reference"]:
        return "", "", ""
    delta = f"{100 * r['delta']:+.1f}"
    if r["delta_std"] is not None:
        delta += f" ± {100 * r['delta_std']:.1f}"
    ci = r["delta_ci95"]
    interval = ""
    if ci is not None:
        low, high = 100 * (r["delta"] - ci), 100 * (r["delta"] + ci)
        verdict = "above 0" if low > 0 else "below 0" if high < 0 else "contains 0"
        interval = f"[{low:+.1f}, {high:+.1f}] ({verdict})"
    wins = "" if r["wins"] is None else f"{r['wins']}/{r['seeds']}"
    return delta, interval, wins


def write_reports(
    results: list[dict], out: Path, task: str, reference: str = "base", also_recorded=()
) -> None:
    """The table (Markdown, CSV), the plots, and ``results.json``: this grid's rows and
    ``also_recorded``, the rows of other grids run in the same folder, kept."""
    rows = table_rows(results, reference)
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{task}-table.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=TABLE_FIELDS)
        w.writeheader()
        w.writerows(rows)
    lines = [
        f"| method | variant | held-out {task} (mean ± std) | Δ vs {reference} (± std of the "
        f"per-seed Δ) | 95 % interval of the mean Δ | variant > {reference} | seeds | "
        "min per run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        delta, interval, wins = _delta_cells(r)
        minutes = "" if r["minutes"] is None else f"{r['minutes']:.1f}"
        lines.append(
            f"| {r['method']} | {r['variant']} | {100 * r['mean']:.1f} ± "
            f"{100 * r['std']:.1f} | {delta} | {interval} | {wins} | {r['seeds']} | {minutes} |"
        )
    (out / f"{task}-table.md").write_text("\n".join(lines) + "\n")
    record = [*results, *also_recorded]
    (out / f"{task}-results.json").write_text(json.dumps(record, indent=1) + "\n")
    with contextlib.suppress(ImportError):  # matplotlib is an extra: tables only without it
        _plots(results, rows, out, task)


def _plots(results, rows, out: Path, task: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from daca.train.run_logging import honest_limits

    methods = sorted({r["method"] for r in results})
    fig, axes = plt.subplots(1, len(methods), figsize=(4.5 * len(methods), 3.5), squeeze=False)
    for ax, m in zip(axes[0], methods, strict=True):
        for v in dict.fromkeys(r["variant"] for r in results if r["method"] == m):
            curves = [r["curve"] for r in results if r["method"] == m and r["variant"] == v]
            steps = [s for s, _ in curves[0]]
            mean = [statistics.fmean(c[i][1] for c in curves) for i in range(len(steps))]
            (line,) = ax.plot(steps, mean, marker="o", label=v)
            if len(curves) > 1:  # each seed's run, faint, behind the mean
                for c in curves:
                    ax.plot(*zip(*c, strict=True), color=line.get_color(), alpha=0.25, lw=0.8)
        ax.set(title=f"{task}: {m}", xlabel="step", ylabel="held-out metric")
        ax.set_ylim(*honest_limits([r["held_out"] for r in results], [0.0] * len(results)))
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{task}-curves.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 2, 3.5))
    labels = [f"{r['method']}\n{r['variant']}" for r in rows]
    ax.bar(labels, [r["mean"] for r in rows], yerr=[r["std"] for r in rows], capsize=3)
    ax.set(ylabel=f"held-out {task}", title=f"{task}: final held-out metric")
    ax.set_ylim(*honest_limits([r["mean"] for r in rows], [r["std"] for r in rows]))
    fig.tight_layout()
    fig.savefig(out / f"{task}-bars.png", dpi=110)
    plt.close(fig)
