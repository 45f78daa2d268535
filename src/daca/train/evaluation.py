"""Held-out evaluation of a task: ``score_rows`` is the loop (generate, then score, batch by
batch) of ``evaluate`` (``pretrain``, ``eval``, ``sample``) and of ``Trainer.evaluate``, which
shards the held-out set over processes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from daca.models.loading import LoadedModel
from daca.tasks import Task
from daca.train.config import REWARD_TIMEOUT, GenerationConfig
from daca.train.rollout import rollout


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
    reward_timeout: float | None = REWARD_TIMEOUT,
) -> EvalResult:
    """The task's metric on ``rows`` (temperature 0 by default, the paper's protocol).

    Scores run guarded (``daca.tasks.rewards.score_completions``): an example whose scoring
    raises or overruns ``reward_timeout`` seconds scores 0 and is logged. A task that runs
    model-written code first checks that the sandbox works (``SandboxUnavailable`` says how to
    fix it).
    """
    if task.executes_code:
        from daca.tasks.sandbox import isolation_available

        isolation_available()
    result = score_rows(
        bundle,
        task,
        rows,
        gen,
        batch_size=batch_size,
        temperature=temperature,
        generator=generator,
        progress=progress,
        timeout=reward_timeout,
    )
    result.mean, result.ci95 = mean_ci95(result.scores)
    return result


@torch.no_grad()
def score_rows(
    bundle: LoadedModel,
    task: Task,
    rows: list[dict],
    gen: GenerationConfig,
    *,
    model=None,
    batch_size: int = 100,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    on_error: str = "zero",
    on_timeout: str = "zero",
    timeout: float | None = REWARD_TIMEOUT,
    limit: int | None = None,
    truncate: bool = False,
    progress: bool = False,
) -> EvalResult:
    """The evaluation loop of ``evaluate`` and ``Trainer.evaluate``: ``model`` (default
    ``bundle.model``, in eval mode meanwhile) completes ``rows`` ``batch_size`` at a time
    (``daca.train.rollout.rollout``; ``limit`` and ``truncate`` fit the prompts) and the task's
    metric scores them, guarded (``on_error``, ``on_timeout``, ``timeout``). Its mean and
    interval are left NaN."""
    from daca.tasks.rewards import score_completions

    model = bundle.model if model is None else model
    was_training = model.training
    model.eval()
    scores, completions, prompts, steps = [], [], [], []
    batches = range(0, len(rows), batch_size)
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc=f"eval {task.name}", unit="batch")
    try:
        for start in batches:
            chunk = rows[start : start + batch_size]
            done = rollout(
                bundle,
                task,
                chunk,
                gen,
                model=model,
                temperature=temperature,
                generator=generator,
                limit=limit,
                truncate=truncate,
            )
            columns = {c: [r.get(c) for r in chunk] for c in task.columns}
            scores += score_completions(
                task.score,
                done.texts,
                columns,
                on_error=on_error,
                on_timeout=on_timeout,
                timeout=timeout,
            )
            completions += done.texts
            prompts += done.prompts
            steps += done.rollout.steps_taken.tolist()
    finally:
        model.train(was_training)
    return EvalResult(math.nan, math.nan, scores, completions, prompts, steps)
