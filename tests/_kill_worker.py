"""``daca train`` in a subprocess, for the kill-and-resume and multi-process tests.

Usage: python tests/_kill_worker.py train key=value ... [--resume RUN_DIR]
       (or under ``accelerate launch``). Same as ``python -m daca.cli``, plus:

- the tasks "ones" (reward: the share of '1' characters, which a random model can move) and
  "ones_rank1_fails" (the same, but the reward raises on rank 1 from the second rollout on);
- with DACA_PHASES=1, a line ``PHASE <name> <step>`` on stdout when a phase starts (rollout,
  update, ckpt = a checkpoint write, saved = its end), and each phase widened by DACA_SLOW
  seconds in its middle (between generation and rewards, between a loss and its backward, and
  between the two halves of each checkpoint file written with torch.save), so that a kill at
  a random moment after the line lands inside the phase;
- with DACA_NAN_STEP=k (and DACA_NAN_RANK=r, default 0), a NaN loss at step k on rank r;
- with DACA_OOM_STEP=k (and DACA_OOM_RANK=r, default 1), an out-of-memory error there;
- under an FSDP launch config, FSDP2 on CPU processes (see ``_fsdp_on_cpu``).
"""

import io
import os
import sys
import time

import torch
from _tasks import ones as share_of_ones
from _tasks import sudoku_rows_task  # this folder is on sys.path: a script here

import daca.train.rollout
from daca.cli import main
from daca.tasks import Task, register_task
from daca.train import checkpointing as checkpoint
from daca.train.trainer import Trainer


def _ones_failing_on_rank1() -> Task:
    """The "ones" task whose reward raises on rank 1 after its first call."""
    calls = []

    def ones(prompts, completions, **kw):  # the name the error message must report
        calls.append(1)
        if os.environ.get("RANK") == "1" and len(calls) > 1:
            raise RuntimeError("injected failure on rank 1")
        return share_of_ones(prompts, completions)

    return sudoku_rows_task("ones", ones, score=share_of_ones)


def _phase(name: str, step: int) -> None:
    # One write per line: both ranks share the pipe, and print() writes the newline separately,
    # so two ranks' lines could interleave ("PHASE update 2PHASE update 2\n\n").
    sys.stdout.write(f"PHASE {name} {step}\n")
    sys.stdout.flush()


def _install_phase_hooks(slow: float) -> None:
    make_rollout, loss, begin, commit = (
        Trainer._make_rollout,
        Trainer._loss,
        checkpoint.begin,
        checkpoint.commit,
    )

    score_rewards = daca.train.rollout.score_rewards

    def hooked_rollout(self, step, micro):
        _phase("rollout", step)
        return make_rollout(self, step, micro)

    def slow_rewards(*args, **kwargs):
        time.sleep(slow)
        return score_rewards(*args, **kwargs)

    def hooked_loss(self, batch, it, seed):
        _phase("update", self.step)
        out = loss(self, batch, it, seed)
        time.sleep(slow)
        return out

    def hooked_begin(run_dir, step):
        _phase("ckpt", step)
        return begin(run_dir, step)

    def hooked_commit(run_dir, step, keep):
        out = commit(run_dir, step, keep)
        _phase("saved", step)
        return out

    save = torch.save

    def torn_save(obj, f, *args, **kwargs):
        """Checkpoint files are written in two halves with a pause: a kill tears them."""
        if not isinstance(f, str | os.PathLike) or ".tmp" not in str(f):
            return save(obj, f, *args, **kwargs)
        buf = io.BytesIO()
        save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        with open(f, "wb") as fh:
            fh.write(data[: len(data) // 2])
            fh.flush()
            time.sleep(slow)
            fh.write(data[len(data) // 2 :])

    Trainer._make_rollout, Trainer._loss = hooked_rollout, hooked_loss
    daca.train.rollout.score_rewards = slow_rewards
    checkpoint.begin, checkpoint.commit = hooked_begin, hooked_commit
    torch.save = torn_save


def _nan_loss_at(step: int, rank: str) -> None:
    """The loss of every micro-batch of training step ``step`` (0-based) is NaN on ``rank``
    only: the other rank must skip the update too."""
    loss = Trainer._loss

    def nan_loss(self, batch, it, seed):
        value, metrics = loss(self, batch, it, seed)
        if self.step == step and os.environ.get("RANK") == rank:
            value = value + float("nan")
        return value, metrics

    Trainer._loss = nan_loss


def _out_of_memory_at(step: int, rank: str) -> None:
    """Training step ``step`` (0-based) runs out of memory on ``rank`` in its first loss, the
    way CUDA reports it, while the other rank goes on into the next collective."""
    loss = Trainer._loss

    def oom_loss(self, batch, it, seed):
        if self.step == step and os.environ.get("RANK") == rank:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return loss(self, batch, it, seed)

    Trainer._loss = oom_loss


def _fsdp_on_cpu() -> None:
    """Let ``accelerate launch`` with an FSDP config run FSDP2 on CPU processes (gloo).

    Accelerate upgrades a multi-GPU launch to FSDP but never a multi-CPU one, although FSDP2's
    ``fully_shard`` runs on CPU with gloo: here the upgrade is made for CPU too, so that the
    trainer goes through accelerate's FSDP paths (sharded DTensor parameters, gathered state
    dicts, ``save_state``/``load_state`` of a sharded model and optimizer) on this machine.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def init_with_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init_with_fsdp


if __name__ == "__main__":
    torch.set_num_threads(1)
    if os.environ.get("ACCELERATE_USE_FSDP") == "true":
        _fsdp_on_cpu()
    register_task("ones", lambda: sudoku_rows_task("ones"))
    register_task("ones_rank1_fails", _ones_failing_on_rank1)
    if os.environ.get("DACA_PHASES") == "1":
        _install_phase_hooks(float(os.environ.get("DACA_SLOW", "0.2")))
    if "DACA_OOM_STEP" in os.environ:
        _out_of_memory_at(int(os.environ["DACA_OOM_STEP"]), os.environ.get("DACA_OOM_RANK", "1"))
    if "DACA_NAN_STEP" in os.environ:
        _nan_loss_at(int(os.environ["DACA_NAN_STEP"]), os.environ.get("DACA_NAN_RANK", "0"))
    sys.exit(main(sys.argv[1:]))
