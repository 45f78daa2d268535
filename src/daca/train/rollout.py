"""The rollout half of a training step: prompts of a step, one completion per row with the
denoising trace, rewards and group advantages, then DPS multipliers over all of the step's
trajectories.

The plain functions are what both front-ends call (``daca train``'s ``RolloutSteps`` and
``daca.integrations.trl``): ``sample`` is the one sampler call of every rollout,
``sample_micro_batch`` a training micro-batch with its seeded generator (``daca.train.seeds``)
and ``dps_multipliers`` the step's DPS over all its rollouts. ``rollout()`` generates for task
rows (the evaluation loop uses it too).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from daca.core import dps, objectives
from daca.core.sampler import Rollout, generate
from daca.models.loading import LoadedModel
from daca.models.prompts import (
    completion_mask,
    decode_completions,
    fit_prompts,
    pad_prompts,
    prompt_token_ids,
)
from daca.tasks import Task
from daca.tasks.credit_labels import completion_of, graded_spans, special_tokens, token_labels
from daca.tasks.prompts import prompt_texts
from daca.tasks.rewards import score_rewards
from daca.train.config import DPSConfig, GenerationConfig, TrainConfig
from daca.train.seeds import data_order_seed, sampler_generator


def sampler_options(gen: GenerationConfig, temperature: float | None = None) -> dict:
    """``generate``'s sampler keywords from ``gen`` (its fields are named as the keywords);
    ``temperature`` overrides the config's (evaluation samples at 0)."""
    options = asdict(gen)
    if temperature is not None:
        options["temperature"] = temperature
    return options


def sample(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    gen: GenerationConfig,
    *,
    mask_id: int,
    temperature: float | None = None,
    generator: torch.Generator | None = None,
    dps_stride: int | None = None,
    dps_scope: str = "all",
) -> Rollout:
    """The sampler call of every rollout, training and evaluation, in both front-ends: ``generate``
    on left-padded prompts with the settings of ``gen`` (its ``cache`` and ``parallel_threshold``
    included; ``temperature`` overrides its temperature), recording the DPS trace every
    ``dps_stride`` steps."""
    return generate(
        model,
        prompt_ids,
        prompt_mask,
        mask_id=mask_id,
        **sampler_options(gen, temperature),
        generator=generator,
        dps_stride=dps_stride,
        dps_scope=dps_scope,
    )


def sample_micro_batch(
    model, prompt_ids: Tensor, prompt_mask: Tensor, cfg: TrainConfig, *, step, micro, rank, mask_id
) -> Rollout:
    """Micro-batch ``micro`` of step ``step`` on process ``rank``: sampled at the training
    temperature, with the DPS trace when DPS is on, from the generator of (seed, step, micro-batch,
    rank) (``daca.train.seeds.sampler_generator``)."""
    return sample(
        model,
        prompt_ids,
        prompt_mask,
        cfg.generation,
        mask_id=mask_id,
        generator=sampler_generator(prompt_ids.device, cfg.seed, step, micro, rank),
        dps_stride=cfg.dps.stride if cfg.dps.enabled else None,
        dps_scope=cfg.dps.scope,
    )


def dps_multipliers(
    rollouts: list[Rollout],
    cfg: DPSConfig,
    *,
    gather=None,
    rank: int = 0,
    completion_masks: list[Tensor] | None = None,
) -> tuple[list[Tensor | None], list[Tensor | None], dict]:
    """DPS of one optimizer step (``daca.core.dps.step_multipliers``): the multipliers [B, L] and
    normalised δ [B, R] of each rollout, δ z-scored over all the step's trajectories (every
    micro-batch; every process through ``gather``, METHOD.md §2 [decision]), and the ``dps/*``
    metrics; with DPS off, None for each rollout and no metrics. ``cfg.center = "sequence"``
    shifts each completion's multipliers to a mean of 1 over its ``completion_masks`` (the
    metrics stay those of the multipliers before the shift)."""
    if not cfg.enabled:
        return [None] * len(rollouts), [None] * len(rollouts), {}
    multipliers, normed, stats = dps.step_multipliers(
        rollouts,
        lam=cfg.lam,
        last_step=cfg.last_step,
        norm_axis=cfg.norm_axis,
        clamp_min=cfg.clamp_min,
        gather=gather,
        rank=rank,
    )
    if cfg.center == "sequence":
        if completion_masks is None:
            raise ValueError("dps.center=sequence needs the completion masks")
        multipliers = [
            dps.center_per_sequence(m, mask)
            for m, mask in zip(multipliers, completion_masks, strict=True)
        ]
    return multipliers, normed, stats


def completion_labels(bundle: LoadedModel, task: Task, completion_ids: Tensor, rows) -> Tensor:
    """Ground truth per completion token [B, L] long (``daca.tasks.credit_labels``): +1 a token
    of a right trace step or answer cell, -1 of a wrong one, 0 the rest and every token after
    the first end-of-sequence (the text the reward reads ends there)."""
    tok = bundle.tokenizer
    special = special_tokens(tok)
    keep = completion_mask(bundle, completion_ids).cpu()
    labels = torch.zeros(completion_ids.shape, dtype=torch.long)
    for b, (ids, row) in enumerate(zip(completion_ids.cpu().tolist(), rows, strict=True)):
        n = int(keep[b].sum())
        tokens = tok.convert_ids_to_tokens(ids[:n])
        steps, cells = graded_spans(task, completion_of(tokens, special), row)
        labels[b, :n] = torch.tensor(token_labels(tokens, special, steps + cells), dtype=torch.long)
    return labels.to(completion_ids.device)


def oracle_credit(
    batches: list[RolloutBatch],
    gather=None,
    *,
    clamp_min: float | None = None,
    center: str = "none",
) -> tuple[list[Tensor], dict[str, float]]:
    """The oracle-credit control over one optimizer step (``daca.core.dps.oracle_multipliers``):
    each micro-batch's multipliers from its ``labels`` and advantages, with the mean and spread
    of the DPS multipliers it carries over all the step's micro-batches and processes. Then the
    shaping DPS's own multipliers get, in DPS's order (METHOD.md §2): ``clamp_min`` (``dps.
    clamp_min``), then ``center="sequence"`` (``dps.center``), so the control differs from DPS in
    the credit alone."""

    def cat(name: str) -> Tensor:
        return torch.cat([getattr(b, name) for b in batches])

    mask = cat("completion_mask")
    multipliers, stats = dps.oracle_multipliers(
        cat("labels"), cat("advantages"), cat("multipliers"), mask, gather=gather
    )
    if clamp_min is not None:
        multipliers = multipliers.clamp_min(clamp_min)
    if center == "sequence":
        multipliers = dps.center_per_sequence(multipliers, mask)
    # Their range on this process (DPS's own range is dps/multiplier_min, _max): few graded
    # tokens make std(o) small and the oracle's extremes large.
    shaped = multipliers[mask.bool()]
    if shaped.numel():
        stats |= {"dps/oracle_min": float(shaped.min()), "dps/oracle_max": float(shaped.max())}
    return list(multipliers.split([b.labels.shape[0] for b in batches])), stats


@dataclass
class RolloutBatch:
    """One micro-batch of completions with what the updates need."""

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    rewards: Tensor
    advantages: Tensor
    step: int = 0  # the training step that sampled it (0-based): annealed SML's K reads it
    multipliers: Tensor | None = None
    labels: Tensor | None = None  # ground truth per token, for dps.credit=oracle
    dps_multipliers: Tensor | None = None  # DPS's own, where the oracle's replaced them
    old_logp: list[Tensor] = field(default_factory=list)  # one per inner iteration after the 1st
    ref_logp: list[Tensor] = field(default_factory=list)
    rollout: Rollout | None = None  # the sampler's output, until DPS has read its trace
    prompts: list[str] = field(default_factory=list)
    columns: dict[str, list] = field(default_factory=dict)  # the task's columns, per completion


@dataclass
class Prompts:
    """Task rows' prompts as the model reads them."""

    texts: list[str]
    ids: Tensor  # [B, P] long, left padded, on the model's device
    mask: Tensor  # [B, P], 1 = real token
    truncated: int  # prompts cut to fit (``truncate=True``)


def encode_rows(
    bundle: LoadedModel,
    task: Task,
    rows: list[dict],
    device,
    *,
    limit: int | None = None,
    truncate: bool = False,
) -> Prompts:
    """The rows' prompts, tokenized and left padded (``daca.models.prompts.pad_prompts``).

    Prompts longer than ``limit`` tokens (or the tiny model's width) are a ValueError, or with
    ``truncate`` keep their last tokens (``daca.models.prompts.fit_prompts``)."""
    texts = prompt_texts(bundle, task, rows)
    ids, cut = fit_prompts(prompt_token_ids(bundle, texts), limit, truncate=truncate, texts=texts)
    prompt_ids, prompt_mask = pad_prompts(bundle, ids)
    return Prompts(texts, prompt_ids.to(device), prompt_mask.to(device), cut)


@dataclass
class Generated:
    """One completion per row, with what the trainer needs besides the text."""

    texts: list[str]
    rollout: Rollout
    prompt_mask: torch.Tensor  # [B, P]
    prompts: list[str]  # the prompt texts
    truncated: int  # prompts cut to fit (``truncate=True``)


def rollout(
    bundle: LoadedModel,
    task: Task,
    rows: list[dict],
    gen: GenerationConfig,
    *,
    model=None,
    temperature: float | None = None,
    generator: torch.Generator | None = None,
    dps_stride: int | None = None,
    dps_scope: str = "all",
    limit: int | None = None,
    truncate: bool = False,
) -> Generated:
    """Generate one completion per row with ``model`` (default ``bundle.model``), with the
    sampler settings of ``gen`` (``sample``); prompts as ``encode_rows`` fits them."""
    model = bundle.model if model is None else model
    device = next(model.parameters()).device
    prompts = encode_rows(bundle, task, rows, device, limit=limit, truncate=truncate)
    out = sample(
        model,
        prompts.ids,
        prompts.mask,
        gen,
        mask_id=bundle.mask_id,
        temperature=temperature,
        generator=generator,
        dps_stride=dps_stride,
        dps_scope=dps_scope,
    )
    texts = decode_completions(bundle, out.completion_ids.cpu())
    return Generated(texts, out, prompts.mask, prompts.texts, prompts.truncated)


class RolloutSteps:
    """The rollout half of ``Trainer`` (a mixin: it reads the trainer's ``cfg``, ``acc``,
    ``bundle``, ``task``, ``train_rows``, ``rank``, ``world`` and ``run_dir``)."""

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
            random.Random(data_order_seed(self.cfg.seed, epoch)).shuffle(perm)
            self._perm_epoch, self._perm = epoch, perm
        return self._perm

    def _make_rollout(self, step: int, micro: int) -> tuple[RolloutBatch, dict]:
        """Micro-batch ``micro`` of step ``step``: its completions, rewards and advantages."""
        cfg, G = self.cfg, self.cfg.num_generations
        rows = [r for r in self._prompts_for(step, micro) for _ in range(G)]
        t0 = time.perf_counter()
        prompts, out, texts = self._sample(rows, step, micro)
        t1 = time.perf_counter()
        per_func, rewards, errors = self._score(rows, prompts.texts, texts)
        t2 = time.perf_counter()
        adv = objectives.group_advantages(
            rewards, G, scale=cfg.scale_rewards, baseline=self.method.baseline
        )
        stats = {
            "reward": rewards.mean().item(),
            "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "advantage_abs": adv.abs().mean().item(),
            "reward_errors": errors,
            "prompts_truncated": prompts.truncated // G,
            # Mean denoising steps a completion took: the budget T, fewer with parallel decoding.
            "rollout_steps": out.steps_taken.float().mean().item(),
            "time_rollout": t1 - t0,
            "time_reward": t2 - t1,
        }
        for f, func in enumerate(self.task.reward_funcs):
            stats[f"reward/{getattr(func, '__name__', f)}"] = per_func[:, f].mean().item()
        batch = RolloutBatch(
            prompt_ids=out.sequences[:, : out.prompt_length],
            prompt_mask=prompts.mask,
            completion_ids=out.completion_ids,
            completion_mask=completion_mask(self.bundle, out.completion_ids),
            rewards=rewards,
            advantages=adv,
            step=step,
            rollout=out,
            prompts=prompts.texts,
            columns={c: [r.get(c) for r in rows] for c in self.task.columns},
        )
        if cfg.dps.enabled and cfg.dps.credit == "oracle":
            batch.labels = completion_labels(self.bundle, self.task, out.completion_ids, rows)
        return batch, stats

    @torch.no_grad()
    def _sample(self, rows: list[dict], step: int, micro: int):
        """(Prompts, Rollout, decoded completions) of the rows, as ``sample_micro_batch``."""
        model = self.acc.unwrap_model(self.model)
        model.eval()
        prompts = encode_rows(
            self.bundle,
            self.task,
            rows,
            next(model.parameters()).device,
            limit=self.prompt_limit,
            truncate=self.cfg.truncate_prompts,
        )
        out = sample_micro_batch(
            model,
            prompts.ids,
            prompts.mask,
            self.cfg,
            step=step,
            micro=micro,
            rank=self.rank,
            mask_id=self.bundle.mask_id,
        )
        model.train()
        return prompts, out, decode_completions(self.bundle, out.completion_ids.cpu())

    def _score(self, rows: list[dict], prompts: list[str], texts: list[str]):
        """The guarded rewards (``daca.tasks.rewards.score_rewards``): (per function, weighted
        sum on the trainer's device, number of failed scorings)."""
        cfg = self.cfg
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
        return per_func, rewards.to(self.acc.device), errors

    def _dps_step(self, batches: list[RolloutBatch]) -> tuple[list[Tensor | None], dict]:
        """The step's DPS multipliers on every micro-batch (``dps_multipliers``): (normalised δ,
        metrics)."""
        gather = self.acc.gather if self.world > 1 else None
        rollouts = [b.rollout for b in batches]
        multipliers, normed, stats = dps_multipliers(
            rollouts,
            self.cfg.dps,
            gather=gather,
            rank=self.rank,
            completion_masks=[b.completion_mask for b in batches],
        )
        for batch, mult in zip(batches, multipliers, strict=True):
            batch.multipliers = mult
        if self.cfg.dps.enabled and self.cfg.dps.credit == "oracle":
            oracle, oracle_stats = oracle_credit(
                batches, gather, clamp_min=self.cfg.dps.clamp_min, center=self.cfg.dps.center
            )
            stats.update(oracle_stats)
            for batch, mult in zip(batches, oracle, strict=True):
                batch.dps_multipliers, batch.multipliers = batch.multipliers, mult
        return normed, stats

    def _record_rollout(self, step: int, batch: RolloutBatch, normed: Tensor | None) -> None:
        """The first group of this step's first micro-batch, for ``daca inspect``."""
        record = self._rollout_record(step, batch, normed, slice(0, self.cfg.num_generations))
        folder = self.run_dir / "rollouts"
        folder.mkdir(exist_ok=True)
        tmp = folder / f"step-{step:07d}.json.tmp"
        tmp.write_text(json.dumps(record))
        tmp.replace(folder / f"step-{step:07d}.json")

    def _rollout_record(self, step: int, batch: RolloutBatch, normed, rows: slice) -> dict:
        """The completions ``rows`` of a micro-batch as ``daca inspect`` and ``daca credit``
        read them: tokens, birth steps, rewards, advantages, DPS multipliers, task columns."""
        out, multipliers, tok = batch.rollout, batch.multipliers, self.bundle.tokenizer
        record = {
            "step": step,
            "task": self.cfg.task,
            "method": self.cfg.method,
            "lam": self.cfg.dps.lam if self.cfg.dps.enabled else 0.0,
            "prompts": batch.prompts[rows],
            "columns": {c: v[rows] for c, v in batch.columns.items()},  # for daca credit's roles
            "tokens": [tok.convert_ids_to_tokens(r) for r in out.completion_ids[rows].tolist()],
            "pad_token": tok.pad_token,  # left out of daca inspect's pictures
            "birth_step": out.birth_step[rows].tolist(),
            "num_steps": out.num_steps,
            "rewards": batch.rewards[rows].tolist(),
            "advantages": batch.advantages[rows].tolist(),
        }
        if multipliers is not None:
            record["recorded_steps"] = out.recorded_steps.tolist()
            record["multipliers"] = multipliers[rows].tolist()
            record["norm_deltas"] = normed[rows].tolist()
            # The raw progress δ of each interval, for daca credit's separation.
            record["deltas"] = dps.rollout_deltas(out, self.cfg.dps.last_step)[rows].tolist()
        if batch.dps_multipliers is not None:
            record["credit"] = "oracle"  # "multipliers" are the oracle's; DPS's own beside them
            record["dps_multipliers"] = batch.dps_multipliers[rows].tolist()
        return record
