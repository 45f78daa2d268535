"""Checkpoints that are complete or absent: written to a temporary folder, then renamed; and
the save and resume steps of the trainer (``CheckpointSteps``).

A checkpoint is a folder ``checkpoints/step-NNNNNNN`` holding a ``COMPLETE`` marker, written
last. Every change of such a folder is a rename: a new one is written as ``step-N.tmp`` and
renamed into place; an old one is renamed to ``step-N.old`` before it is deleted. A crash (even
``kill -9``) at any point therefore leaves each ``step-N`` complete or absent; ``recover``
finishes or removes what an interrupted write left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from daca.models.loading import save_pretrained
from daca.train.errors import TrainingError

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


class CheckpointSteps:
    """Save and resume of ``Trainer`` (a mixin: it reads the trainer's ``acc``, ``model``,
    ``bundle``, ``run_dir``, ``cfg``, ``step``, ``history`` and ``evals``)."""

    def save(self) -> None:
        """Write the checkpoint of this step, complete or not at all (``daca.train.checkpointing``).

        ``state/`` holds accelerate's full training state, which ``--resume`` restores: the
        model, optimizer and scheduler (sharded as the backend shards them: FSDP, DeepSpeed
        ZeRO) and every rank's RNG. ``model/`` holds the weights for ``daca eval``,
        ``trainer_state.pt`` the step and the logs. A failed write (a full disk, a model that
        cannot be saved, any error) removes the partial folder, keeps the previous checkpoints
        and stops the run on every rank with a TrainingError naming the cause.
        """
        step, main = self.step, self.acc.is_main_process
        self.acc.wait_for_everyone()
        latest = latest_checkpoint(self.run_dir)
        if latest is not None and latest[0] == step:
            return  # resumed from this very checkpoint: nothing new to write
        tmp = temporary_dir(self.run_dir, step)
        error = None
        if main:
            try:
                begin(self.run_dir, step)
            except Exception as e:
                error = e
        if not self._anywhere(error is not None):
            try:
                self._write_checkpoint(tmp)
            except Exception as e:
                error = e
        if not self._anywhere(error is not None) and main:
            try:
                commit(self.run_dir, step, keep=self.cfg.save_total_limit)
            except Exception as e:
                error = e
        if self._anywhere(error is not None):
            if main:
                discard_temporary(self.run_dir, step)
            raise TrainingError(save_failed_message(self.run_dir, step, latest, error)) from error
        self.acc.wait_for_everyone()

    def _write_checkpoint(self, tmp: Path) -> None:
        """Every rank writes its part of ``state/`` (its shards, its RNG) and takes part in
        gathering the full weights (FSDP); the main process writes the rest."""
        self.acc.save_state(str(tmp / "state"))
        weights = self.acc.get_state_dict(self.model)
        if self.acc.is_main_process:
            weights = own_storage(weights)
            # A complete model (hub layout or LoRA adapter, tokenizer, daca.json) that
            # `daca eval`, `daca sample` and `daca.models.load` accept as it is.
            model = self.acc.unwrap_model(self.model)
            save_pretrained(self.bundle, tmp / "model", model, state_dict=weights)
            state = {"step": self.step, "history": self.history, "evals": self.evals}
            torch.save(state, tmp / "trainer_state.pt")

    def _register_state_hooks(self) -> None:
        """Under LoRA, ``state/`` holds the trainable weights only: the frozen base is the base
        model, loaded anew, so a checkpoint of an 8B model stays the adapter's size. (FSDP and
        DeepSpeed write their model files themselves.)"""
        from accelerate.utils import DistributedType

        sharded = (DistributedType.FSDP, DistributedType.DEEPSPEED)
        if self.cfg.lora.enabled and self.acc.distributed_type not in sharded:
            self.acc.register_save_state_pre_hook(keep_trainable)
            self.acc.register_load_state_pre_hook(load_trainable)

    def _resume(self) -> None:
        """Continue from the latest complete checkpoint; none yet (a run stopped before its
        first one): start over. Nothing the run wrote is deleted: what lies past the
        checkpoint (log lines, recorded rollouts), or every earlier file when starting over,
        moves to ``set-aside/N/`` in the run folder (``set_aside``), and a line says so."""
        if self.acc.is_main_process:
            recover(self.run_dir)
        self.acc.wait_for_everyone()
        found = latest_checkpoint(self.run_dir)
        if found is not None:
            step, folder = found
            if not (folder / "state").is_dir():
                raise TrainingError(
                    f"{folder} holds no state/ folder (written by an older daca): it cannot be "
                    f"resumed exactly. Start a new run from its weights with "
                    f"model={folder / 'model'}"
                )
            state = torch.load(folder / "trainer_state.pt", weights_only=False)
            # Weights, optimizer, scheduler and this rank's RNG, as each backend saved them.
            self.acc.load_state(str(folder / "state"))
            self.step, self.history, self.evals = state["step"], state["history"], state["evals"]
            self.nonfinite_total = int(sum(h.get("nonfinite_skipped", 0) for h in self.history))
        if self.acc.is_main_process:
            moved = set_aside(self.run_dir, self.step if found else None)
            if found:
                print(f"resuming {self.run_dir} from step {self.step}")
                if moved:
                    print(f"what the run wrote past step {self.step} is kept in {moved}")
            else:
                kept = f": its earlier files are kept in {moved}" if moved else ""
                print(f"{self.run_dir} has no complete checkpoint yet; starting it over{kept}")
        self.acc.wait_for_everyone()


def save_failed_message(run_dir: Path, step: int, latest, error: BaseException | None) -> str:
    """What a failed checkpoint write says: the cause, what is intact, how to go on."""
    folder = Path(run_dir) / "checkpoints"
    if error is None:
        cause = "it failed on another process"
    elif isinstance(error, OSError) and error.strerror:
        cause = error.strerror
    else:
        cause = f"{type(error).__name__}: {error}"
    kept = f"the previous checkpoint {latest[1]} is intact" if latest else "none existed"
    fix = (
        f"Free space in {folder} (or lower save_total_limit, or move output_dir to a larger disk)"
        if isinstance(error, OSError)
        else "Fix the cause"
    )
    return (
        f"could not write the checkpoint of step {step} to {folder} ({cause}); the partial "
        f"folder was removed and {kept}. {fix}, then continue with "
        f"`daca train --resume {run_dir}`"
    )


def own_storage(weights: dict) -> dict:
    """The weights, each tensor owning its storage: a gathered FSDP shard can be a view into
    a padded buffer, which safetensors refuses to save."""
    return {
        k: v if v.untyped_storage().nbytes() == v.nbytes else v.clone() for k, v in weights.items()
    }


def keep_trainable(models, weights, output_dir) -> None:
    """accelerate's save_state hook: only the trainable weights go into ``state/``."""
    for model, state in zip(models, weights, strict=True):
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        for key in [k for k in state if k not in trainable]:
            del state[key]


def load_trainable(models, input_dir) -> None:
    """accelerate's load_state hook: load the trainable weights ``keep_trainable`` saved
    (every one of them must be there), then leave the optimizer, scheduler and RNG to it."""
    from accelerate.utils import SAFE_WEIGHTS_NAME
    from safetensors.torch import load_file

    for i, model in enumerate(models):
        path = Path(input_dir) / SAFE_WEIGHTS_NAME.replace(".", f"_{i}." if i else ".", 1)
        missing, unexpected = model.load_state_dict(load_file(path), strict=False)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        lost = sorted(trainable & set(missing))
        if lost or unexpected:
            raise RuntimeError(f"{path}: missing {lost[:5]}, unexpected {unexpected[:5]}")
    models.clear()  # loaded: accelerate must not load them again (strictly)


# What a run folder keeps across a start-over: its recipe, its checkpoints' folder (empty or
# leftovers only, when there is no complete checkpoint) and what earlier resumes set aside.
_KEPT_ON_RESTART = {"config.yaml", "checkpoints", "set-aside"}


def set_aside(run_dir: Path, step: int | None) -> Path | None:
    """Move what a resume from ``step`` would overwrite into a new ``set-aside/N/`` of the run
    folder; returns it, or None when nothing had to move.

    ``step`` None (no checkpoint: the run starts over): every file but ``config.yaml``.
    Otherwise the lines of ``metrics.jsonl`` and ``evals.jsonl`` past ``step`` (or torn by a
    crash) and the recorded rollouts past it; the lines up to ``step`` stay where they are.
    """
    run_dir = Path(run_dir)
    folder = _next_set_aside(run_dir)
    moved = False
    if step is None:
        for p in sorted(run_dir.iterdir()):
            if p.name not in _KEPT_ON_RESTART and not p.name.startswith("."):
                folder.mkdir(parents=True, exist_ok=True)
                os.replace(p, folder / p.name)
                moved = True
        return folder if moved else None
    for name in ("metrics.jsonl", "evals.jsonl"):
        path = run_dir / name
        if not path.is_file():
            continue
        kept, past = _split_lines(path.read_text(), step)
        if past:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(past)
            write_text_atomically(path, kept)
            moved = True
    rollouts = run_dir / "rollouts"
    later = [p for p in rollouts.glob("step-*.json") if _step_of(p.stem) > step]
    for p in later:
        (folder / "rollouts").mkdir(parents=True, exist_ok=True)
        os.replace(p, folder / "rollouts" / p.name)
        moved = True
    return folder if moved else None


def _next_set_aside(run_dir: Path) -> Path:
    root = run_dir / "set-aside"
    taken = [int(p.name) for p in root.iterdir() if p.name.isdigit()] if root.is_dir() else []
    return root / str(max(taken, default=0) + 1)


def _split_lines(text: str, step: int) -> tuple[str, str]:
    """The JSON lines of steps up to ``step``, and the others (later steps, torn lines)."""
    kept, past = [], []
    for line in text.splitlines(keepends=True):
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            row_step = None
        fits = isinstance(row_step, int) and row_step <= step and line.endswith("\n")
        (kept if fits else past).append(line)
    return "".join(kept), "".join(past)


def _step_of(stem: str) -> int:
    try:
        return int(stem.split("-")[1])
    except (IndexError, ValueError):
        return -1


def write_text_atomically(path: Path, text: str) -> None:
    """Replace a file atomically: a crash leaves the old or the new text, never a torn one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def yaml_text(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)
