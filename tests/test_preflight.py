"""Bad input to ``daca eval``, ``daca sample`` and ``daca train`` is found before any model
weights load: one line naming the flag (or config key) and the fix, exit code 2, no traceback.
The loader is replaced by one that fails the test if called."""

import json

import pytest

import daca.models.loading
import daca.train.trainer
from daca.cli import main
from daca.tasks import sandbox


@pytest.fixture
def no_loading(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the model (or the trainer) was started before the input check")

    monkeypatch.setattr(daca.models.loading, "load", must_not_run)
    monkeypatch.setattr(daca.train.trainer, "train", must_not_run)


def one_line_error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(("error: ", "config error: ")), err  # train: a config value
    return lines[0]


@pytest.fixture
def binary_file(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(bytes(range(128, 256)) * 4)
    return path


@pytest.fixture
def model_folder(tmp_path):
    """A folder that passes for a model until its weights would load."""
    folder = tmp_path / "some-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("command", ["eval", "sample"])
def test_a_missing_model_folder_is_no_such_folder(no_loading, capsys, command):
    line = one_line_error(capsys, [command, "--task", "sudoku", "--model", "/nope"])
    assert "--model /nope: no such folder" in line and "Repo id" not in line


def test_a_model_given_as_a_file_or_an_empty_folder(no_loading, capsys, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    line = one_line_error(capsys, ["eval", "--task", "sudoku", "--model", str(tmp_path)])
    assert f"--model {tmp_path}" in line and "no config.json" in line
    file = str(tmp_path / "weights.bin")
    line = one_line_error(capsys, ["eval", "--task", "sudoku", "--model", file])
    assert f"--model {file} is a file" in line


def test_an_uncached_hub_model_offline_is_named(no_loading, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    line = one_line_error(capsys, ["eval", "--task", "sudoku", "--model", "nobody/no-such-xyz"])
    assert "--model nobody/no-such-xyz" in line and "not in the local cache" in line


def test_an_unknown_task_is_found_before_loading(no_loading, capsys):
    line = one_line_error(capsys, ["eval", "--task", "sodoku"])
    assert "--task sodoku: unknown task" in line and "sudoku" in line


def test_a_task_the_tiny_model_does_not_do(no_loading, capsys):
    line = one_line_error(capsys, ["eval", "--task", "gsm8k"])
    assert "--model tiny" in line and "gsm8k" in line


def test_offline_without_data_file_names_the_flag(no_loading, capsys, monkeypatch, model_folder):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    line = one_line_error(capsys, ["eval", "--task", "mbpp", "--model", str(model_folder)])
    assert "--task mbpp" in line and "--data-file FILE" in line and "path=" not in line


@pytest.mark.parametrize("task", ["sudoku", "countdown"])
def test_a_binary_data_file_is_named(no_loading, capsys, binary_file, task):
    argv = ["eval", "--task", task, "--data-file", str(binary_file)]
    line = one_line_error(capsys, argv)
    assert f"--data-file {binary_file}" in line and "not a UTF-8 text file" in line


def test_a_missing_or_bad_data_file_is_found_before_loading(no_loading, capsys, tmp_path):
    line = one_line_error(capsys, ["sample", "--task", "countdown", "--data-file", "/nope.jsonl"])
    assert "--data-file /nope.jsonl: no such file" in line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nums": [1, 2], "target": 3}\n')
    line = one_line_error(capsys, ["eval", "--task", "countdown", "--data-file", str(bad)])
    assert f"--data-file {bad}, line 1: missing key" in line


def test_an_unwritable_out_is_found_before_loading(no_loading, capsys, tmp_path):
    out = tmp_path / "missing" / "out.jsonl"
    line = one_line_error(capsys, ["eval", "--task", "sudoku", "--out", str(out)])
    assert f"--out {out}: no such folder" in line


def test_no_sandbox_stops_a_code_task_before_loading(
    no_loading, capsys, monkeypatch, tmp_path, model_folder
):
    def unavailable():
        raise sandbox.SandboxUnavailable("no working isolation here (test)")

    monkeypatch.setattr(sandbox, "isolation_available", unavailable)
    data = tmp_path / "mbpp.json"
    data.write_text(json.dumps([{"task_id": 11, "prompt": "p", "test_list": ["assert 1"]}]))
    argv = ["eval", "--task", "mbpp", "--model", str(model_folder), "--data-file", str(data)]
    line = one_line_error(capsys, argv)
    assert "--task mbpp: no working isolation" in line


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model=/nope", "model=/nope: no such folder"),
        ("task=sodoku", "task=sodoku: unknown task"),
        ("data_file=/nope.csv", "data_file=/nope.csv: no such file"),
        ("eval_file=/nope.csv", "eval_file=/nope.csv: no such file"),
        ("task=gsm8k", "model=tiny"),
    ],
)
def test_train_checks_its_keys_before_starting(no_loading, capsys, tmp_path, override, expected):
    line = one_line_error(capsys, ["train", f"output_dir={tmp_path}", override])
    assert expected in line
    assert not any(tmp_path.iterdir())  # no run folder was made


def test_train_output_dir_under_a_file(no_loading, capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    line = one_line_error(capsys, ["train", f"output_dir={tmp_path / 'file' / 'runs'}"])
    assert "output_dir=" in line and "is a file, not a folder" in line


def test_train_reads_a_binary_data_file_before_loading(capsys, monkeypatch, tmp_path):
    """The trainer reads its data before the model (the loader is never reached)."""
    import daca.train.setup

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model loaded before the data was read")

    monkeypatch.setattr(daca.train.setup, "load", must_not_load)
    data = tmp_path / "puzzles.csv"
    data.write_bytes(bytes(range(128, 256)))
    argv = ["train", f"output_dir={tmp_path}", f"data_file={data}", "device=cpu", "--no-progress"]
    line = one_line_error(capsys, argv)
    assert f"data_file={data}" in line
