"""Combining a task's reward functions (TRL signature), with errors that name the culprit."""

from __future__ import annotations

import math

import torch


class RewardError(RuntimeError):
    """A reward function raised; the message names the function and the example."""


def _name(func) -> str:
    return getattr(func, "__name__", type(func).__name__)


def _call(func, prompts, completions, columns) -> list[float]:
    values = func(prompts=prompts, completions=completions, **columns)
    if len(values) != len(completions):
        raise RewardError(
            f"reward function {_name(func)} returned {len(values)} values "
            f"for {len(completions)} completions"
        )
    return [float(v) for v in values]


def score_rewards(
    funcs, weights, prompts: list[str], completions: list[str], columns: dict, *, on_error="raise"
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-function rewards [B, F], their weighted sum [B], and the count of zeroed errors.

    A function that raises on the batch is called example by example to find the failing
    example: ``on_error="raise"`` raises RewardError naming both, ``"zero"`` scores it 0.
    A NaN or infinite reward counts as an error too.
    """
    per_func = torch.zeros(len(completions), len(funcs), dtype=torch.float64)
    errors = 0
    for f, func in enumerate(funcs):
        try:
            values = _call(func, prompts, completions, columns)
            if all(math.isfinite(v) for v in values):
                per_func[:, f] = torch.tensor(values, dtype=torch.float64)
                continue
        except RewardError:
            raise
        except Exception:  # noqa: BLE001 - any failure is reported with its example below
            pass
        for i in range(len(completions)):
            one = {k: [v[i]] for k, v in columns.items()}
            try:
                value = _call(func, [prompts[i]], [completions[i]], one)[0]
                if not math.isfinite(value):
                    raise ValueError(f"non-finite reward {value}")
            except Exception as e:  # noqa: BLE001
                if on_error == "raise":
                    raise RewardError(
                        f"reward function {_name(func)} failed on example {i} "
                        f"(prompt {prompts[i]!r}, completion {completions[i]!r}): "
                        f"{type(e).__name__}: {e}"
                    ) from e
                value, errors = 0.0, errors + 1
            per_func[i, f] = value
    total = per_func @ torch.tensor(weights, dtype=torch.float64)
    return per_func.float(), total.float(), errors
