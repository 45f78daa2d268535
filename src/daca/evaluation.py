"""Rollouts and held-out evaluation of a task, shared by ``pretrain``, ``train``, ``eval`` and
``sample``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from daca.config import GenerationConfig
from daca.models.loading import LoadedModel
from daca.models.prompts import (
    decode_completions,
    fit_prompts,
    pad_prompts,
    prompt_texts,
    prompt_token_ids,
)
from daca.sampler import Rollout, generate
from daca.tasks import Task


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
        gen_length=gen.gen_length,
        steps=gen.steps,
        block_length=gen.block_length,
        temperature=gen.temperature if temperature is None else temperature,
        cfg_scale=gen.cfg_scale,
        remasking=gen.remasking,
        generator=generator,
        dps_stride=dps_stride,
        dps_scope=dps_scope,
        cache=gen.cache,
        parallel_threshold=gen.parallel_threshold,
    )
    texts = decode_completions(bundle, out.completion_ids.cpu())
    return Generated(texts, out, prompt_mask, prompts, cut)


@dataclass
class EvalResult:
    mean: float
    ci95: float  # half-width of the normal-approximation 95 % interval
    scores: list[float]
    completions: list[str]
    prompts: list[str]
    steps: list[int] = field(default_factory=list)  # denoising steps each example took


def mean_ci95(scores: list[float]) -> tuple[float, float]:
    n = len(scores)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(scores) / n
    if n == 1:
        return mean, float("nan")
    var = sum((s - mean) ** 2 for s in scores) / (n - 1)
    return mean, 1.96 * math.sqrt(var / n)


@torch.no_grad()
def evaluate(
    bundle: LoadedModel,
    task: Task,
    rows: list[dict],
    gen: GenerationConfig,
    *,
    batch_size: int = 100,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    progress: bool = False,
    reward_timeout: float | None = 30.0,
) -> EvalResult:
    """The task's metric on ``rows`` (temperature 0 by default, the paper's protocol).

    Scores run guarded (``daca.rewards.score_completions``): an example whose scoring raises or
    overruns ``reward_timeout`` seconds scores 0 and is logged. A task that runs model-written
    code first checks that the sandbox works (``SandboxUnavailable`` says how to fix it).
    """
    from daca.rewards import score_completions

    if task.executes_code:
        from daca.sandbox import isolation_available

        isolation_available()
    was_training = bundle.model.training
    bundle.model.eval()
    scores, completions, prompts, steps = [], [], [], []
    batches = range(0, len(rows), batch_size)
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc=f"eval {task.name}", unit="batch")
    try:
        for start in batches:
            chunk = rows[start : start + batch_size]
            done = rollout(bundle, task, chunk, gen, temperature=temperature, generator=generator)
            columns = {c: [r.get(c) for r in chunk] for c in task.columns}
            scores += score_completions(
                task.score, done.texts, columns, on_error="zero", timeout=reward_timeout
            )
            completions += done.texts
            prompts += done.prompts
            steps += done.rollout.steps_taken.tolist()
    finally:
        bundle.model.train(was_training)
    mean, ci = mean_ci95(scores)
    return EvalResult(mean, ci, scores, completions, prompts, steps)
