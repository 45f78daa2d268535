"""Reliability: starve the trainer, feed it garbage, break one of its processes, load the
sandbox while it trains. Every test does the damage for real and checks that nothing is lost,
nothing hangs, and every error names what to fix (no traceback from deep inside).

(Kills at random moments and ``--resume``: tests/test_kill_resume.py.)
"""

import contextlib
import dataclasses
import errno
import io
import json
import math
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import types
import typing
import uuid
from pathlib import Path
from typing import Literal

import pytest
import torch
import yaml
from _launch import launch_two
from _tasks import ones, sudoku_rows_task
from conftest import SMALL_RUN
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daca.cli import main
from daca.models.loading import load
from daca.models.prompts import fit_prompts, pad_prompts, prompt_limit
from daca.tasks import register_task
from daca.tasks.rewards import RewardError, score_rewards
from daca.train import checkpointing as checkpoint
from daca.train.config import TrainConfig, describe, load_config
from daca.train.trainer import InputError, Trainer, TrainingError

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_kill_worker.py")


def _varied(prompts, completions, **kw):
    """A reward that differs between almost any two completions (so advantages are not 0)."""
    return [sum(map(ord, c)) % 7 / 7 for c in completions]


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


register_task("ones", lambda: sudoku_rows_task("ones", ones))
register_task("constant", lambda: sudoku_rows_task("constant", _constant))
register_task("varied", lambda: sudoku_rows_task("varied", _varied))
register_task("seen", lambda: sudoku_rows_task("seen", _record))
register_task("hangs", lambda: sudoku_rows_task("hangs", _hangs, score=ones))
# Prompts of 34 tokens for a model that reads 20: the puzzle twice.
register_task("long", lambda: sudoku_rows_task("long", ones, lambda r: r["puzzle"] * 2 + "="))

SMALL = [
    "task=ones",
    *SMALL_RUN,
    "weight_decay=0.0",
    "eval_every=0",
    "max_steps=2",
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
    # Through the CLI: its pre-flight check names the key, before the trainer starts.
    code = main(["train", *_args(tiny_model_dir, out, "r"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert re.search(r"config error: output_dir=.*a-file/runs: .*a-file is a file", err), err
    code = main(["train", *_args("/no/such/model", out, "r"), "--no-progress"])
    assert code == 2 and "model=/no/such/model: no such folder" in capsys.readouterr().err


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


def _field_types(cls=None, prefix: str = "") -> dict:
    """Dotted key -> annotated type of every config field."""
    cls = cls or TrainConfig
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(_field_types(tp, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = tp
    return out


def _typed(tp) -> st.SearchStrategy:
    """Values of the right type (so that validation, not parsing, must catch them)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return st.sampled_from(list(args))
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[st.none() if a is type(None) else _typed(a) for a in args])
    if origin is list:
        return st.lists(st.text(max_size=3), max_size=2)
    return {
        bool: st.booleans(),
        int: st.integers(-2, 70),
        float: st.one_of(st.floats(-2, 100), st.sampled_from([0.0, 1.0, math.nan, math.inf])),
        str: st.one_of(st.text(max_size=6), st.sampled_from(["gauss-3", "gauss-", "a/b", ""])),
    }[tp]


_TYPES = _field_types()
_typed_pairs = st.lists(
    st.sampled_from(sorted(_TYPES)).flatmap(lambda k: _typed(_TYPES[k]).map(lambda v: (k, v))),
    max_size=5,
)


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
        st.dictionaries(_keys, _values, max_size=5).map(_nest),  # wrong types, unknown keys
        _typed_pairs.map(dict).map(_nest),  # well typed: contradictions between fields
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
        ("sudoku", None, "", r"config error: data_file=.*missing.csv: no such file"),
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
    # A missing file: the CLI's pre-flight; a malformed one: the trainer, before the model.
    assert err.startswith(("error: cannot read data_file=", "config error: data_file=")), err
    assert re.search(message, err), err


def test_prompts_longer_than_the_model_reads(tiny_model_dir, tmp_path):
    """33-token prompts for a model that reads 20 prompt tokens (36 positions less the 16 of
    the completion): an error naming the prompt, or, with truncate_prompts, their last 20
    tokens, counted in the metrics."""
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
    assert prompt_limit(bundle, 16) == 20 and prompt_limit(bundle, 30) == 6
    padded, mask = pad_prompts(bundle, ids)  # left padded to the longest prompt
    assert padded.shape == (2, 3) and mask.sum(1).tolist() == [3, 2]
    assert padded[0].tolist() == [3, 4, 5] and padded[1, -2:].tolist() == [6, 7]
    bundle.prompt_width = 20  # a model with absolute positions: one fixed width
    assert prompt_limit(bundle, 16) == 20
    padded, mask = pad_prompts(bundle, ids)
    assert padded.shape == (2, 20) and mask.sum(1).tolist() == [3, 2]
    with pytest.raises(ValueError, match=r"prompt 1 'abc' has 2 tokens, more than the 1"):
        fit_prompts([[1], [1, 2]], 1, truncate=False, texts=["a", "abc"])


def test_empty_completions_train_without_nan(tiny_model_dir, tmp_path):
    """A model that only ever writes end-of-sequence: every completion is empty text."""
    trainer = Trainer(_cfg(tiny_model_dir, tmp_path, "empty", "task=seen"), progress=False)
    model = trainer.acc.unwrap_model(trainer.model)
    eos = trainer.bundle.eos_ids[0]
    eos_bias = torch.zeros(model.config.vocab_size)
    eos_bias[eos] = 1e4
    model.lm_head.register_forward_hook(lambda module, args, out: out + eos_bias)
    SEEN.clear()
    trainer.train()
    assert SEEN and set(SEEN) == {""}
    assert all(_finite(h) for h in trainer.history)
    assert [h["reward"] for h in trainer.history] == [0.0, 0.0]


@pytest.mark.parametrize(
    "overrides",
    [
        ["method=wd1", "scale_rewards=group"],
        ["method=diffu_grpo", "num_iterations=2", "sml.enabled=true"],
        ["method=gdpo", "scale_rewards=group"],
    ],
    ids=["wd1-scaled", "diffu_grpo-sml-mu2", "gdpo-scaled"],
)
def test_groups_with_equal_rewards_give_zero_advantages_and_no_nan(
    tiny_model_dir, tmp_path, overrides
):
    """Every completion scores 0.5: all advantages are 0, nothing is NaN (the group std of 0
    is not divided by), and the update leaves the weights exactly as they were (wd1's SML term
    would not: it does not depend on the advantages)."""
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
    cfg = _cfg(tiny_model_dir, tmp_path, "nan1", "max_steps=3", "method=diffu_grpo", "task=varied")
    trainer = Trainer(cfg, progress=False)
    _poison(trainer, float("nan"), steps={1})
    snapshots = [_params(trainer)]
    for _ in range(3):
        trainer.history.append(trainer.train_step())
        snapshots.append(_params(trainer))
    assert [h["nonfinite_skipped"] for h in trainer.history] == [0.0, 1.0, 0.0]
    assert math.isnan(trainer.history[1]["loss"])
    assert not _same(snapshots[0], snapshots[1])
    assert _same(snapshots[1], snapshots[2])  # the NaN step changed nothing
    assert not _same(snapshots[2], snapshots[3])  # and training went on
    assert all(torch.isfinite(v).all() for v in snapshots[3].values())


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
            score_rewards(
                [_hangs], [1.0], ["p"] * 2, ["a", "b"], {}, on_timeout="raise", timeout=0.3
            )
        per, total, errors = score_rewards(
            [ones, _hangs], [1.0, 1.0], ["p"] * 2, ["11", "b"], {}, on_error="zero", timeout=0.3
        )
        assert per.tolist() == [[2 / 16, 0.0], [0.0, 0.0]] and errors == 2
        assert time.monotonic() - t0 < 60  # a ceiling: the hanging calls were abandoned
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
        assert time.monotonic() - t0 < 300  # a ceiling: the step did not wait on the hang
    finally:
        HANG.set()  # let the abandoned threads end


def test_a_raising_reward_function_stops_the_cli_with_its_name_and_example(
    tiny_model_dir, tmp_path, capsys
):
    def divides_by_zero(prompts, completions, **kw):
        return [1 / 0 for _ in completions]

    register_task("raises", lambda: sudoku_rows_task("raises", divides_by_zero, score=ones))
    code = main(
        ["train", *_args(tiny_model_dir, tmp_path, "raise", "task=raises"), "--no-progress"]
    )
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert re.search(r"error: reward function divides_by_zero failed on example 0 \(prompt '", err)
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
    args = _args(tiny_model_dir, tmp_path, "ddp", "task=ones_rank1_fails", "max_steps=4")
    t0 = time.monotonic()
    code, log = launch_two(
        WORKER,
        ["train", *args, "--no-progress"],
        timeout=600,
        env={"TMPDIR": str(tmp), marker: "1"},
    )
    took = time.monotonic() - t0
    assert code != 0
    assert "error: reward function ones failed on example 0" in log
    assert "injected failure on rank 1" in log
    deadline = time.monotonic() + 60  # the launcher is gone; its ranks end right after
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker) == []
    # torchrun keeps its own logs (torchelastic_*) and torch its compile cache; nothing else.
    left = [p.name for p in tmp.iterdir() if not p.name.startswith(("torchelastic_", "torch"))]
    assert left == []
    print(f"2 ranks, error on rank 1: both ended after {took:.1f} s (launch included)")


# ---------------------------------------------------------------------------------- load
# Hostile programs, each with the verdict reason the sandbox must give it. None: the program
# itself may pass (its harm comes later, e.g. a daemon), or only the bounds are checked.
_HOSTILE = [
    ("while True:\n    pass", r"timed out"),  # busy forever: the wall-time limit
    ("import time\ntime.sleep(60)", r"timed out"),  # idle forever
    ("import os\nwhile True:\n    os.fork()", r"BlockingIOError|timed out|killed"),  # fork bomb
    ("x = bytearray(1 << 34)", r"MemoryError|killed"),  # 16 GiB
    ("open({sentinel!r}, 'w').write('escaped')", r"Read-only file system|Permission|No such file"),
    ("import os\nos.remove({sentinel!r})", r"Read-only file system|Permission|No such file"),
    (
        "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).send(b'x')",
        r"ConnectionRefused|PermissionError|unreachable",
    ),
    (  # a daemon that outlives the program, then writes outside
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3)\n"
        "    open({sentinel!r}, 'w').write('daemon')",
        None,
    ),
    ("import os, signal\nos.kill({pid}, signal.SIGKILL)", r"ProcessLookupError|Permission"),
    ("import sys\nsys.stdout.write('x' * (1 << 26))\nsys.exit(0)", r"File too large|checks"),
]


def test_200_malicious_programs_in_the_sandbox_while_a_step_trains(tiny_model_dir, tmp_path):
    """200 hostile programs (10 kinds) scored 8 at a time while a training step runs in a
    thread: the step finishes, every program gets its bounded verdict, nothing escapes
    (a file outside, a listening socket, our own process), nothing is left running, and
    every run's temporary folder is removed."""
    from daca.tasks import sandbox

    isolation = sandbox.isolation_available()
    # Without bubblewrap and without root the sandbox runs as our own uid: it cannot protect
    # our files or catch a daemon (daca.tasks.sandbox says so). Then only the bounds are checked.
    strong = isolation == "bwrap" or os.geteuid() == 0
    sentinel = Path("/var/tmp") / f"daca-sentinel-{uuid.uuid4().hex}"
    sentinel.write_text("intact")
    sentinel.chmod(0o644)
    # The sandbox's folders go here (reachable by the sandbox uid), to see that none is left.
    scratch = Path(tempfile.mkdtemp(prefix="daca-load-"))
    scratch.chmod(0o755)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    values = {"sentinel": str(sentinel), "port": listener.getsockname()[1], "pid": os.getpid()}
    kinds = [
        (f"# program {i}\n" + code.format(**values), reason)
        for i in range(200)
        for code, reason in [_HOSTILE[i % len(_HOSTILE)]]
    ]
    trainer = Trainer(_cfg(tiny_model_dir, tmp_path, "load", "task=varied"), progress=False)
    stats = []
    try:
        step = threading.Thread(target=lambda: stats.append(trainer.train_step()))
        t0 = time.monotonic()
        step.start()
        with _tempdir(scratch):
            results = sandbox.run_many(
                [code for code, _ in kinds],
                [["assert True"]] * len(kinds),
                workers=8,
                timeout=1.0,
                memory_mb=256,
                max_procs=8,
                max_file_mb=1,
                scratch_mb=4,
            )
        took = time.monotonic() - t0
        step.join(600)
        assert not step.is_alive() and stats and _finite(stats[0])
        assert took < 600  # a ceiling: every program was stopped at its timeout
        assert len(results) == 200
        for (code, reason), r in zip(kinds, results, strict=True):
            assert "start" not in r.reason, r  # the sandbox itself worked
            if reason is not None and (strong or "sentinel" not in code):
                said = r.reason + "\n" + r.stderr_tail  # a fork bomb's children talk too
                assert not r.passed and re.search(reason, said), (code, said)
        assert list(scratch.iterdir()) == []  # every run's folder removed
        if strong:
            time.sleep(3.5)  # an escaped daemon would have written by now
            assert sentinel.read_text() == "intact"
            with pytest.raises(TimeoutError):
                listener.accept()  # nobody connected
            if os.geteuid() == 0:  # the sandbox's own uids: nothing of theirs still runs
                # (polled: on a loaded machine, or beside another suite's sandbox runs, a
                # killed task can take seconds to leave the process table)
                deadline = time.monotonic() + 60
                while _sandbox_tasks() and time.monotonic() < deadline:
                    time.sleep(0.5)
                assert _sandbox_tasks() == []
        print(f"200 malicious programs ({isolation}) beside a training step: {took:.1f} s")
    finally:
        listener.close()
        sentinel.unlink(missing_ok=True)
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _tempdir(path: Path):
    """tempfile's folder set to ``path`` for the duration."""
    saved = tempfile.tempdir
    tempfile.tempdir = str(path)
    try:
        yield
    finally:
        tempfile.tempdir = saved


def _sandbox_tasks() -> list[str]:
    """Processes of the sandbox's uids that still run (zombies await their reaper only), with
    their state and command line for the failure message."""
    found = []
    for pid in os.listdir("/proc"):
        if _uid_of(pid) in range(40000, 60000):
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:80]
            except OSError:
                continue
            if state != "Z":
                found.append(f"{pid} {state} {command.decode(errors='replace')}")
    return found


def _uid_of(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1
