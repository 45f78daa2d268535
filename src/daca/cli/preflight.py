"""Checks a command runs before any model weights load: the task, the model's name or folder,
the data file, the output path and the code sandbox. Each failure is a ``UsageError`` whose
message is one line naming the flag (``--model``) or config key (``model=``) and the fix;
``daca`` prints it and exits 2, so an 8B model never loads for minutes to fail on a typo.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from daca.shipped import SHIPPED

# A Hugging Face repo id: "name" or "owner/name" (huggingface_hub's validate_repo_id rules).
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")


class UsageError(Exception):
    """Bad command-line input, found before any work: one line, exit code 2."""


def _named(flag: str, value) -> str:
    """``--model X`` for a flag, ``model=X`` for a config key."""
    return f"{flag}{value}" if flag.endswith("=") else f"{flag} {value}"


def check_task(name: str, flag: str = "--task"):
    """The registered task called ``name``."""
    from daca.tasks import get_task

    try:
        return get_task(name)
    except ValueError as e:
        raise UsageError(f"{_named(flag, name)}: {e}") from None


def check_model(name: str | None, flag: str = "--model", *, offline_cache: bool = True) -> None:
    """``name`` is a shipped model, a model folder, or a hub id (with ``offline_cache``: in
    the local cache when offline)."""
    name = str(name or "tiny")
    if name in SHIPPED:
        return
    path = Path(name).expanduser()
    if path.is_file():
        raise UsageError(f"{_named(flag, name)} is a file; give the model's folder")
    if path.is_dir():
        if not any((path / f).is_file() for f in ("config.json", "adapter_config.json")):
            raise UsageError(
                f"{_named(flag, name)}: the folder holds no config.json, so it is not a model "
                "folder (a run's model lies in RUN_DIR/checkpoint-N/model)"
            )
        return
    if not _looks_like_hub_id(name):
        raise UsageError(
            f"{_named(flag, name)}: no such folder (and not a hub name like owner/model); "
            f"check the path, or use {_named(flag, 'tiny')}"
        )
    if offline_cache:
        _check_offline_cache(name, flag)


def _looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and "--" not in name


def _check_offline_cache(name: str, flag: str) -> None:
    """Offline (HF_HUB_OFFLINE=1), a hub model must already be in the local cache."""
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE and not isinstance(
        try_to_load_from_cache(name, "config.json"), str
    ):
        raise UsageError(
            f"{_named(flag, name)}: no such folder, and the hub model is not in the local cache "
            "(HF_HUB_OFFLINE=1); give a local model folder, or download it with network"
        )


def check_data_file(path: str | None, flag: str = "--data-file") -> None:
    """``path`` (when given) is a readable file."""
    if path is None:
        return
    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"{_named(flag, path)}: no such file")
    if not p.is_file():
        raise UsageError(f"{_named(flag, path)} is not a file; give a file in the task's format")
    if not os.access(p, os.R_OK):
        raise UsageError(f"{_named(flag, path)}: not readable (check its permissions)")


def load_rows(
    task, *, split: str, path: str | None, limit: int | None, seed: int, flag: str, task_flag: str
):
    """The task's rows, read before the model loads; a bad or missing file is a UsageError."""
    from daca.tasks.formats import DataUnavailable

    check_data_file(path, flag)
    try:
        rows = task.load(split=split, path=path, limit=limit, seed=seed)
    except DataUnavailable as e:
        raise UsageError(
            f"{_named(task_flag, task.name)}: {e.reason}; pass a local copy with "
            f"{_named(flag, 'FILE')} (docs/usage.md#evaluation-data)"
        ) from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{_named(flag, path)}: not a UTF-8 text file ({e})") from None
    except (ValueError, OSError, KeyError) as e:
        if path and str(e).startswith(str(path)):  # the loader named the file (and line)
            raise UsageError(_named(flag, e)) from None
        where = _named(flag, path) if path else f"{_named(task_flag, task.name)} ({split} split)"
        raise UsageError(f"{where}: {e}") from None
    if not rows:
        where = _named(flag, path) if path else f"{_named(task_flag, task.name)} ({split} split)"
        raise UsageError(f"{where}: no {task.name} examples")
    return rows


def check_model_does_task(model: str | None, task, flag: str = "--model") -> None:
    """The shipped tiny models know the embedded tasks' compact prompts only."""
    if str(model or "tiny") in SHIPPED and task.compact_prompt is None:
        raise UsageError(
            f"{_named(flag, model or 'tiny')}: the shipped tiny model does not do {task.name} "
            f"(only Sudoku and Countdown); give a model folder or hub name with {flag}"
        )


def check_sandbox(task, flag: str = "--task") -> None:
    """A task that runs model-written code needs a working sandbox (bubblewrap)."""
    if not task.executes_code:
        return
    from daca.tasks.sandbox import SandboxUnavailable, isolation_available

    try:
        isolation_available()
    except SandboxUnavailable as e:
        raise UsageError(f"{_named(flag, task.name)}: {e}") from None


def check_output_file(path: str, flag: str = "--out") -> None:
    """``path``'s folder exists and is writable, and ``path`` is no folder."""
    p = Path(path).expanduser()
    folder = p.parent
    if p.is_dir():
        raise UsageError(f"{_named(flag, path)} is a folder; give a file name")
    if not folder.is_dir():
        raise UsageError(f"{_named(flag, path)}: no such folder {folder}; create it first")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{_named(flag, path)}: cannot write in {folder} (check its permissions)")


def check_output_folder(path: str, flag: str) -> None:
    """``path`` is, or can be made, a folder: its nearest existing ancestor is a writable
    folder."""
    p = Path(path).expanduser().absolute()
    existing = next(a for a in (p, *p.parents) if a.exists())
    if not existing.is_dir():
        raise UsageError(f"{_named(flag, path)}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK):
        raise UsageError(f"{_named(flag, path)}: cannot write in {existing} (check permissions)")
