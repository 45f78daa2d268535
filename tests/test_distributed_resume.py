"""Exact resume and non-finite steps under FSDP on 2 CPU processes (gloo).

FSDP2 shards parameters and AdamW's moments across the ranks, so a resume is exact only if
every rank's shard (and RNG) comes back: the checkpoint's ``state/`` is accelerate's
``save_state``. A run with a NaN loss on rank 0 at step 2 goes to its end ("straight"); the same
run is killed with SIGKILL (the launcher and both ranks) in the middle of step 3's update and then
resumed: it must end with the same weights, metrics.jsonl and evals.jsonl. The NaN step must be
skipped on both ranks (the weights of step 1 and 2 equal) and counted.

The launch config is the shipped configs/accelerate/fsdp.yaml on 2 processes without bf16;
tests/_kill_worker.py lets accelerate run FSDP on CPU (it only does so on GPUs by itself).
DeepSpeed is not tested here: accelerate runs a CPU DeepSpeed launch as independent
single-process runs (each rank sees num_processes=1).
"""

import contextlib
import json
import queue
import threading
import time
from pathlib import Path

import pytest
import torch
from _launch import fsdp_cpu_config, kill_all, launch_two, start_two
from conftest import SMALL_RUN
from safetensors.torch import load_file

pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_kill_worker.py")
MAX_STEPS = 4
NAN_STEP = 1  # 0-based: the second step, logged as step 2
OVERRIDES = [
    "task=ones",
    *SMALL_RUN,
    "eval_every=2",
    f"max_steps={MAX_STEPS}",
    "save_every=1",
    f"save_total_limit={MAX_STEPS}",
    "method=diffu_grpo",
    "num_iterations=2",
    "learning_rate=1e-2",
    "weight_decay=0.0",
]
ENV = {"DACA_NAN_STEP": str(NAN_STEP), "DACA_NAN_RANK": "0"}


def _weights(run_dir: Path, step: int) -> dict:
    return load_file(run_dir / "checkpoints" / f"step-{step:07d}" / "model" / "model.safetensors")


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _jsonl(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """The straight run and the killed-then-resumed one; returns (straight, resumed) folders."""
    out = tmp_path_factory.mktemp("fsdp")
    config = fsdp_cpu_config(out)
    common = ["train", "--no-progress", f"model={tiny_model_dir}", f"output_dir={out}", *OVERRIDES]
    code, log = launch_two(WORKER, [*common, "name=straight"], timeout=600, env=ENV, config=config)
    assert code == 0, log[-4000:]

    killed = out / "killed"
    env = {**ENV, "DACA_PHASES": "1", "DACA_SLOW": "0.3", "PYTHONUNBUFFERED": "1"}
    proc = start_two(WORKER, [*common, "name=killed"], config=config, env=env, bufsize=1)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    seen, deadline = [], time.monotonic() + 600
    while "PHASE update 2" not in "".join(seen):  # the third step's update: step-2 is on disk
        assert proc.poll() is None and time.monotonic() < deadline, "".join(seen)[-4000:]
        with contextlib.suppress(queue.Empty):
            seen.append(lines.get(timeout=1))
    time.sleep(0.2)  # inside the update (each loss is followed by a 0.3 s pause)
    kill_all(proc)
    proc.wait(timeout=120)
    time.sleep(1)  # a rank left running would write step 3 meanwhile
    assert not (killed / "checkpoints" / "step-0000003").exists()

    code, log = launch_two(
        WORKER, ["train", "--resume", str(killed), "--no-progress"], timeout=600, config=config
    )
    assert code == 0, log[-4000:]
    assert f"resuming {killed} from step 2" in log, log[-4000:]
    return out / "straight", killed


def test_a_nan_loss_on_one_rank_is_skipped_on_both_and_counted(runs):
    straight, _ = runs
    rows = _jsonl(straight / "metrics.jsonl")
    assert [r["nonfinite_skipped"] for r in rows] == [0.0, 1.0, 0.0, 0.0]
    assert [r["nonfinite_steps"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert _same(_weights(straight, 1), _weights(straight, 2))  # the NaN step changed nothing
    assert not _same(_weights(straight, 2), _weights(straight, 3))  # and training went on
    assert all(torch.isfinite(v).all() for v in _weights(straight, MAX_STEPS).values())


def test_fsdp_kill9_mid_step_then_resume_equals_uninterrupted(runs):
    straight, resumed = runs
    for step in (3, MAX_STEPS):
        assert _same(_weights(straight, step), _weights(resumed, step)), step
    for log in ("metrics.jsonl", "evals.jsonl"):
        assert _jsonl(straight / log) == _jsonl(resumed / log), log
    assert [m["step"] for m in _jsonl(resumed / "metrics.jsonl")] == list(range(1, 5))
    # Each rank's shard of the optimizer state and its RNG are in the checkpoint.
    state = resumed / "checkpoints" / f"step-{MAX_STEPS:07d}" / "state"
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in state.iterdir()}
