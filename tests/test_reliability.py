"""Reliability: starve the trainer, feed it garbage, break one of its processes, load the
sandbox while it trains. Every test does the damage for real and checks that nothing is lost,
nothing hangs, and every error names what to fix (no traceback from deep inside).

(Kills at random moments and ``--resume``: tests/test_kill_resume.py.)
"""

import errno
import io
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daca import checkpoint
from daca.cli import main
from daca.config import describe, load_config
from daca.models.loading import load
from daca.models.prompts import fit_prompts, pad_prompts, prompt_limit
from daca.rewards import RewardError, score_rewards
from daca.tasks import Task, get_task, register_task
from daca.trainer import InputError, Trainer, TrainingError

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_kill_worker.py")


def _task(name, reward, prompt=None) -> Task:
    """Sudoku rows with another reward (and prompt) a random model can be tested on."""
    sudoku = get_task("sudoku")
    return Task(
        name=name,
        load=sudoku.load,
        chat_prompt=sudoku.chat_prompt,
        compact_prompt=prompt or sudoku.compact_prompt,
        reward_funcs=[reward],
        score=lambda completions, **kw: reward(None, completions),
        columns=sudoku.columns,
    )


def _ones(prompts, completions, **kw):
    return [c.count("1") / 16 for c in completions]


def _constant(prompts, completions, **kw):
    return [0.5] * len(completions)


SEEN: list[str] = []  # completions the "seen" task's reward received


def _record(prompts, completions, **kw):
    SEEN.extend(completions)
    return [float(len(c)) for c in completions]


HANG = threading.Event()  # set at the end of the test that hangs a reward function


def _hangs(prompts, completions, **kw):
    HANG.wait(60)
    return [0.0] * len(completions)


register_task("ones", lambda: _task("ones", _ones))
register_task("constant", lambda: _task("constant", _constant))
register_task("seen", lambda: _task("seen", _record))
register_task("hangs", lambda: _task("hangs", _hangs))
# Prompts of 34 tokens for a model that reads 20: the puzzle twice.
register_task("long", lambda: _task("long", _ones, lambda r: r["puzzle"] * 2 + "="))

SMALL = [
    "task=ones",
    "device=cpu",
    "weight_decay=0.0",
    "per_device_train_batch_size=4",
    "num_generations=2",
    "train_size=20",
    "eval_size=2",
    "eval_every=0",
    "max_steps=2",
    "save_rollouts_every=0",
    "tensorboard=false",
    "generation.steps=4",
    "generation.gen_length=8",
    "generation.block_length=8",
    "dps.stride=1",
    "learning_rate=1e-3",
]


def _args(model_dir, out, name, *overrides) -> list[str]:
    return [f"model={model_dir}", f"output_dir={out}", f"name={name}", *SMALL, *overrides]


def _cfg(model_dir, out, name, *overrides):
    return load_config(None, _args(model_dir, out, name, *overrides))


def _params(trainer) -> dict:
    model = trainer.acc.unwrap_model(trainer.model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def _finite(row: dict) -> bool:
    return all(math.isfinite(v) for v in row.values() if isinstance(v, float))


# ---------------------------------------------------------------------------------- disk, paths
def test_unwritable_output_folder_is_found_before_the_model_loads(tiny_model_dir, tmp_path, capsys):
    """As root, permissions do not stop a write: a folder below a regular file does."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "runs"
    cfg = _cfg(tiny_model_dir, out, "r")
    with pytest.raises(InputError, match=r"cannot write to the output folder .*a-file/runs/r"):
        Trainer(cfg, progress=False)
    # Through the CLI, with a model that does not exist: the folder is what gets reported.
    code = main(["train", *_args("/no/such/model", out, "r"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert re.search(r"error: cannot write to the output folder .*a-file/runs/r .*output_dir=", err)


def test_full_disk_at_a_checkpoint_keeps_the_previous_one(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """ENOSPC halfway through the second checkpoint: the first stays complete, the partial
    one goes, the run stops with a message naming the folder and the fix; once there is space,
    --resume continues from the first."""
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if "step-0000002.tmp" in str(f) and str(f).endswith("trainer_state.pt"):
            buf = io.BytesIO()
            real_save(obj, buf)
            Path(f).write_bytes(buf.getvalue()[:100])  # a torn file, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    args = _args(tiny_model_dir, tmp_path, "full", "max_steps=3", "save_every=1")
    code = main(["train", *args, "save_total_limit=1", "--no-progress"])
    err = capsys.readouterr().err
    run_dir = tmp_path / "full"
    assert code == 1 and "Traceback" not in err
    assert re.search(
        rf"could not write the checkpoint of step 2 to {run_dir}/checkpoints "
        rf"\(No space left on device\).*step-0000001 is intact.*Free space in "
        rf".*daca train --resume {run_dir}",
        err,
    ), err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-0000001"]
    assert checkpoint.latest_checkpoint(run_dir)[0] == 1
    monkeypatch.setattr(torch, "save", real_save)  # space freed
    assert main(["train", "--resume", str(run_dir), "--no-progress"]) == 0
    assert f"resuming {run_dir} from step 1" in capsys.readouterr().out
    assert [s for s, _ in checkpoint.list_checkpoints(run_dir)] == [3]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_checkpoint_leftovers_are_finished_or_removed(tmp_path):
    """What a crash between two renames leaves: recover() completes or deletes it."""
    root = tmp_path / "checkpoints"
    for name, complete in [
        ("step-0000003.tmp", True),  # complete, never renamed: becomes step 3
        ("step-0000004.tmp", False),  # torn write: deleted
        ("step-0000001.old", False),  # half deleted: deleted
        ("step-0000002.old", True),  # moved aside, step-2 exists: deleted
        ("step-0000002", True),
    ]:
        (root / name).mkdir(parents=True)
        (root / name / "model.bin").write_bytes(b"w")
        if complete:
            (root / name / "COMPLETE").write_text("x")
    checkpoint.recover(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["step-0000002", "step-0000003"]
    # A failed write leaves nothing; a second write of a step replaces it whole.
    with pytest.raises(OSError):
        checkpoint.write_atomically(tmp_path, 5, lambda d: (_ for _ in ()).throw(OSError()), 2)
    assert sorted(p.name for p in root.iterdir()) == ["step-0000002", "step-0000003"]
    checkpoint.write_atomically(tmp_path, 3, lambda d: (d / "new").write_text("n"), keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-0000003"]
    assert sorted(p.name for p in (root / "step-0000003").iterdir()) == ["COMPLETE", "new"]


# ---------------------------------------------------------------------------------- bad configs
_KEYS = [line.split(" = ")[0] for line in describe()]
_SECTIONS = sorted({k.split(".")[0] for k in _KEYS if "." in k})
_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.integers(-(10**15), 10**15),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["wd1", "gdpo", "all", "block", "per_step", "1e-3", "gauss-", "gauss-x"]),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_keys = st.sampled_from(_KEYS + _SECTIONS + ["bogus", "dps.bogus", "generation.lenght", "lr"])


def _nest(pairs: dict) -> dict:
    """Dotted keys to nested YAML sections (a clash keeps the first value)."""
    doc: dict = {}
    for key, value in pairs.items():
        *path, last = key.split(".")
        node = doc
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            node.setdefault(last, value)
    return doc


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    st.one_of(
        st.dictionaries(_keys, _values, max_size=5).map(_nest),
        st.text(max_size=30),  # any text at all: YAML or not, a mapping or not
    )
)
def test_generated_yaml_configs_fail_with_a_message_naming_the_field(tmp_path, capsys, doc):
    path = tmp_path / "recipe.yaml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    code = main(["train", "--config", str(path), "--dry-run"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if code == 0:
        assert "effective batch" in out
        return
    assert code == 2
    assert err.startswith(f"config error in {path}: "), err
    message = err.split(": ", 1)[1]
    if isinstance(doc, dict) and doc:
        # The message names a field of the file (its last part) or the file itself.
        words = {k.split(".")[-1] for k in _flatten(doc)} | set(doc)
        assert any(str(w) in message for w in words) or str(path) in message, (doc, message)


def _flatten(doc: dict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in doc.items():
        keys.append(f"{prefix}{k}")
        if isinstance(v, dict):
            keys += _flatten(v, f"{prefix}{k}.")
    return keys


# ---------------------------------------------------------------------------------- bad data
@pytest.mark.parametrize(
    ("task", "name", "text", "message"),
    [
        (
            "sudoku",
            "bad.csv",
            "Puzzle,Solution\n1234341221434321,1234341221434321\n12,34\n",
            r"bad.csv, line 3: puzzle and solution must have 16 characters",
        ),
        (
            "countdown",
            "bad.jsonl",
            '{"input": "1,2", "output": "3"}\n{oops\n',
            r"bad.jsonl, line 2",
        ),
        ("sudoku", None, "", r"data_file=.*missing.csv.*No such file"),
    ],
    ids=["sudoku-csv-line", "countdown-jsonl-line", "missing-file"],
)
def test_malformed_data_is_reported_by_the_cli(
    tiny_model_dir, tmp_path, capsys, task, name, text, message
):
    path = tmp_path / (name or "missing.csv")
    if name:
        path.write_text(text)
    args = _args(tiny_model_dir, tmp_path, "data", f"task={task}", f"data_file={path}")
    assert main(["train", *args, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("error: cannot read data_file="), err
    assert re.search(message, err), err


def test_prompts_longer_than_the_model_reads(tiny_model_dir, tmp_path):
    """34-token prompts for a model with a 20-token prompt width: an error naming the prompt,
    or, with truncate_prompts, their last 20 tokens, counted in the metrics."""
    with pytest.raises(InputError, match=r"task long's train split: prompt 0 '\d{32}=' has 33"):
        Trainer(_cfg(tiny_model_dir, tmp_path, "long", "task=long"), progress=False)
    trainer = Trainer(
        _cfg(tiny_model_dir, tmp_path, "cut", "task=long", "truncate_prompts=true"), progress=False
    )
    trainer.train()
    assert [h["prompts_truncated"] for h in trainer.history] == [2.0, 2.0]  # 2 prompts a step
    assert all(_finite(h) for h in trainer.history)
    # The cut keeps the end; other prompts pass unchanged, and the counts are exact.
    ids, cut = fit_prompts([[1, 2, 3, 4, 5], [6, 7]], 3, truncate=True)
    assert (ids, cut) == ([[3, 4, 5], [6, 7]], 1)
    bundle = load(str(tiny_model_dir))
    assert prompt_limit(bundle, 16) == 20
    padded, mask = pad_prompts(bundle, ids)
    assert padded.shape == (2, 20) and mask.sum(1).tolist() == [3, 2]
    assert padded[0, -3:].tolist() == [3, 4, 5] and padded[1, -2:].tolist() == [6, 7]
    bundle.prompt_width = None  # a model without a fixed width: its positions less the completion
    assert prompt_limit(bundle, 16) == bundle.model.config.max_position_embeddings - 16
    with pytest.raises(ValueError, match=r"prompt 1 'abc' has 2 tokens, more than the 1"):
        fit_prompts([[1], [1, 2]], 1, truncate=False, texts=["a", "abc"])


def test_empty_completions_train_without_nan(tiny_model_dir, tmp_path):
    """A model that only ever writes end-of-sequence: every completion is empty text."""
    trainer = Trainer(_cfg(tiny_model_dir, tmp_path, "empty", "task=seen"), progress=False)
    model = trainer.acc.unwrap_model(trainer.model)
    eos = trainer.bundle.eos_ids[0]
    with torch.no_grad():
        model.cls.predictions.bias[eos] = 1e4
    SEEN.clear()
    trainer.train()
    assert SEEN and set(SEEN) == {""}
    assert all(_finite(h) for h in trainer.history)
    assert [h["reward"] for h in trainer.history] == [0.0, 0.0]


@pytest.mark.parametrize(
    "overrides",
    [
        ["method=wd1", "scale_rewards=group", "sml.enabled=true"],
        ["method=diffu_grpo", "num_iterations=2"],
        ["method=gdpo", "scale_rewards=group"],
    ],
    ids=["wd1-sml-scaled", "diffu_grpo-mu2", "gdpo-scaled"],
)
def test_groups_with_equal_rewards_give_zero_advantages_and_no_nan(
    tiny_model_dir, tmp_path, overrides
):
    """Every completion scores 0.5: all advantages are 0, nothing is NaN (the group std of 0
    is not divided by), and the update leaves the weights exactly as they were."""
    trainer = Trainer(
        _cfg(tiny_model_dir, tmp_path, "eq", "task=constant", *overrides), progress=False
    )
    before = _params(trainer)
    trainer.train()
    for h in trainer.history:
        assert _finite(h), h
        assert h["advantage_abs"] == 0.0 and h["reward"] == 0.5 and h["nonfinite_skipped"] == 0
    assert _same(before, _params(trainer))


# ---------------------------------------------------------------------------------- NaN and inf
def _poison(trainer, value: float, steps: set[int] | None):
    """Make the model's logits ``value`` (NaN or inf) at the given steps (None: always)."""

    def hook(module, args, output):
        if steps is None or trainer.step in steps:
            output.logits = output.logits + value
        return output

    return trainer.acc.unwrap_model(trainer.model).register_forward_hook(hook)


def test_a_nonfinite_step_is_skipped_and_counted(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, tmp_path, "nan1", "max_steps=3", "method=diffu_grpo")
    trainer = Trainer(cfg, progress=False)
    _poison(trainer, float("nan"), steps={1})
    snapshots = []
    for _ in range(3):
        trainer.history.append(trainer.train_step())
        snapshots.append(_params(trainer))
    assert [h["nonfinite_skipped"] for h in trainer.history] == [0.0, 1.0, 0.0]
    assert math.isnan(trainer.history[1]["loss"])
    assert _same(snapshots[0], snapshots[1])  # the NaN step changed nothing
    assert not _same(snapshots[1], snapshots[2])  # and training went on
    assert all(torch.isfinite(v).all() for v in snapshots[2].values())


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_steps_in_a_row_stop_the_run_with_a_diagnosis(
    tiny_model_dir, tmp_path, capsys, value
):
    cfg = _cfg(tiny_model_dir, tmp_path, "nan", "max_steps=10", "max_nonfinite_steps=3")
    trainer = Trainer(cfg, progress=False)
    before = _params(trainer)
    _poison(trainer, value, steps=None)
    with pytest.raises(TrainingError) as e:
        trainer.train()
    assert re.search(
        r"3 steps in a row \(1 to 3\) had non-finite log-probabilities: the model's logits "
        r"hold NaN or inf.*max_nonfinite_steps=3 stops the run\. No checkpoint was written",
        str(e.value),
    ), e.value
    assert trainer.step == 3 and _same(before, _params(trainer))
    rows = [json.loads(x) for x in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["nonfinite_skipped"], r["nonfinite_steps"]) for r in rows] == [
        (1.0, 1.0),
        (1.0, 2.0),
        (1.0, 3.0),
    ]


# ---------------------------------------------------------------------------------- rewards
def test_a_hanging_reward_function_is_bounded_by_its_timeout(tiny_model_dir, tmp_path):
    HANG.clear()
    try:
        t0 = time.monotonic()
        with pytest.raises(
            RewardError, match=r"_hangs did not return within 0.3 s .*reward_timeout"
        ):
            score_rewards([_hangs], [1.0], ["p"] * 2, ["a", "b"], {}, timeout=0.3)
        per, total, errors = score_rewards(
            [_ones, _hangs], [1.0, 1.0], ["p"] * 2, ["11", "b"], {}, on_error="zero", timeout=0.3
        )
        assert per.tolist() == [[2 / 16, 0.0], [0.0, 0.0]] and errors == 2
        assert time.monotonic() - t0 < 5
        # In training: the batch is scored 0, the errors counted, the step finishes.
        cfg = _cfg(
            tiny_model_dir,
            tmp_path,
            "hang",
            "task=hangs",
            "reward_timeout=0.3",
            "on_reward_error=zero",
        )
        trainer = Trainer(cfg, progress=False)
        t0 = time.monotonic()
        stats = trainer.train_step()
        assert stats["reward_errors"] == 4 and stats["reward"] == 0.0 and _finite(stats)
        assert time.monotonic() - t0 < 30
    finally:
        HANG.set()  # let the abandoned threads end


def test_a_raising_reward_function_stops_the_cli_with_its_name_and_example(
    tiny_model_dir, tmp_path, capsys
):
    register_task("raises", lambda: _task("raises", lambda prompts, completions, **kw: 1 / 0))
    code = main(
        ["train", *_args(tiny_model_dir, tmp_path, "raise", "task=raises"), "--no-progress"]
    )
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert re.search(r"error: reward function <lambda> failed on example 0 \(prompt '.*", err)
    assert "ZeroDivisionError" in err


# ---------------------------------------------------------------------------------- processes
def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_an_error_on_one_rank_ends_both_processes(tiny_model_dir, tmp_path):
    """Two CPU processes; rank 1's reward function raises at its second rollout while rank 0
    goes on into the next collective. Both must end soon, with rank 1's error, leaving no
    process and no temporary folder of ours behind."""
    pytest.importorskip("accelerate")
    marker = f"DACA_TEST_{uuid.uuid4().hex}"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = _args(tiny_model_dir, tmp_path, "ddp", "task=ones_rank1_fails", "max_steps=4")
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "configs" / "accelerate" / "cpu_2proc.yaml"),
        "--num_processes",
        "2",
        "--main_process_port",
        str(port),
        str(WORKER),
        "train",
        *args,
        "--no-progress",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp), marker: "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"a failing rank left the other hanging:\n{log[-4000:]}")
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert "error: reward function ones failed on example 0" in log
    assert "injected failure on rank 1" in log
    time.sleep(0.5)
    assert _processes_with(marker) == []
    # torchrun keeps its own logs (torchelastic_*) and torch its compile cache; nothing else.
    left = [p.name for p in tmp.iterdir() if not p.name.startswith(("torchelastic_", "torch"))]
    assert left == []
    print(f"2 ranks, error on rank 1: both ended after {took:.1f} s (launch included)")


# ---------------------------------------------------------------------------------- load
def _malicious(i: int, sentinel: str, port: int) -> str:
    """200 hostile programs of 10 kinds, each unique (run_many would run duplicates once)."""
    kinds = [
        "while True:\n    pass",  # busy forever: the time limit
        "import time\ntime.sleep(60)",  # idle forever
        "import os\nwhile True:\n    os.fork()",  # fork bomb: the process limit
        "x = bytearray(1 << 34)",  # 16 GiB: the memory limit
        f"open({sentinel!r}, 'w').write('escaped')",  # overwrite a file outside
        f"import os\nos.remove({sentinel!r})",
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).send(b'x')",
        # a daemon that outlives the program, then tries to write outside
        f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3)\n"
        f"    open({sentinel!r}, 'w').write('daemon')",
        f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)",  # kill the trainer
        "import sys\nsys.stdout.write('x' * (1 << 26))\nsys.exit(0)",  # flood, fake success
    ]
    return f"# {i}\n" + kinds[i % len(kinds)]


def test_200_malicious_programs_in_the_sandbox_while_a_step_trains(
    tiny_model_dir, tmp_path, monkeypatch
):
    from daca import sandbox

    isolation = sandbox.isolation_available()
    # Without bubblewrap and without root the sandbox runs as our own uid and cannot protect
    # our files (daca.sandbox says so); then only the bounds are checked.
    protects_files = isolation == "bwrap" or os.geteuid() == 0
    sentinel = Path("/var/tmp") / f"daca-sentinel-{uuid.uuid4().hex}"
    sentinel.write_text("intact")
    sentinel.chmod(0o644)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    trainer = Trainer(_cfg(tiny_model_dir, tmp_path, "load"), progress=False)
    results, stats = [], []
    try:
        codes = [_malicious(i, str(sentinel), port) for i in range(200)]
        step = threading.Thread(target=lambda: stats.append(trainer.train_step()))
        t0 = time.monotonic()
        step.start()
        results = sandbox.run_many(
            codes,
            [["assert True"]] * len(codes),
            workers=8,
            timeout=1.0,
            memory_mb=256,
            max_procs=8,
            max_file_mb=1,
            scratch_mb=4,
        )
        step.join(120)
        took = time.monotonic() - t0
        assert not step.is_alive() and stats and _finite(stats[0])
        time.sleep(3.5)  # a daemon that escaped would have written by now
        assert len(results) == 200
        for code, r in zip(codes, results, strict=True):
            assert not r.passed, (code, r)
        if protects_files:
            assert sentinel.read_text() == "intact"
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody connected
        assert list(scratch.iterdir()) == []  # every run's folder removed
        left = [
            pid
            for pid in filter(str.isdigit, os.listdir("/proc"))
            if _uid_of(pid) in range(40000, 60000)  # the sandbox's uids (as root)
        ]
        assert left == []
        print(f"200 malicious programs ({isolation}) beside a training step: {took:.1f} s")
    finally:
        listener.close()
        sentinel.unlink(missing_ok=True)


def _uid_of(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1
