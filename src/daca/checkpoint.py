"""Checkpoints that are complete or absent: written to a temporary folder, then renamed.

A checkpoint is a folder ``checkpoints/step-NNNNNNN`` holding a ``COMPLETE`` marker, written
last. Every change of such a folder is a rename: a new one is written as ``step-N.tmp`` and
renamed into place; an old one is renamed to ``step-N.old`` before it is deleted. A crash (even
``kill -9``) at any point therefore leaves each ``step-N`` complete or absent; ``recover``
finishes or removes what an interrupted write left behind.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

_NAME = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^step-(\d+)\.(tmp|old)$")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:07d}"


def temporary_dir(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before it is complete."""
    final = checkpoint_dir(run_dir, step)
    return final.with_name(final.name + ".tmp")


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (temporary folders are ignored), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and (p / "COMPLETE").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def recover(run_dir: Path) -> None:
    """Clean up after a crash: a complete ``step-N.tmp`` or ``step-N.old`` whose ``step-N`` is
    missing (the crash fell between two renames) takes its place; other leftovers are deleted.
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return
    # .tmp before .old: when both are complete, the .tmp is the newer write of the step.
    for p in sorted(root.iterdir(), key=lambda p: (p.name.endswith(".old"), p.name)):
        m = _LEFTOVER.match(p.name)
        if not m:
            continue
        final = root / f"step-{m.group(1)}"
        if (p / "COMPLETE").is_file() and not final.exists():
            os.replace(p, final)
        else:
            shutil.rmtree(p, ignore_errors=True)


def begin(run_dir: Path, step: int) -> Path:
    """An empty temporary folder for the checkpoint of ``step`` (after ``recover``)."""
    recover(run_dir)
    tmp = temporary_dir(run_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(run_dir: Path, step: int, keep: int) -> Path:
    """Mark the temporary folder of ``step`` complete, rename it into place, prune to ``keep``."""
    final, tmp = checkpoint_dir(run_dir, step), temporary_dir(run_dir, step)
    (tmp / "COMPLETE").write_text(f"{step}\n")
    _fsync_tree(tmp)
    if final.exists():  # the same step again: the old one moves aside (recover handles a crash)
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        _discard(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)
    for _, old in list_checkpoints(run_dir)[:-keep]:
        _discard(old)
    return final


def discard_temporary(run_dir: Path, step: int) -> None:
    """Remove the temporary folder of a checkpoint write that failed."""
    shutil.rmtree(temporary_dir(run_dir, step), ignore_errors=True)


def write_atomically(run_dir: Path, step: int, write, keep: int) -> Path:
    """Call ``write(tmp_dir)``, mark it complete, rename it into place, prune to ``keep``.

    A crash at any point leaves the previous checkpoints alone and the new one complete or
    absent. If ``write`` raises, the temporary folder is removed and the error propagates.
    """
    tmp = begin(run_dir, step)
    try:
        write(tmp)
    except BaseException:
        discard_temporary(run_dir, step)
        raise
    return commit(run_dir, step, keep)


def _discard(path: Path) -> None:
    """Delete a checkpoint: renamed first, its marker removed, so no crash leaves it half
    deleted under its own name (``recover`` deletes what a crash leaves)."""
    old = path if path.name.endswith(".old") else path.with_name(path.name + ".old")
    if old != path:
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    (old / "COMPLETE").unlink(missing_ok=True)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(path: Path) -> None:
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(folder))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
