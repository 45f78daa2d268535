"""The GRPO trainer for masked diffusion LMs: the base methods of ``daca.train.methods`` with the
DACA plug-in.

One step = one rollout of ``per_device_train_batch_size × gradient_accumulation_steps``
completions per process, scored and turned into group advantages, then DPS multipliers over
all of the step's trajectories (every micro-batch, every process), then ``num_iterations`` (μ)
optimizer updates on it, each accumulating gradients over the micro-batches. Every random draw
comes from a generator seeded by (seed, step, rank, ...), so a run resumed from a checkpoint
continues exactly. METHOD.md §4 is the law.
"""

from __future__ import annotations

import copy
import math
import shlex
import time
from pathlib import Path

import torch

from daca.models.prompts import prompt_limit
from daca.tasks import get_task
from daca.tasks.credit_labels import has_graded_units
from daca.train.checkpointing import (
    CheckpointSteps,
    latest_checkpoint,
)
from daca.train.config import TrainConfig, resolved, validate
from daca.train.errors import InputError, TrainingError
from daca.train.evaluation import score_rows
from daca.train.interrupts import Interrupted, StopSignals, signal_name
from daca.train.methods import METHODS
from daca.train.rollout import RolloutSteps
from daca.train.seeds import step_mask_seeds
from daca.train.setup import SetupSteps
from daca.train.update import UpdateSteps

# How long a process whose peer failed waits for the launcher to end it before it reports the
# broken collective itself (launched without torchrun, nothing else would end it).
_PEER_GRACE_S = 30.0

# Per-step counts: summed over micro-batches and processes (other numbers are averaged).
_COUNTS = ("prompts_truncated",)


class Trainer(SetupSteps, RolloutSteps, UpdateSteps, CheckpointSteps):
    """``Trainer(config).train()`` runs the configured RL job; ``daca train`` calls it.

    One class; its setup (``daca.train.setup``), rollout (``daca.train.rollout``), update
    (``daca.train.update``) and checkpoint (``daca.train.checkpointing``) parts live beside it
    as mixins."""

    def __init__(self, config: TrainConfig, *, resume: bool = False, progress: bool = True):
        from accelerate import Accelerator
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        config = resolved(config)
        self.cfg = config
        self.method = METHODS[config.method]
        cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
        # One scheduler step per optimizer step (accelerate's default steps it once per
        # process); accumulate() skips the all-reduce (and DeepSpeed's step) between micro-batches.
        self.acc = Accelerator(
            cpu=cpu,
            mixed_precision="bf16" if config.bf16 else "no",
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            step_scheduler_with_optimizer=False,
        )
        validate(config, self.acc.num_processes)
        self.rank, self.world = self.acc.process_index, self.acc.num_processes
        self.run_dir = Path(config.output_dir) / config.name
        self.progress = progress and self.acc.is_main_process
        self._preflight(resume)

        # The data first: a bad line is reported before minutes of model loading.
        try:
            self.task = get_task(config.task)
        except ValueError as e:
            raise InputError(f"task={config.task}: {e}") from None
        if config.dps.credit == "oracle" and not has_graded_units(self.task):
            raise InputError(
                f"dps.credit=oracle needs a task that grades its trace steps and answer cells "
                f"(sudoku-trace, countdown-trace); task={config.task} does not"
            )
        self._check_sandbox()
        self.train_rows = self._load_rows("train", config.data_file, config.train_size)
        self.eval_rows = self._load_rows("test", config.eval_file, config.eval_size)
        self.bundle = self._load_model()
        self.prompt_limit = prompt_limit(self.bundle, config.generation.gen_length)
        self._check_prompts()
        self.ref_model = None
        if config.beta > 0 and self.method.ratio and not config.lora.enabled:
            self.ref_model = copy.deepcopy(self.bundle.model).eval().requires_grad_(False)

        params = [p for p in self.bundle.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.weight_decay,
        )
        warm = max(1, config.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm)
        )
        if self.acc.state.deepspeed_plugin is not None:
            # No dataloader to infer these from; DeepSpeed clips gradients itself.
            ds = self.acc.state.deepspeed_plugin.deepspeed_config
            ds["train_micro_batch_size_per_gpu"] = config.per_device_train_batch_size
            ds["gradient_clipping"] = config.max_grad_norm
        self.model, self.optimizer, self.scheduler = self.acc.prepare(
            self.bundle.model, self.optimizer, self.scheduler
        )
        self._perm_epoch, self._perm = -1, []
        self.step = 0
        self.history: list[dict] = []
        self.evals: list[dict] = []
        self.nonfinite_total = 0  # steps skipped for a non-finite loss or gradient
        self._nonfinite_cause = ""
        self._register_state_hooks()
        if resume:
            self._resume()

    def _anywhere(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (a collective: every rank must call it)."""
        if self.world == 1:
            return flag
        t = torch.tensor([float(flag)], device=self.acc.device)
        return self.acc.reduce(t, reduction="sum").item() > 0

    # ----------------------------------------------------------------- one step

    def train_step(self) -> dict:
        cfg, step = self.cfg, self.step
        gas = cfg.gradient_accumulation_steps
        # μ updates per rollout, each with its own mask seed; wd1 reuses the rollout as well (its
        # reference code regenerates every num_iterations steps), only without an old policy.
        mu = cfg.num_iterations
        # accelerate keeps this in a process-wide singleton: another Trainer may have changed it.
        self.acc.gradient_accumulation_steps = gas
        batches, stats_list = [], []
        for micro in range(gas):
            batch, stats = self._make_rollout(step, micro)
            batches.append(batch)
            stats_list.append(stats)
        normed, dps_stats = self._dps_step(batches)
        every = cfg.save_rollouts_every
        if every and (step + 1) % every == 0 and self.acc.is_main_process:
            self._record_rollout(step + 1, batches[0], normed[0])
        for batch in batches:
            batch.rollout = None  # the trace is read: free it before the updates
        t0 = time.perf_counter()
        seeds = step_mask_seeds(cfg.seed, step, range(gas), mu, self.rank)
        self._old_and_reference(batches, seeds)
        update_stats, grad_norm, skipped = self._inner_iterations(batches, seeds, mu)
        t1 = time.perf_counter()
        stats = _mean_dicts(stats_list)
        stats.update(dps_stats)
        for k in _COUNTS:
            stats[k] = sum(s[k] for s in stats_list)
        stats.update(_mean_dicts(update_stats))
        stats["grad_norm"] = float("nan") if grad_norm is None else float(grad_norm)
        stats["nonfinite_skipped"] = float(skipped)
        stats["time_update"] = t1 - t0
        stats["lr"] = self.scheduler.get_last_lr()[0]
        if self.world > 1:
            stats = self._global_stats(stats)
        self.step += 1
        stats["step"] = self.step
        return stats

    @torch.no_grad()
    def rollout_records(self, step: int) -> list[dict]:
        """The rollouts of step ``step`` with their DPS multipliers and no update (the policy
        stays as it is): every micro-batch as one ``daca credit`` record."""
        batches = [
            self._make_rollout(step, micro)[0]
            for micro in range(self.cfg.gradient_accumulation_steps)
        ]
        normed, _ = self._dps_step(batches)
        rows = slice(0, self.cfg.per_device_train_batch_size)
        return [
            self._rollout_record(step, b, n, rows) for b, n in zip(batches, normed, strict=True)
        ]

    def _global_stats(self, stats: dict) -> dict:
        """The step's numbers over all processes (every rank logs the same): the extreme of
        ``*_min``/``*_max`` and of times (the slowest rank), the mean of the rest (equal local
        batches, so the mean of means is the global mean)."""
        keys = sorted(stats)
        local = torch.tensor([[float(stats[k]) for k in keys]], dtype=torch.float64)
        every = self.acc.gather(local.to(self.acc.device)).cpu()  # [world, K]
        out = {}
        for i, k in enumerate(keys):
            col = every[:, i]
            if k in _COUNTS:
                out[k] = col.sum().item()
            elif k.endswith("_min"):
                out[k] = col.min().item()
            elif k.endswith("_max") or k.startswith("time_"):
                out[k] = col.max().item()
            else:
                out[k] = col.mean().item()
        return out

    # ----------------------------------------------------------------- evaluation
    def evaluate(self) -> tuple[float, float]:
        """Held-out metric at temperature 0 and the half-width of its 95 % interval (normal
        approximation over the examples, as ``daca.train.evaluation.mean_ci95``), each rank
        scoring its share of the rows."""
        model = self.acc.unwrap_model(self.model)
        rows = self.eval_rows[self.rank :: self.world]
        # Pad to equal counts: a sharded model (FSDP) runs collectives in every forward.
        per_rank = -(-len(self.eval_rows) // self.world)
        padded = rows + self.eval_rows[: per_rank - len(rows)]
        cfg = self.cfg
        scores = score_rows(
            self.bundle,
            self.task,
            padded,
            cfg.generation,
            model=model,
            batch_size=cfg.eval_batch_size,
            on_error=cfg.on_reward_error,  # the guarded metric (daca.tasks.rewards)
            on_timeout=cfg.on_reward_timeout,
            timeout=cfg.reward_timeout,
            limit=self.prompt_limit,
            truncate=cfg.truncate_prompts,
        ).scores
        scores = scores[: len(rows)]
        total = torch.tensor(
            [sum(scores), sum(s * s for s in scores), len(scores)], dtype=torch.float64
        )
        if self.world > 1:
            total = self.acc.reduce(total.to(self.acc.device), reduction="sum").cpu()
        n = total[2].item()
        mean = (total[0] / total[2]).item()
        var = max(0.0, (total[1].item() - n * mean * mean) / (n - 1)) if n > 1 else float("nan")
        return mean, 1.96 * math.sqrt(var / n)

    def _log_evaluation(self, logger) -> None:
        mean, ci95 = self.evaluate()
        self.evals.append({"step": self.step, "held_out": mean, "held_out_ci95": ci95})
        logger.log_eval(self.evals[-1])

    # ----------------------------------------------------------------- the loop
    def _stop_if_nonfinite(self) -> None:
        """After max_nonfinite_steps skipped steps in a row, stop with the diagnosis."""
        n = 0
        for h in reversed(self.history):
            if not h.get("nonfinite_skipped"):
                break
            n += 1
        if n < self.cfg.max_nonfinite_steps:
            return
        latest = latest_checkpoint(self.run_dir)
        where = f"The last checkpoint is {latest[1]}" if latest else "No checkpoint was written"
        raise TrainingError(
            f"{n} steps in a row ({self.step - n + 1} to {self.step}) had {self._nonfinite_cause}"
            f"; each was skipped, and max_nonfinite_steps={self.cfg.max_nonfinite_steps} stops "
            f"the run. {where}; after the fix, continue with `daca train --resume {self.run_dir}`"
        )

    def _out_of_memory(self, error: BaseException) -> str:
        """What to change after a step ran out of memory (the other ranks are ended by the
        launcher when this one exits)."""
        latest = latest_checkpoint(self.run_dir)
        where = f"The last checkpoint is {latest[1]}" if latest else "No checkpoint was written"
        return (
            f"out of memory in step {self.step + 1} on process {self.rank} "
            f"({str(error).splitlines()[0]}). {where}; lower per_device_train_batch_size (raise "
            f"gradient_accumulation_steps to keep the batch) or generation.gen_length, or set "
            f"gradient_checkpointing=true, then continue with `daca train --resume {self.run_dir}`"
        )

    def train(self) -> dict:
        """Run to ``max_steps``; SIGINT or SIGTERM stops every rank at the end of a step with a
        checkpoint of it and raises ``Interrupted`` (``daca.train.interrupts``)."""
        from daca.train.run_logging import RunLogger

        cfg = self.cfg
        logger = RunLogger(
            self.run_dir,
            cfg,
            enabled=self.acc.is_main_process,
            progress=self.progress,
            history=self.history,
            evals=self.evals,
        )
        stop = StopSignals(
            "saving at the end of this step or evaluation", announce=self.acc.is_main_process
        )
        try:
            with stop:
                self._train_loop(logger, stop)
        except Exception as e:
            if self.world > 1 and _peer_gone(e):
                # Another process failed and closed its connections: its error is the one to
                # report. The launcher (torchrun) ends this process within a second or so.
                time.sleep(_PEER_GRACE_S)
            raise
        finally:
            logger.close()
        summary = {
            "run_dir": str(self.run_dir),
            "steps": self.step,
            "held_out_before": self.evals[0]["held_out"],
            "held_out_after": self.evals[-1]["held_out"],
            "task": cfg.task,
            "method": cfg.method,
        }
        if self.acc.is_main_process:
            logger.finish(self.history, self.evals, summary)
        return summary

    def _train_loop(self, logger, stop: StopSignals) -> None:
        cfg = self.cfg
        if not self.evals:
            self._log_evaluation(logger)
        logger.start(total=cfg.max_steps, initial=self.step, held_out=self.evals[-1]["held_out"])
        while self.step < cfg.max_steps:
            # Every rank stops at the same step, whichever got the signal (one collective).
            signum = self._agreed_signal(stop.signum)
            if signum is not None:
                self._stop_for(signum, logger)
            try:
                stats = self.train_step()
            except torch.OutOfMemoryError as e:
                raise TrainingError(self._out_of_memory(e)) from e
            self.nonfinite_total += int(stats["nonfinite_skipped"])
            stats["nonfinite_steps"] = float(self.nonfinite_total)
            self.history.append(stats)
            logger.log_step(stats)
            self._stop_if_nonfinite()
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.max_steps:
                self._log_evaluation(logger)
            if self.step % cfg.save_every == 0 and self.step < cfg.max_steps:
                self.save()
        if self.evals[-1]["step"] != self.step:
            self._log_evaluation(logger)
        self.save()

    def _agreed_signal(self, signum: int | None) -> int | None:
        """The stop signal any rank received (the largest number), else None; a collective."""
        if self.world == 1:
            return signum
        t = torch.tensor([float(signum or 0)], device=self.acc.device)
        agreed = int(self.acc.gather(t).max().item())
        return agreed or None

    def _stop_for(self, signum: int, logger) -> None:
        """Save the last finished step, refresh the plots and raise ``Interrupted``."""
        if self.step > 0:
            self.save()  # nothing new when this step's checkpoint is already written
            saved = f"checkpoint of step {self.step} in {self.run_dir / 'checkpoints'}"
        else:
            saved = "no step had finished: nothing to save"
        logger.plot()
        raise Interrupted(
            signum,
            f"stopped by {signal_name(signum)} at step {self.step} of {self.cfg.max_steps} "
            f"({saved}); continue with: daca train --resume {shlex.quote(str(self.run_dir))}",
        )


def _mean_dicts(dicts: list[dict]) -> dict:
    keys = {k for d in dicts for k in d}
    return {k: sum(d[k] for d in dicts if k in d) / sum(1 for d in dicts if k in d) for k in keys}


def _peer_gone(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed because another process ended."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or "closed by peer" in text or "reset by peer" in text


def train(config: TrainConfig, *, resume: bool = False, progress: bool = True) -> dict:
    """Run ``config`` from a notebook or script; returns the summary."""
    return Trainer(config, resume=resume, progress=progress).train()
