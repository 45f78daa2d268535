"""Grid bookkeeping of ``daca compare`` and the pictures of ``daca inspect``."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _launch import descendants

from daca.cli import main
from daca.tools import compare


@pytest.fixture
def grid(tiny_model_dir, tmp_path):
    extra = (
        f"model={tiny_model_dir}",
        "per_device_train_batch_size=12",
        "train_size=24",
        "eval_size=6",
        "eval_every=1",
        "tensorboard=false",
        "generation.steps=4",
        "dps.stride=1",
        "save_rollouts_every=1",
    )
    kwargs = dict(
        task="sudoku",
        methods=["wd1", "diffu_grpo"],
        variants=compare.parse_variants("base,dps"),
        seeds=1,
        steps=2,
        out=tmp_path / "grid",
        overrides=extra,
        progress=False,
    )
    return kwargs


def test_grid_runs_skips_finished_cells_and_tabulates_means(grid, tmp_path):
    logs = []
    results = compare.run_grid(**grid, log=logs.append)
    assert len(results) == 4 and sum("running" in x for x in logs) == 4
    # A second call runs nothing and reports the same numbers.
    logs.clear()
    again = compare.run_grid(**grid, log=logs.append)
    assert sum("skipped" in x for x in logs) == 4
    assert [r["held_out"] for r in again] == [r["held_out"] for r in results]
    # The table's numbers are the means of the runs' own summaries.
    rows = compare.table_rows(results)
    for row in rows:
        name = f"{row['method']}-{row['variant']}-seed0"
        summary = json.loads((grid["out"] / "runs" / name / "summary.json").read_text())
        assert row["mean"] == summary["held_out_after"] and row["std"] == 0.0
        assert row["minutes"] > 0  # the cost column: training time from the run's metrics
    base = {r["method"]: r["mean"] for r in rows if r["variant"] == "base"}
    for row in rows:
        assert row["delta"] == pytest.approx(row["mean"] - base[row["method"]])
    md = (grid["out"] / "sudoku-table.md").read_text()
    assert md.count("\n") == 2 + 4
    assert (grid["out"] / "sudoku-curves.png").is_file()
    assert (grid["out"] / "sudoku-bars.png").is_file()


def test_a_grid_record_stands_for_run_folders_that_are_gone(grid):
    """A grid carried to another machine as its ``results.json`` alone reports the same
    table and reruns none of its cells; rows of other grids in the folder are kept."""
    import shutil

    first = compare.run_grid(**grid)
    shutil.rmtree(grid["out"] / "runs" / "wd1-dps-seed0")
    logs = []
    again = compare.run_grid(**grid, log=logs.append)
    assert "[2/4] wd1-dps-seed0: recorded in sudoku-results.json, skipped" in logs
    assert not any("running" in x for x in logs)
    assert json.loads(json.dumps(first)) == json.loads(json.dumps(again))
    table = (grid["out"] / "sudoku-table.md").read_text()
    # A smaller grid in the same folder tabulates its own cells and keeps the others' rows.
    compare.run_grid(**{**grid, "methods": ["diffu_grpo"]}, report_only=True)
    assert "| wd1 |" not in (grid["out"] / "sudoku-table.md").read_text()
    assert len(json.loads((grid["out"] / "sudoku-results.json").read_text())) == 4
    compare.run_grid(**grid, report_only=True)
    assert (grid["out"] / "sudoku-table.md").read_text() == table
    (grid["out"] / "sudoku-results.json").write_text('[{"method": "wd1"}]')
    with pytest.raises(ValueError, match="sudoku-results.json: not a grid's record"):
        compare.run_grid(**grid, report_only=True)


def test_parallel_cells_give_the_same_numbers(grid, tmp_path, monkeypatch):
    # One thread per worker, as in this process: float sums depend on the thread count.
    monkeypatch.setattr(compare.os, "cpu_count", lambda: 2)
    serial = compare.run_grid(**grid)
    logs = []
    parallel = compare.run_grid(**{**grid, "out": tmp_path / "grid2", "jobs": 2}, log=logs.append)
    assert sum("finished" in x for x in logs) == 4
    assert [(r["held_out"], r["curve"]) for r in parallel] == [
        (r["held_out"], r["curve"]) for r in serial
    ]
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        compare.run_grid(**{**grid, "jobs": 0})


def test_interrupted_cell_resumes(grid):
    compare.run_grid(**grid)
    run = grid["out"] / "runs" / "wd1-dps-seed0"
    (run / "summary.json").unlink()  # as if killed after its last checkpoint
    logs = []
    # A report of the unfinished grid leaves the cell out and runs nothing.
    partial = compare.run_grid(**grid, report_only=True, log=logs.append)
    assert [(r["method"], r["variant"]) for r in partial] == [
        ("wd1", "base"),
        ("diffu_grpo", "base"),
        ("diffu_grpo", "dps"),
    ]
    assert any("wd1-dps-seed0: not finished, left out" in x for x in logs)
    assert not (run / "summary.json").exists()
    assert "| wd1 | dps |" not in (grid["out"] / "sudoku-table.md").read_text()
    logs.clear()
    compare.run_grid(**grid, log=logs.append)
    assert any("wd1-dps-seed0: resuming" in x for x in logs)
    assert sum("skipped" in x for x in logs) == 3


def test_table_statistics_by_hand():
    results = [
        {"method": "wd1", "variant": "base", "held_out": 0.4},
        {"method": "wd1", "variant": "base", "held_out": 0.6},
        {"method": "wd1", "variant": "dps", "held_out": 0.7},
        {"method": "wd1", "variant": "dps", "held_out": 0.5},
        {"method": "wd1", "variant": "dps", "held_out": 0.9},
    ]
    rows = {r["variant"]: r for r in compare.table_rows(results)}
    assert rows["base"]["mean"] == pytest.approx(0.5) and rows["base"]["std"] == pytest.approx(0.1)
    assert rows["dps"]["mean"] == pytest.approx(0.7)
    assert rows["dps"]["std"] == pytest.approx((0.08 / 3) ** 0.5)
    assert rows["dps"]["delta"] == pytest.approx(0.2)
    assert rows["dps"]["delta_std"] is None  # runs without seeds cannot be paired


def test_delta_error_bar_pairs_runs_by_seed():
    held_out = {("base", 0): 0.40, ("base", 1): 0.60, ("dps", 0): 0.50, ("dps", 1): 0.64}
    results = [
        {"method": "wd1", "variant": v, "seed": s, "held_out": x} for (v, s), x in held_out.items()
    ]
    rows = {r["variant"]: r for r in compare.table_rows(results)}
    # Per-seed Δ: 0.10 and 0.04, so Δ = 0.07 ± 0.03, while the unpaired stds are 0.10 and 0.07.
    assert rows["dps"]["delta"] == pytest.approx(0.07)
    assert rows["dps"]["delta_std"] == pytest.approx(0.03)
    assert rows["dps"]["std"] == pytest.approx(0.07)
    assert rows["base"]["delta_std"] == 0.0
    # 95 % t interval of the mean Δ, 1 degree of freedom: 12.706 · stdev(0.10, 0.04) / √2.
    assert rows["dps"]["delta_ci95"] == pytest.approx(12.706 * (0.06 / 2**0.5) / 2**0.5)
    assert rows["dps"]["wins"] == 2


def test_the_interval_of_five_seeds_and_its_verdict_by_hand():
    diffs = [0.05, 0.07, 0.02, 0.06, 0.05]  # mean 0.05, sample std 0.019; t(4) = 2.776
    results = [{"method": "wd1", "variant": "base", "seed": s, "held_out": 0.5} for s in range(5)]
    results += [
        {"method": "wd1", "variant": "dps", "seed": s, "held_out": 0.5 + d}
        for s, d in enumerate(diffs)
    ]
    rows = {r["variant"]: r for r in compare.table_rows(results)}
    std = (sum((d - 0.05) ** 2 for d in diffs) / 4) ** 0.5
    assert rows["dps"]["delta_ci95"] == pytest.approx(2.776 * std / 5**0.5)
    assert compare._delta_cells(rows["dps"])[1:] == ("[+2.7, +7.3] (above 0)", "5/5")
    results[5]["held_out"] = 0.3  # one seed far below its base: the interval holds 0
    rows = {r["variant"]: r for r in compare.table_rows(results)}
    assert compare._delta_cells(rows["dps"])[1].endswith("(contains 0)")
    assert rows["dps"]["wins"] == 4


def test_a_sweep_is_measured_against_its_reference_variant_by_hand():
    held_out = {("dps", 0): 0.50, ("dps", 1): 0.60, ("lam1", 0): 0.47, ("lam1", 1): 0.61}
    results = [
        {"method": "diffu_grpo", "variant": v, "seed": s, "held_out": x}
        for (v, s), x in held_out.items()
    ]
    rows = {r["variant"]: r for r in compare.table_rows(results, reference="dps")}
    # Per-seed Δ against dps: −0.03 and +0.01, so Δ = −0.01 ± 0.02, one win.
    assert rows["lam1"]["delta"] == pytest.approx(-0.01)
    assert rows["lam1"]["delta_std"] == pytest.approx(0.02)
    assert rows["lam1"]["wins"] == 1
    assert compare._delta_cells(rows["dps"]) == ("", "", "")  # the reference row itself
    assert compare._delta_cells(rows["lam1"])[0] == "-1.0 ± 2.0"
    # Against base (absent here) there is no Δ at all.
    assert all(r["delta"] is None for r in compare.table_rows(results))


def test_seeds_are_a_count_or_a_list():
    assert compare.parse_seeds("5") == 5
    assert compare.parse_seeds("2-4") == [2, 3, 4]
    assert compare.parse_seeds("0,2-3,2") == [0, 2, 3]
    for bad in ("0", "4-2", "a", "1-", ",", "-1"):
        with pytest.raises(ValueError, match="--seeds"):
            compare.parse_seeds(bad)


def test_a_seed_list_runs_those_cells_and_a_count_reuses_them(grid):
    grid = {**grid, "methods": ["wd1"], "variants": compare.parse_variants("base")}
    logs = []
    compare.run_grid(**{**grid, "seeds": [1]}, log=logs.append)
    assert logs == ["[1/1] wd1-base-seed1: running"]
    run = grid["out"] / "runs" / "wd1-base-seed1"
    assert "seed: 1\n" in (run / "config.yaml").read_text()
    logs.clear()
    results = compare.run_grid(**{**grid, "seeds": 2}, log=logs.append)
    # Skips are told while the grid is checked, before the first run starts.
    assert logs == [
        "[2/2] wd1-base-seed1: finished earlier, skipped",
        "[1/2] wd1-base-seed0: running",
    ]
    assert [r["seed"] for r in results] == [0, 1]


def test_custom_variants_and_errors(tmp_path, capsys):
    v = compare.parse_variants("base,raw:dps.enabled=true;dps.last_step=raw")
    assert v["raw"] == ["dps.enabled=true", "dps.last_step=raw"]
    with pytest.raises(ValueError, match="unknown variant 'dsp'"):
        compare.parse_variants("dsp")
    # The command line answers bad input with one line and exit status 2, not a traceback.
    assert main(["compare", "--methods", "wd2", "--out", str(tmp_path)]) == 2
    assert "unknown method 'wd2'" in capsys.readouterr().err
    assert main(["compare", "--report-only", "--out", str(tmp_path)]) == 2
    assert "no finished cell" in capsys.readouterr().err
    assert main(["compare", "--variants", "base,dps", "--reference", "sml", "--out", "x"]) == 2
    assert (
        "--reference 'sml' is not a variant of the grid: ['base', 'dps']" in capsys.readouterr().err
    )
    assert main(["compare", "--seeds", "3-1", "--out", str(tmp_path)]) == 2
    assert "--seeds '3-1'" in capsys.readouterr().err


def test_a_cell_taken_by_another_grid_is_one_line_not_a_traceback(monkeypatch, tmp_path, capsys):
    """Two grids in one folder can reach the same cell: the second is told so and stops."""
    import daca.cli.compare as cli

    def taken(**_):
        raise FileExistsError("grid/runs/wd1-base-seed0 already holds a run; resume it with …")

    monkeypatch.setattr(cli, "run_grid", taken)
    assert main(["compare", "--methods", "wd1", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "error: grid/runs/wd1-base-seed0 already holds a run; resume it with …\n"
    )


def test_inspect_renders_png_and_html(grid, capsys):
    compare.run_grid(**grid)
    run = grid["out"] / "runs" / "wd1-dps-seed0"
    assert main(["inspect", str(run), "--step", "2"]) == 0
    page = (run / "inspect" / "rollout-step-2.html").read_text()
    assert page.count("<tr>") == 1 + 6 and "multiplier" in page
    assert (run / "inspect" / "rollout-step-2.png").stat().st_size > 1000
    assert main(["inspect", str(run), "--step", "99"]) == 2
    assert "recorded: [1, 2]" in capsys.readouterr().err


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a parent that no longer reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
def test_a_terminated_grid_leaves_no_worker_running(tiny_model_dir, tmp_path, signum):
    """SIGTERM to ``daca compare --jobs 2``: its workers save their cells and end, and so does
    the grid (exit 143); SIGKILL: the workers end with it (they used to train on, unseen)."""
    out = tmp_path / "grid"
    cmd = [
        sys.executable, "-m", "daca.cli", "compare", "--jobs", "2", "--methods", "wd1",
        "--variants", "base,dps", "--seeds", "1", "--steps", "1000", "--out", str(out),
        f"model={tiny_model_dir}", "per_device_train_batch_size=12", "train_size=24",
        "eval_size=6", "tensorboard=false", "generation.steps=4", "dps.stride=1",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while len(list(out.glob("sudoku/runs/*/metrics.jsonl"))) < 2:  # both cells training
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        workers = descendants(proc.pid)
        assert len(workers) >= 2
        proc.send_signal(signum)
        # A generous bound: SIGTERM lets each cell finish its step (or evaluation) first.
        assert proc.wait(timeout=300) == (143 if signum == signal.SIGTERM else -signum)
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in workers)
    finally:
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _record(tokens: list[list[str]], prompt: str, task: str = "sudoku") -> dict:
    n = len(tokens)
    return {
        "step": 3,
        "task": task,
        "method": "wd1",
        "lam": 0.5,
        "prompts": [prompt] * n,
        "tokens": tokens,
        "pad_token": "[PAD]",
        "birth_step": [list(range(len(t))) for t in tokens],
        "rewards": [0.5] * n,
        "advantages": [0.0] * n,
        "multipliers": [[0.25 + 0.1 * i for i in range(len(t))] for t in tokens],
    }


def test_inspect_marks_the_givens_and_leaves_padding_out(tmp_path):
    from daca.tools.inspect_run import _BLUE, _ink, drawn_cells, render_html, render_png

    grid = list("4231142241134241")
    rec = _record([grid, [*grid[:14], "[EOS]", "[PAD]"]], prompt="2301100201033000=")
    rows = drawn_cells(rec)
    # Givens of 2301100201033000: cells 0, 1, 3, 4, 7, 9, 11, 12, whatever the model wrote there.
    assert [c.position for c in rows[0] if c.given] == [0, 1, 3, 4, 7, 9, 11, 12]
    assert [c.position for c in rows[1]] == list(range(15))  # the [PAD] is not drawn
    assert rows[1][14].text == "·"
    assert not any(c.given for c in drawn_cells(_record([grid], "2301", task="ones"))[0])
    # Text colour by the background's luminance: white on the darkest blue, black on white.
    assert _ink(_BLUE) == "white" and _ink((1.0, 1.0, 1.0)) == "black"
    assert rows[0][0].colour == _BLUE  # the smallest multiplier
    render_png(rec, tmp_path / "r.png")
    render_html(rec, tmp_path / "r.html", "r.png")
    page = (tmp_path / "r.html").read_text()
    assert "[PAD]" not in page and page.count("outline:2px solid black") == 16
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_plots_do_not_magnify_noise():
    from daca.train.run_logging import honest_limits

    # A fraction (0.455 -> 0.458): the whole [0, 1], so the change looks as small as it is.
    assert honest_limits([0.455, 0.458], [0.03, 0.03]) == (-0.02, 1.02)
    lo, hi = honest_limits([0.01, 0.02], [0.05, 0.05])  # an interval below 0 stays visible
    assert lo <= -0.04 and hi == 1.02
    # Other scales: never narrower than the widest interval, nor a tenth of the magnitude.
    lo, hi = honest_limits([10.0, 10.1], [0.0, 0.0])
    assert hi - lo >= 1.0
    lo, hi = honest_limits([2.0, 2.1], [1.5, 0.0])
    assert lo <= 0.5 and hi >= 3.5
