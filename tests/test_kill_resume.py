"""``kill -9`` of a real ``daca train`` process at random moments, then ``--resume``.

A tiny run (random model, checkpoint every step) is killed six times in a row, twice in each
phase (mid-rollout, mid-update, mid-checkpoint-write), at a seeded random step and delay. After
every kill each checkpoint on disk must be complete (it loads) or absent, and the next
``--resume`` must start from the newest complete one. The run finally resumed to its end must
hold the same final weights, metrics.jsonl and evals.jsonl as an uninterrupted run (times
aside). The worker (tests/_kill_worker.py) announces phases on stdout and widens each phase.
"""

import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_kill_worker.py")
MAX_STEPS = 8
SLOW = 0.15  # seconds each phase is widened by in the killed runs
OVERRIDES = [
    "task=ones",
    "device=cpu",
    "per_device_train_batch_size=4",
    "num_generations=2",
    "train_size=20",
    "eval_size=2",
    "eval_every=3",
    f"max_steps={MAX_STEPS}",
    "save_every=1",
    "save_total_limit=2",
    "save_rollouts_every=2",
    "tensorboard=false",
    "generation.steps=4",
    "generation.gen_length=8",
    "generation.block_length=8",
    "dps.stride=1",
    "learning_rate=1e-3",
    "weight_decay=0.0",
]
PHASE_RE = re.compile(r"^PHASE (\w+) (\d+)$")


class Run:
    """A worker process whose output lines are read by a thread into a queue."""

    def __init__(self, args: list[str], phases: bool):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        env["PYTHONUNBUFFERED"] = "1"
        env.update(DACA_PHASES="1" if phases else "0", DACA_SLOW=str(SLOW))
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "train", *args, "--no-progress"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, pattern, timeout: float = 600.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self.kill()
                raise AssertionError(f"no line {pattern!r}; output:\n" + "\n".join(self.seen))
            self.seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL
        self.proc.wait(timeout=30)

    def rest(self) -> list[str]:
        """The remaining output, once the process has ended."""
        while (line := self.lines.get(timeout=30)) is not None:
            self.seen.append(line)
        return self.seen


def _checkpoints_complete_or_absent(run_dir: Path) -> list[int]:
    """Every folder named like a checkpoint is complete and loads; returns their steps."""
    steps = []
    root = run_dir / "checkpoints"
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if not re.fullmatch(r"step-\d+", p.name):
            assert re.fullmatch(r"step-\d+\.(tmp|old)", p.name), p  # leftovers, ignored
            continue
        assert (p / "COMPLETE").is_file(), f"{p} is a checkpoint without its COMPLETE marker"
        load_file(p / "model" / "model.safetensors")
        load_file(p / "state" / "model.safetensors")
        state = torch.load(p / "trainer_state.pt", weights_only=False)
        for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
            torch.load(p / "state" / name, weights_only=False)
        assert state["step"] == int(p.name[5:]) == len(state["history"])
        steps.append(state["step"])
    return steps


def _resumable_step(run_dir: Path) -> int:
    """The step a resume must start from: the newest folder marked complete (a complete
    .tmp/.old left between two renames is promoted by daca.train.checkpointing.recover)."""
    root = run_dir / "checkpoints"
    found = [int(p.name[5:12]) for p in root.glob("step-*") if (p / "COMPLETE").is_file()]
    return max(found, default=0)


def _jsonl(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


def test_kill9_at_random_moments_then_resume_equals_uninterrupted(tiny_model_dir, tmp_path):
    common = [f"model={tiny_model_dir}", f"output_dir={tmp_path}", *OVERRIDES]
    straight = Run([*common, "name=straight"], phases=False)  # meanwhile, on the other core
    run_dir = tmp_path / "killed"
    rng = random.Random(2024)
    phases = ["rollout", "update", "ckpt"] * 2
    rng.shuffle(phases)
    windows = {"rollout": SLOW, "update": SLOW, "ckpt": 2 * SLOW}
    kills = []
    for i, phase in enumerate(phases):
        start = _resumable_step(run_dir) if i else 0
        args = [*common, "name=killed"] if i == 0 else ["--resume", str(run_dir)]
        run = Run(args, phases=True)
        if i:
            said = f"resuming {run_dir} from step {start}" if start else "starting it over"
            run.wait_for(re.escape(said))
        # A random step from the resumed one on (a checkpoint's marker carries step + 1).
        target = min(start + rng.randint(0, 2), MAX_STEPS - 2) + (phase == "ckpt")
        while int(run.wait_for(rf"^PHASE {phase} (\d+)$").group(1)) < target:
            pass
        time.sleep(rng.uniform(0, windows[phase]))
        run.kill()
        last = [m for line in run.rest() if (m := PHASE_RE.match(line))][-1]
        kills.append((phase, last.group(1), int(last.group(2)), run.proc.returncode))
        assert run.proc.returncode == -signal.SIGKILL
        _checkpoints_complete_or_absent(run_dir)

    start = _resumable_step(run_dir)
    final = Run(["--resume", str(run_dir)], phases=True)
    final.wait_for(re.escape(f"resuming {run_dir} from step {start}"))
    final.proc.wait(timeout=600)
    assert final.proc.returncode == 0, "\n".join(final.rest())
    straight.proc.wait(timeout=600)
    assert straight.proc.returncode == 0, "\n".join(straight.rest())

    print("kills (target phase, phase at the kill, its step, exit status):", kills)
    assert {actual for _, actual, _, _ in kills} >= {"rollout", "update", "ckpt"}
    assert _checkpoints_complete_or_absent(run_dir)[-1] == MAX_STEPS
    # The leftovers of the interrupted writes are gone; the last save_total_limit=2 remain.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        f"step-{MAX_STEPS - 1:07d}",
        f"step-{MAX_STEPS:07d}",
    ]
    name = f"checkpoints/step-{MAX_STEPS:07d}/model/model.safetensors"
    a, b = load_file(tmp_path / "straight" / name), load_file(run_dir / name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for log in ("metrics.jsonl", "evals.jsonl"):
        assert _jsonl(tmp_path / "straight" / log) == _jsonl(run_dir / log), log
    assert [e["step"] for e in _jsonl(run_dir / "evals.jsonl")] == [0, 3, 6, 8]
    assert [m["step"] for m in _jsonl(run_dir / "metrics.jsonl")] == list(range(1, 9))
