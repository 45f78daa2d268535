"""The training rollout: prompts of a step, one completion per row with the denoising trace,
rewards and group advantages, then DPS multipliers over all of the step's trajectories.

``rollout()`` generates for a list of task rows (evaluation uses it too); ``RolloutSteps`` holds
the parts of ``Trainer`` that build a step's ``RolloutBatch``es. Every random draw comes from a
generator seeded by (seed, step, rank, ...) so that a resumed run continues exactly.
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
from daca.tasks.prompts import prompt_texts
from daca.tasks.rewards import score_rewards
from daca.train.config import GenerationConfig


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across runs and processes)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def seeded_generator(device, *parts: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(derive_seed(*parts))


def sampler_generator(device, seed: int, step: int, micro: int, rank: int) -> torch.Generator:
    """The sampler's generator of micro-batch ``micro`` of step ``step`` on process ``rank``
    (``daca train`` and the TRL front-end with ``method=``: the same rollouts)."""
    return seeded_generator(device, seed, step, micro, rank, 7)


def sampler_options(gen: GenerationConfig, temperature: float | None = None) -> dict:
    """``generate``'s sampler keywords from ``gen`` (its fields are named as the keywords);
    ``temperature`` overrides the config's (evaluation samples at 0)."""
    options = asdict(gen)
    if temperature is not None:
        options["temperature"] = temperature
    return options


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
    sampler settings of ``gen`` (its ``cache`` and ``parallel_threshold`` included).

    Prompts longer than ``limit`` tokens (or the tiny model's width) are a ValueError, or with
    ``truncate`` keep their last tokens (``daca.models.prompts.fit_prompts``)."""
    model = bundle.model if model is None else model
    prompts = prompt_texts(bundle, task, rows)
    ids, cut = fit_prompts(
        prompt_token_ids(bundle, prompts), limit, truncate=truncate, texts=prompts
    )
    prompt_ids, prompt_mask = pad_prompts(bundle, ids)
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    out = generate(
        model,
        prompt_ids,
        prompt_mask,
        mask_id=bundle.mask_id,
        **sampler_options(gen, temperature),
        generator=generator,
        dps_stride=dps_stride,
        dps_scope=dps_scope,
    )
    texts = decode_completions(bundle, out.completion_ids.cpu())
    return Generated(texts, out, prompt_mask, prompts, cut)


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
            random.Random(derive_seed(self.cfg.seed, epoch)).shuffle(perm)
            self._perm_epoch, self._perm = epoch, perm
        return self._perm

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
            generator=sampler_generator(self.acc.device, cfg.seed, step, micro, self.rank),
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
            "pad_token": tok.pad_token,  # left out of daca inspect's pictures
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
