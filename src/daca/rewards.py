"""Combining a task's reward functions (TRL signature), with errors that name the culprit."""

from __future__ import annotations

import math
import threading

import torch


class RewardError(RuntimeError):
    """A reward function raised or hung; the message names the function and the example."""


class RewardTimeout(Exception):
    """A reward function did not return within the time limit."""


def _name(func) -> str:
    return getattr(func, "__name__", type(func).__name__)


def _within(timeout: float | None, func, **kwargs):
    """``func(**kwargs)``, in a daemon thread when ``timeout`` is set: RewardTimeout after
    ``timeout`` s. A hung call cannot be stopped from Python; its thread is abandoned (a daemon,
    so it does not keep the process alive)."""
    if timeout is None:
        return func(**kwargs)
    box = {}

    def target():
        try:
            box["value"] = func(**kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller below
            box["error"] = e

    worker = threading.Thread(target=target, daemon=True, name=f"reward-{_name(func)}")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise RewardTimeout(f"no answer within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _call(func, prompts, completions, columns, timeout=None) -> list[float]:
    values = _within(timeout, func, prompts=prompts, completions=completions, **columns)
    if len(values) != len(completions):
        raise RewardError(
            f"reward function {_name(func)} returned {len(values)} values "
            f"for {len(completions)} completions"
        )
    return [float(v) for v in values]


def score_rewards(
    funcs,
    weights,
    prompts: list[str],
    completions: list[str],
    columns: dict,
    *,
    on_error="raise",
    timeout: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-function rewards [B, F], their weighted sum [B], and the count of zeroed errors.

    A function that raises on the batch is called example by example to find the failing
    example: ``on_error="raise"`` raises RewardError naming both, ``"zero"`` scores it 0.
    A NaN or infinite reward counts as an error too. ``timeout``: seconds each call may take
    (None: no limit); a function that hangs on the batch is not retried example by example
    (that could take B timeouts): it raises RewardError, or scores the whole batch 0.
    """
    per_func = torch.zeros(len(completions), len(funcs), dtype=torch.float64)
    errors = 0
    for f, func in enumerate(funcs):
        try:
            values = _call(func, prompts, completions, columns, timeout)
            if all(math.isfinite(v) for v in values):
                per_func[:, f] = torch.tensor(values, dtype=torch.float64)
                continue
        except RewardError:
            raise
        except RewardTimeout:
            if on_error == "raise":
                first = repr(completions[0]) if completions else "none"
                raise RewardError(
                    f"reward function {_name(func)} did not return within {timeout:g} s on a "
                    f"batch of {len(completions)} completions (the first: {first}); fix the "
                    f"function, raise reward_timeout, or set on_reward_error=zero to score "
                    f"such batches 0"
                ) from None
            errors += len(completions)  # per_func[:, f] stays 0
            continue
        except Exception:  # noqa: BLE001 - any failure is reported with its example below
            pass
        for i in range(len(completions)):
            one = {k: [v[i]] for k, v in columns.items()}
            try:
                value = _call(func, [prompts[i]], [completions[i]], one, timeout)[0]
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
