"""The GRPO trainer for masked diffusion LMs: the base methods of ``daca.methods`` with the
DACA plug-in.

One step = one rollout of ``per_device_train_batch_size × gradient_accumulation_steps``
completions per process, scored and turned into group advantages, then DPS multipliers over
all of the step's trajectories (every micro-batch, every process), then ``num_iterations`` (μ)
optimizer updates on it, each accumulating gradients over the micro-batches. Every random draw
comes from a generator seeded by (seed, step, rank, ...), so a run resumed from a checkpoint
continues exactly. METHOD.md §4 is the law.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from daca import checkpoint, dps, likelihood, objectives, sandbox
from daca.checkpoint import latest_checkpoint
from daca.config import TrainConfig, resolved, to_dict, validate
from daca.evaluation import rollout
from daca.methods import METHODS
from daca.models.loading import LoadedModel, load, save_pretrained
from daca.models.prompts import (
    completion_mask,
    fit_prompts,
    prompt_limit,
    prompt_texts,
    prompt_token_ids,
)
from daca.rewards import score_rewards
from daca.sampler import Rollout
from daca.tasks import get_task

# How long a process whose peer failed waits for the launcher to end it before it reports the
# broken collective itself (launched without torchrun, nothing else would end it).
_PEER_GRACE_S = 30.0

# Per-step counts: summed over micro-batches and processes (other numbers are averaged).
_COUNTS = ("prompts_truncated",)


class InputError(ValueError):
    """Input a run cannot start with (data, prompts, output folder); the message names the
    file and line or the example, and what to change."""


class TrainingError(RuntimeError):
    """A run that had to stop (a failed checkpoint write, non-finite steps); the message says
    why, what is safe on disk and how to go on."""


def _seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across runs and processes)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def _gen(device, *parts: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(_seed(*parts))


@dataclass
class RolloutBatch:
    """One micro-batch of completions with what the updates need."""

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    rewards: Tensor
    advantages: Tensor
    multipliers: Tensor | None = None
    old_logp: list[Tensor] = field(default_factory=list)  # one per inner iteration
    ref_logp: list[Tensor] = field(default_factory=list)
    rollout: Rollout | None = None  # the sampler's output, until DPS has read its trace
    prompts: list[str] = field(default_factory=list)


class Trainer:
    """``Trainer(config).train()`` runs the configured RL job; ``daca train`` calls it."""

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

    # ----------------------------------------------------------------- setup
    def _preflight(self, resume: bool) -> None:
        """Find an unwritable output folder before any model is loaded (a real write)."""
        failed = None
        if self.acc.is_main_process:
            probe = self.run_dir / ".write-test"
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                probe.write_bytes(b"x" * 4096)
                probe.unlink()
            except OSError as e:
                failed = InputError(
                    f"cannot write to the output folder {self.run_dir} "
                    f"({e.strerror or e}); set output_dir=... to a writable folder with free "
                    f"space (or fix its permissions)"
                )
            if failed is None and not resume and (self.run_dir / "metrics.jsonl").exists():
                raise FileExistsError(
                    f"{self.run_dir} already holds a run; resume it with "
                    f"`daca train --resume {self.run_dir}` or choose another name=..."
                )
            if failed is None:
                _write_text(self.run_dir / "config.yaml", _yaml(to_dict(self.cfg)))
        if self._anywhere(failed is not None):
            raise failed or InputError(f"the main process cannot write to {self.run_dir}")

    def _check_sandbox(self) -> None:
        """A task that runs model-written code stops here, before any model loads, when no
        working isolation exists and unsafe execution was not asked for (``sandbox: unsafe``)."""
        if not self.task.executes_code:
            return
        if self.cfg.sandbox == "unsafe":
            sandbox.allow_unsafe_execution()
        try:
            sandbox.isolation_available()
        except sandbox.SandboxUnavailable as e:
            raise InputError(f"task={self.cfg.task}: {e}") from None

    def _anywhere(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (a collective: every rank must call it)."""
        if self.world == 1:
            return flag
        t = torch.tensor([float(flag)], device=self.acc.device)
        return self.acc.reduce(t, reduction="sum").item() > 0

    def _load_rows(self, split: str, path: str | None, limit: int) -> list[dict]:
        """The task's rows; a bad file is an InputError naming it (the loaders name the line)."""
        try:
            rows = self.task.load(split=split, path=path, limit=limit, seed=self.cfg.seed)
        except (ValueError, OSError, KeyError) as e:
            raise InputError(f"cannot read {self._source(split)}: {e}") from None
        if not rows:
            raise InputError(f"{self._source(split)} holds no rows")
        return rows

    def _source(self, split: str) -> str:
        """Where a split's rows come from, in the config's words."""
        key, path = (
            ("data_file", self.cfg.data_file)
            if split == "train"
            else ("eval_file", self.cfg.eval_file)
        )
        return f"{key}={path}" if path else f"task {self.cfg.task}'s {split} split"

    def _check_prompts(self) -> None:
        """Every prompt fits the model, or (truncate_prompts) how many will be cut is said."""
        if self.prompt_limit is None:
            return
        cut = []
        for split, rows in (("train", self.train_rows), ("test", self.eval_rows)):
            try:
                texts = prompt_texts(self.bundle, self.task, rows)
            except ValueError as e:
                raise InputError(f"task={self.cfg.task} with model={self.cfg.model}: {e}") from None
            ids = prompt_token_ids(self.bundle, texts)
            try:
                _, n = fit_prompts(
                    ids, self.prompt_limit, truncate=self.cfg.truncate_prompts, texts=texts
                )
            except ValueError as e:
                raise InputError(f"{self._source(split)}: {e}") from None
            cut.append((n, len(rows), split))
        if any(n for n, _, _ in cut) and self.acc.is_main_process:
            counts = " and ".join(f"{n} of {total} {split}" for n, total, split in cut)
            limit = self.prompt_limit
            print(f"truncate_prompts: {counts} prompts keep only their last {limit} tokens")

    def _load_model(self) -> LoadedModel:
        cfg = self.cfg
        dtype = torch.bfloat16 if cfg.bf16 else None
        if cfg.load_in_4bit:
            from daca.models.quant import load_4bit

            bundle = load_4bit(cfg.model, device=self.acc.device)
        else:
            bundle = load(cfg.model, device=self.acc.device, dtype=dtype)
        bundle.meta["generation"] = asdict(cfg.generation)  # checkpoints evaluate with these
        if cfg.gradient_checkpointing:
            from daca.models.families import enable_gradient_checkpointing

            enable_gradient_checkpointing(bundle.model)
        if cfg.lora.enabled:
            from peft import LoraConfig, get_peft_model

            from daca.models.families import lora_targets

            lcfg = LoraConfig(
                r=cfg.lora.r,
                lora_alpha=cfg.lora.alpha,
                lora_dropout=cfg.lora.dropout,
                target_modules=cfg.lora.target_modules or lora_targets(bundle),
            )
            with torch.random.fork_rng(devices=[]):  # the adapter's initial A: seeded
                torch.manual_seed(_seed(cfg.seed, 3))
                bundle.model = get_peft_model(bundle.model, lcfg)
        bundle.model.train()
        return bundle

    # ----------------------------------------------------------------- data
    def _prompts_for(self, step: int, micro: int) -> list[dict]:
        """This rank's prompts of one micro-batch: a seeded permutation per epoch, cut in
        consecutive global batches, each split across ranks (so the position in the data
        follows from the step alone, and a resumed run reads the same prompts)."""
        cfg = self.cfg
        per_rank = cfg.per_device_train_batch_size // cfg.num_generations
        n = len(self.train_rows)
        start = (step * cfg.gradient_accumulation_steps + micro) * per_rank * self.world
        start += self.rank * per_rank
        rows = []
        for i in range(start, start + per_rank):
            epoch, pos = divmod(i, n)
            rows.append(self.train_rows[self._permutation(epoch)[pos]])
        return rows

    def _permutation(self, epoch: int) -> list[int]:
        if self._perm_epoch != epoch:
            perm = list(range(len(self.train_rows)))
            random.Random(_seed(self.cfg.seed, epoch)).shuffle(perm)
            self._perm_epoch, self._perm = epoch, perm
        return self._perm

    # ----------------------------------------------------------------- estimators
    def _token_logp(self, model, batch: RolloutBatch, seed: int) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs for the ratio (or wd1's likelihood) and the SML regulariser's."""
        cfg, device, mask_id = self.cfg, batch.prompt_ids.device, self.bundle.mask_id
        base = self.method.estimator(model, batch, cfg, _gen(device, seed, 1), mask_id)
        regulariser = self.method.sml == "regulariser"
        if not cfg.sml.enabled or (regulariser and cfg.sml.eta == 0):
            return base, None  # a regulariser of weight 0 would discard the K forwards
        sml = likelihood.stratified_logp(
            model,
            batch.prompt_ids,
            batch.completion_ids,
            mask_id=mask_id,
            attention_mask=batch.prompt_mask,
            num_strata=cfg.sml.num_strata,
            strata=cfg.sml.strata,
            generator=_gen(device, seed, 2),
        )
        if regulariser:
            return base, sml
        return objectives.sml_enriched(base, sml), None

    @contextlib.contextmanager
    def _reference(self):
        """The reference policy: the adapter-disabled base under LoRA, else a frozen copy."""
        if self.ref_model is not None:
            yield self.ref_model
        else:
            with self.acc.unwrap_model(self.model).disable_adapter():
                yield self.model

    # ----------------------------------------------------------------- one step
    @torch.no_grad()
    def _generate(self, model, rows, *, temperature, generator=None, dps_stride=None):
        """One completion per row: (texts, Rollout, prompt mask, prompt texts, prompts cut)."""
        done = rollout(
            self.bundle,
            self.task,
            rows,
            self.cfg.generation,
            model=model,
            temperature=temperature,
            generator=generator,
            dps_stride=dps_stride,
            dps_scope=self.cfg.dps.scope,
            limit=self.prompt_limit,
            truncate=self.cfg.truncate_prompts,
        )
        return done.texts, done.rollout, done.prompt_mask, done.prompts, done.truncated

    def _make_rollout(self, step: int, micro: int) -> tuple[RolloutBatch, dict]:
        cfg, G = self.cfg, self.cfg.num_generations
        rows = [r for r in self._prompts_for(step, micro) for _ in range(G)]
        model = self.acc.unwrap_model(self.model)
        model.eval()
        t0 = time.perf_counter()
        texts, out, prompt_mask, prompts, cut = self._generate(
            model,
            rows,
            temperature=cfg.generation.temperature,
            generator=_gen(self.acc.device, cfg.seed, step, micro, self.rank, 7),
            dps_stride=cfg.dps.stride if cfg.dps.enabled else None,
        )
        model.train()
        t1 = time.perf_counter()
        columns = {c: [r.get(c) for r in rows] for c in self.task.columns}
        per_func, rewards, errors = score_rewards(
            self.task.reward_funcs,
            self.task.reward_weights,
            prompts,
            texts,
            columns,
            on_error=cfg.on_reward_error,
            on_timeout=cfg.on_reward_timeout,
            timeout=cfg.reward_timeout,
        )
        t2 = time.perf_counter()
        device = self.acc.device
        rewards = rewards.to(device)
        adv = objectives.group_advantages(
            rewards, G, scale=cfg.scale_rewards, baseline=self.method.baseline
        )
        stats = {
            "reward": rewards.mean().item(),
            "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "advantage_abs": adv.abs().mean().item(),
            "reward_errors": errors,
            "prompts_truncated": cut // G,
            "time_rollout": t1 - t0,
            "time_reward": t2 - t1,
        }
        for f, func in enumerate(self.task.reward_funcs):
            stats[f"reward/{getattr(func, '__name__', f)}"] = per_func[:, f].mean().item()
        batch = RolloutBatch(
            prompt_ids=out.sequences[:, : out.prompt_length],
            prompt_mask=prompt_mask,
            completion_ids=out.completion_ids,
            completion_mask=completion_mask(self.bundle, out.completion_ids),
            rewards=rewards,
            advantages=adv,
            rollout=out,
            prompts=prompts,
        )
        return batch, stats

    def _dps_step(self, batches: list[RolloutBatch]) -> tuple[list[Tensor | None], dict]:
        """DPS multipliers of every micro-batch, δ z-scored over all the step's trajectories
        (every micro-batch, every process; METHOD.md §2 [decision]): (normalised δ, metrics)."""
        if not self.cfg.dps.enabled:
            return [None] * len(batches), {}
        cfg = self.cfg.dps
        multipliers, normed, stats = dps.step_multipliers(
            [b.rollout for b in batches],
            lam=cfg.lam,
            last_step=cfg.last_step,
            norm_axis=cfg.norm_axis,
            clamp_min=cfg.clamp_min,
            gather=self.acc.gather if self.world > 1 else None,
            rank=self.rank,
        )
        for batch, mult in zip(batches, multipliers, strict=True):
            batch.multipliers = mult
        return normed, stats

    def _record_rollout(self, step: int, batch: RolloutBatch, normed: Tensor | None) -> None:
        """The first group of this step's first micro-batch, for ``daca inspect``."""
        G = self.cfg.num_generations
        out, prompts, multipliers = batch.rollout, batch.prompts[:G], batch.multipliers
        rewards, adv = batch.rewards[:G], batch.advantages[:G]
        tok = self.bundle.tokenizer
        record = {
            "step": step,
            "task": self.cfg.task,
            "method": self.cfg.method,
            "lam": self.cfg.dps.lam if self.cfg.dps.enabled else 0.0,
            "prompts": prompts,
            "tokens": [tok.convert_ids_to_tokens(r) for r in out.completion_ids[:G].tolist()],
            "birth_step": out.birth_step[:G].tolist(),
            "num_steps": out.num_steps,
            "rewards": rewards.tolist(),
            "advantages": adv.tolist(),
        }
        if multipliers is not None:
            record["recorded_steps"] = out.recorded_steps.tolist()
            record["multipliers"] = multipliers[:G].tolist()
            record["norm_deltas"] = normed[:G].tolist()
        folder = self.run_dir / "rollouts"
        folder.mkdir(exist_ok=True)
        tmp = folder / f"step-{step:07d}.json.tmp"
        tmp.write_text(json.dumps(record))
        tmp.replace(folder / f"step-{step:07d}.json")

    def _diagnose(self, batch: RolloutBatch) -> str:
        """Why a micro-batch's loss is not finite, with what to try."""
        params = self.acc.unwrap_model(self.model).parameters()
        if not all(torch.isfinite(p).all() for p in params):
            return (
                "the model's weights hold NaN or inf (go back to an earlier checkpoint and "
                "lower learning_rate or max_grad_norm)"
            )
        if not bool(self._logp_finite):
            return (
                "non-finite log-probabilities: the model's logits hold NaN or inf (with bf16, "
                "try fp32; lower learning_rate)"
            )
        if batch.multipliers is not None and not torch.isfinite(batch.multipliers).all():
            return "non-finite DPS multipliers (the rollout's logits held NaN or inf)"
        if not torch.isfinite(batch.advantages).all():
            return "non-finite advantages (check the reward functions)"
        return (
            "a non-finite loss from finite log-probabilities and advantages (check psi, "
            "epsilon and beta)"
        )

    def _loss(self, batch: RolloutBatch, it: int, seed: int) -> tuple[Tensor, dict]:
        logp, sml = self._token_logp(self.model, batch, seed)
        self._logp_finite = torch.isfinite(logp).all()  # read only to diagnose a bad loss
        return self.method.loss(
            self.cfg,
            logp,
            old_logp=batch.old_logp[it] if batch.old_logp else logp.detach(),
            ref_logp=batch.ref_logp[it] if batch.ref_logp else None,
            advantages=batch.advantages,
            completion_mask=batch.completion_mask,
            token_multipliers=batch.multipliers,
            sml_logp=sml,
        )

    @torch.no_grad()
    def _old_and_reference(self, batches: list[RolloutBatch], seeds: list[list[int]]) -> None:
        """Old and reference log-probs once per rollout, with the μ iterations' mask seeds."""
        for batch, batch_seeds in zip(batches, seeds, strict=True):
            if len(batch_seeds) > 1:
                batch.old_logp = [self._token_logp(self.model, batch, s)[0] for s in batch_seeds]
            if self.cfg.beta > 0:
                with self._reference() as ref:
                    batch.ref_logp = [self._token_logp(ref, batch, s)[0] for s in batch_seeds]

    def train_step(self) -> dict:
        cfg, step = self.cfg, self.step
        gas = cfg.gradient_accumulation_steps
        mu = cfg.num_iterations if self.method.ratio else 1  # no ratio: no old policy to reuse
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
        seeds = [
            [_seed(cfg.seed, step, m, it, self.rank, 11) for it in range(mu)] for m in range(gas)
        ]
        if self.method.ratio:
            self._old_and_reference(batches, seeds)
        update_stats: list[dict] = []
        skipped = False
        for it in range(mu):
            cause = ""
            for m, batch in enumerate(batches):
                # accumulate() divides the loss by gas and syncs gradients on the last micro-batch.
                # Every rank runs every backward, even of a NaN loss: DDP's all-reduce needs all.
                with self.acc.accumulate(self.model):
                    loss, metrics = self._loss(batch, it, seeds[m][it])
                    self.acc.backward(loss)
                metrics = {k: float(v) for k, v in metrics.items()}
                metrics["loss"] = loss.item()
                update_stats.append(metrics)
                if not cause and not math.isfinite(metrics["loss"]):
                    cause = self._diagnose(batch)
            grad_norm = self.acc.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            if not cause and grad_norm is not None and not math.isfinite(float(grad_norm)):
                cause = "non-finite gradients (lower learning_rate; with bf16, try fp32)"
            # A non-finite update would poison the weights and AdamW's moments: skip it, on
            # every rank alike (the loss is local; the gradient norm is already global).
            if self._anywhere(bool(cause)):
                skipped = True
                self._nonfinite_cause = cause or "a non-finite loss on another process"
            else:
                self.optimizer.step()
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
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
    def evaluate(self) -> float:
        """Held-out metric at temperature 0, each rank scoring its share of the rows."""
        model = self.acc.unwrap_model(self.model)
        rows = self.eval_rows[self.rank :: self.world]
        # Pad to equal counts: a sharded model (FSDP) runs collectives in every forward.
        per_rank = -(-len(self.eval_rows) // self.world)
        padded = rows + self.eval_rows[: per_rank - len(rows)]
        from daca.rewards import score_completions  # the guarded metric (daca.rewards)

        size, scores = self.cfg.eval_batch_size, []
        was_training = model.training
        model.eval()
        try:
            for start in range(0, len(padded), size):
                chunk = padded[start : start + size]
                texts = self._generate(model, chunk, temperature=0.0)[0]
                columns = {c: [r.get(c) for r in chunk] for c in self.task.columns}
                scores += score_completions(
                    self.task.score,
                    texts,
                    columns,
                    on_error=self.cfg.on_reward_error,
                    on_timeout=self.cfg.on_reward_timeout,
                    timeout=self.cfg.reward_timeout,
                )
        finally:
            model.train(was_training)
        scores = scores[: len(rows)]
        total = torch.tensor([sum(scores), len(scores)], dtype=torch.float64)
        if self.world > 1:
            total = self.acc.reduce(total.to(self.acc.device), reduction="sum").cpu()
        return (total[0] / total[1]).item()

    # ----------------------------------------------------------------- checkpoints
    def save(self) -> None:
        """Write the checkpoint of this step, complete or not at all (``daca.checkpoint``).

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
        tmp = checkpoint.temporary_dir(self.run_dir, step)
        error = None
        if main:
            try:
                checkpoint.begin(self.run_dir, step)
            except Exception as e:
                error = e
        if not self._anywhere(error is not None):
            try:
                self._write_checkpoint(tmp)
            except Exception as e:
                error = e
        if not self._anywhere(error is not None) and main:
            try:
                checkpoint.commit(self.run_dir, step, keep=self.cfg.save_total_limit)
            except Exception as e:
                error = e
        if self._anywhere(error is not None):
            if main:
                checkpoint.discard_temporary(self.run_dir, step)
            raise TrainingError(_save_failed(self.run_dir, step, latest, error)) from error
        self.acc.wait_for_everyone()

    def _write_checkpoint(self, tmp: Path) -> None:
        """Every rank writes its part of ``state/`` (its shards, its RNG) and takes part in
        gathering the full weights (FSDP); the main process writes the rest."""
        self.acc.save_state(str(tmp / "state"))
        weights = self.acc.get_state_dict(self.model)
        if self.acc.is_main_process:
            weights = _own_storage(weights)
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
            self.acc.register_save_state_pre_hook(_keep_trainable)
            self.acc.register_load_state_pre_hook(_load_trainable)

    def _resume(self) -> None:
        """Continue from the latest complete checkpoint; none yet (a run stopped before its
        first one): start over. The logs are cut back to the checkpoint's step."""
        if self.acc.is_main_process:
            checkpoint.recover(self.run_dir)
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
            # The logs may hold steps past the checkpoint: rewrite them from its state.
            _rewrite_jsonl(self.run_dir / "metrics.jsonl", self.history)
            _rewrite_jsonl(self.run_dir / "evals.jsonl", self.evals)
            print(
                f"resuming {self.run_dir} from step {self.step}"
                if found
                else f"{self.run_dir} has no complete checkpoint yet: starting it over"
            )
        self.acc.wait_for_everyone()

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
        from daca.run_logging import RunLogger

        cfg = self.cfg
        logger = RunLogger(
            self.run_dir, cfg, enabled=self.acc.is_main_process, progress=self.progress
        )
        if not self.evals:
            self.evals.append({"step": 0, "held_out": self.evaluate()})
            logger.log_eval(self.evals[-1])
        start_step = self.step
        logger.start(total=cfg.max_steps, initial=start_step, held_out=self.evals[-1]["held_out"])
        try:
            while self.step < cfg.max_steps:
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
                    self.evals.append({"step": self.step, "held_out": self.evaluate()})
                    logger.log_eval(self.evals[-1])
                if self.step % cfg.save_every == 0 and self.step < cfg.max_steps:
                    self.save()
            if self.evals[-1]["step"] != self.step:
                self.evals.append({"step": self.step, "held_out": self.evaluate()})
                logger.log_eval(self.evals[-1])
            self.save()
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


def _mean_dicts(dicts: list[dict]) -> dict:
    keys = {k for d in dicts for k in d}
    return {k: sum(d[k] for d in dicts if k in d) / sum(1 for d in dicts if k in d) for k in keys}


def _peer_gone(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed because another process ended."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or "closed by peer" in text or "reset by peer" in text


def _save_failed(run_dir: Path, step: int, latest, error: BaseException | None) -> str:
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


def _own_storage(weights: dict) -> dict:
    """The weights, each tensor owning its storage: a gathered FSDP shard can be a view into
    a padded buffer, which safetensors refuses to save."""
    return {
        k: v if v.untyped_storage().nbytes() == v.nbytes else v.clone() for k, v in weights.items()
    }


def _keep_trainable(models, weights, output_dir) -> None:
    """accelerate's save_state hook: only the trainable weights go into ``state/``."""
    for model, state in zip(models, weights, strict=True):
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        for key in [k for k in state if k not in trainable]:
            del state[key]


def _load_trainable(models, input_dir) -> None:
    """accelerate's load_state hook: load the trainable weights ``_keep_trainable`` saved
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


def _rewrite_jsonl(path: Path, rows: list[dict]) -> None:
    _write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def _write_text(path: Path, text: str) -> None:
    """Replace a file atomically: a crash leaves the old or the new text, never a torn one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


def train(config: TrainConfig, *, resume: bool = False, progress: bool = True) -> dict:
    """Run ``config`` from a notebook or script; returns the summary."""
    return Trainer(config, resume=resume, progress=progress).train()
