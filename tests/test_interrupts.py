"""Ctrl-C (SIGINT) and SIGTERM of real ``daca train``, ``daca compare`` and ``daca pretrain``
processes: the last finished step is saved, one line says how to go on, the exit status is
128 + the signal, no traceback; and a resume never deletes what a run wrote.

The processes announce their phases (tests/_kill_worker.py); every wait is on a line or a file,
with generous timeouts, never on a wall-clock bound.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import SMALL_RUN
from safetensors.torch import load_file
from test_kill_resume import Run, _jsonl

from daca.cli import main
from daca.train.checkpointing import set_aside

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 6
COMMON = [
    *SMALL_RUN,
    "task=ones",
    "eval_every=2",
    f"max_steps={MAX_STEPS}",
    "save_every=100",  # no periodic checkpoint: the interrupt writes the only one before the end
    "save_rollouts_every=1",
    "learning_rate=1e-3",
    "weight_decay=0.0",
]
HINT = re.compile(r"stopped by (SIGINT|SIGTERM) at step (\d+) of \d+ .*continue with: (.*)$")


def _interrupt(run: Run, signum: int, after_phase: str) -> tuple[int, list[str]]:
    """Send ``signum`` once the run announces ``after_phase``; returns (exit status, output)."""
    run.wait_for(after_phase)
    run.proc.send_signal(signum)
    run.proc.wait(timeout=300)
    return run.proc.returncode, run.rest()


def test_sigint_saves_the_last_finished_step_and_the_resumed_run_equals_an_uninterrupted_one(
    tiny_model_dir, tmp_path
):
    common = [f"model={tiny_model_dir}", f"output_dir={tmp_path}", *COMMON]
    straight = Run([*common, "name=straight"], phases=False)
    run_dir = tmp_path / "cut"
    run = Run([*common, "name=cut"], phases=True)
    # The step-0 evaluation drew the curves while the run goes on.
    run.wait_for(r"^PHASE rollout 0$")
    assert (run_dir / "curves.png").stat().st_size > 1000
    code, out = _interrupt(run, signal.SIGINT, r"^PHASE update 2$")
    text = "\n".join(out)
    assert code == 130, text
    assert "Traceback" not in text
    hints = [m for line in out if (m := HINT.search(line))]
    assert len(hints) == 1, text
    assert hints[0].group(3) == f"daca train --resume {run_dir}"
    step = int(hints[0].group(2))
    assert step >= 3  # the step under way at the signal was finished, not thrown away
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == [f"step-{step:07d}"]
    assert [m["step"] for m in _jsonl(run_dir / "metrics.jsonl")] == list(range(1, step + 1))
    assert (run_dir / "curves.png").is_file()

    final = Run(["--resume", str(run_dir)], phases=False)
    final.wait_for(re.escape(f"resuming {run_dir} from step {step}"))
    assert final.proc.wait(timeout=300) == 0, "\n".join(final.rest())
    assert straight.proc.wait(timeout=300) == 0, "\n".join(straight.rest())
    name = f"checkpoints/step-{MAX_STEPS:07d}/model/model.safetensors"
    a, b = load_file(tmp_path / "straight" / name), load_file(run_dir / name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for log in ("metrics.jsonl", "evals.jsonl"):
        assert _jsonl(tmp_path / "straight" / log) == _jsonl(run_dir / log), log
    assert not (run_dir / "set-aside").exists()  # nothing past the checkpoint was written


def test_sigterm_exits_143_after_saving(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "term"
    args = [f"model={tiny_model_dir}", f"output_dir={tmp_path}", *COMMON, "name=term"]
    code, out = _interrupt(Run(args, phases=True), signal.SIGTERM, r"^PHASE rollout 1$")
    text = "\n".join(out)
    assert code == 143 and "Traceback" not in text, text
    step = int(next(m for line in out if (m := HINT.search(line))).group(2))
    assert step >= 1 and (run_dir / "checkpoints" / f"step-{step:07d}" / "COMPLETE").is_file()
    # The held-out metric with its 95 % interval, as drawn in curves.png.
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert {"step", "held_out", "held_out_ci95"} <= set(evals[0])


def test_a_second_ctrl_c_quits_at_once(tiny_model_dir, tmp_path):
    args = [f"model={tiny_model_dir}", f"output_dir={tmp_path}", *COMMON, "name=twice"]
    run = Run(args, phases=True)
    run.wait_for(r"^PHASE rollout 1$")
    run.proc.send_signal(signal.SIGINT)
    run.wait_for(r"interrupted \(SIGINT\): saving")
    run.proc.send_signal(signal.SIGINT)
    assert run.proc.wait(timeout=120) == 130
    text = "\n".join(run.rest())
    assert "quitting now" in text and "Traceback" not in text


def test_resume_without_a_checkpoint_keeps_every_line(tiny_model_dir, tmp_path, capsys):
    """A run stopped before its first checkpoint starts over on --resume, its earlier files
    moved to set-aside/1 (it used to cut metrics.jsonl back to nothing)."""
    run_dir = tmp_path / "early"
    args = [f"model={tiny_model_dir}", f"output_dir={tmp_path}", *COMMON, "name=early"]
    assert main(["train", *args, "task=sudoku", "max_steps=2", "--no-progress"]) == 0
    for p in (run_dir / "checkpoints").iterdir():  # as if stopped before its first checkpoint
        for f in sorted(p.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        p.rmdir()
    before = {name: (run_dir / name).read_text() for name in ("metrics.jsonl", "evals.jsonl")}
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "--no-progress"]) == 0
    said = capsys.readouterr().out
    aside = run_dir / "set-aside" / "1"
    assert f"starting it over: its earlier files are kept in {aside}" in said
    for name, text in before.items():
        assert (aside / name).read_text() == text
        assert _jsonl(run_dir / name) == _jsonl(aside / name)  # the same run again
    assert (aside / "rollouts" / "step-0000002.json").is_file()


def test_resume_sets_aside_what_lies_past_the_checkpoint(tmp_path):
    """Lines and rollouts past the checkpoint's step (and a line torn by a crash) move to
    set-aside/N instead of being cut; the lines up to the step stay as they were."""
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    lines = [json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(1, 9)]
    (run / "metrics.jsonl").write_text("".join(lines) + '{"step": 9, "rew')
    (run / "evals.jsonl").write_text('{"step": 0}\n{"step": 4}\n{"step": 8}\n')
    for s in (2, 4, 6, 8):
        (run / "rollouts" / f"step-{s:07d}.json").write_text("{}")
    assert set_aside(run, 5) == run / "set-aside" / "1"
    assert (run / "metrics.jsonl").read_text() == "".join(lines[:5])
    assert (run / "set-aside/1/metrics.jsonl").read_text() == "".join(
        lines[5:]
    ) + '{"step": 9, "rew'
    assert (run / "evals.jsonl").read_text() == '{"step": 0}\n{"step": 4}\n'
    assert (run / "set-aside/1/evals.jsonl").read_text() == '{"step": 8}\n'
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == [
        "step-0000002.json",
        "step-0000004.json",
    ]
    assert sorted(p.name for p in (run / "set-aside/1/rollouts").iterdir()) == [
        "step-0000006.json",
        "step-0000008.json",
    ]
    assert set_aside(run, 5) is None  # nothing more to move: no empty folder
    assert set_aside(run, 3) == run / "set-aside" / "2"  # a later resume: a new folder
    assert [json.loads(x)["step"] for x in (run / "set-aside/2/metrics.jsonl").open()] == [4, 5]


def _cli(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "daca.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_until(condition, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"condition not met; exit {proc.returncode}\n{out}\n{err}")
        time.sleep(0.3)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def test_sigint_to_a_parallel_grid_stops_its_workers_and_the_cells_resume(tiny_model_dir, tmp_path):
    out = tmp_path / "grid"
    steps = 30  # a cell that loads late may still finish before the signal; most cannot
    args = [
        "compare", "--jobs", "2", "--methods", "wd1", "--variants", "base,dps", "--seeds", "1",
        "--steps", str(steps), "--out", str(out), f"model={tiny_model_dir}", *SMALL_RUN,
        "save_every=100",
    ]  # fmt: skip
    proc = _cli(args)
    runs = [out / "sudoku" / "runs" / f"wd1-{v}-seed0" for v in ("base", "dps")]
    _wait_until(lambda: all(_lines(r / "metrics.jsonl") >= 1 for r in runs), proc)
    proc.send_signal(signal.SIGINT)  # to the grid's process only, as a terminal's Ctrl-C is
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stdout + stderr
    assert "Traceback" not in stderr and "run the same `daca compare` command again" in stderr
    stopped = [run for run in runs if not (run / "summary.json").exists()]
    assert stopped, "both cells finished before the signal"
    for run in stopped:
        (checkpoint,) = (run / "checkpoints").iterdir()  # the step the cell had finished
        assert 1 <= int(checkpoint.name[5:]) < steps

    again = _cli(args)
    stdout, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stdout + stderr
    for run in runs:
        assert f"{run.name}: {'resuming' if run in stopped else 'finished earlier'}" in stdout
        assert [m["step"] for m in _jsonl(run / "metrics.jsonl")] == list(range(1, steps + 1))
        assert (run / "summary.json").is_file()


def test_pretrain_interrupt_saves_the_model(tmp_path):
    signum = signal.SIGINT
    model = tmp_path / "tiny"
    args = [
        "pretrain", "--out", str(model), "--max-steps", "100000", "--eval-every", "1000",
        "--eval-size", "4", "--train-size", "40", "--batch-size", "8", "--target-accuracy",
        "-1", "--hidden-size", "32", "--num-layers", "1",
    ]  # fmt: skip
    proc = _cli(args)
    first = proc.stdout.readline()
    assert "Ctrl-C saves the model" in first, first
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signum, stdout + stderr
    assert "Traceback" not in stderr
    assert f"continue with: daca pretrain --init-from {model} --out {model}" in stderr
    meta = json.loads((model / "daca.json").read_text())
    assert meta["steps_trained"] >= 0 and (model / "model.safetensors").is_file()
    # The same command again must not overwrite the saved model; --init-from continues it.
    again = _cli(args)
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 2 and f"--out {model} already holds a model" in stderr
    go_on = _cli([*args[:4], "1", *args[5:], "--init-from", str(model)])
    stdout, stderr = go_on.communicate(timeout=300)
    assert go_on.returncode == 0, stdout + stderr
    after = json.loads((model / "daca.json").read_text())
    assert after["steps_trained"] == meta["steps_trained"] + 1


def test_a_signal_to_one_rank_stops_both_at_the_same_step(tiny_model_dir, tmp_path):
    """Under ``accelerate launch`` (2 processes), SIGTERM to one rank only: both agree on the
    step to stop at (no rank waits alone in a collective), the checkpoint of that step is
    complete, and the run resumes to its end."""
    from _launch import kill_all, launch_two, start_two

    pytest.importorskip("accelerate")
    worker = Path(__file__).with_name("_kill_worker.py")
    run_dir = tmp_path / "ddp"
    common = ["train", "--no-progress", f"model={tiny_model_dir}", f"output_dir={tmp_path}"]
    env = {"DACA_PHASES": "1", "DACA_SLOW": "0.2", "PYTHONUNBUFFERED": "1"}
    proc = start_two(worker, [*common, *COMMON, "name=ddp"], env=env, bufsize=1)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("PHASE update 1"):
                break
        ranks = [
            pid
            for pid in _descendants(proc.pid)
            if "_kill_worker.py" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
        ]
        assert len(ranks) == 2, "".join(seen)
        os.kill(ranks[-1], signal.SIGTERM)
        log, _ = proc.communicate(timeout=300)
    except BaseException:
        kill_all(proc)
        raise
    text = "".join(seen) + log
    saved = re.findall(r"^PHASE saved (\d+)$", text, re.M)
    assert len(saved) == 1 and int(saved[0]) >= 2, text[-4000:]
    step = int(saved[0])
    # One hint, from rank 0, out before the launcher ends the ranks (it reports their 143).
    assert text.count(f"stopped by SIGTERM at step {step} of ") == 1, text[-4000:]
    assert (run_dir / "checkpoints" / f"step-{step:07d}" / "COMPLETE").is_file()
    assert [m["step"] for m in _jsonl(run_dir / "metrics.jsonl")] == list(range(1, step + 1))
    code, log = launch_two(worker, [*common[:2], "--resume", str(run_dir)], timeout=300)
    assert code == 0, log[-4000:]
    assert [m["step"] for m in _jsonl(run_dir / "metrics.jsonl")] == list(range(1, MAX_STEPS + 1))


def _descendants(pid: int) -> list[int]:
    from _launch import descendants

    return [p for p in descendants(pid) if Path(f"/proc/{p}/cmdline").exists()]
