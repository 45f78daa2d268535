"""Tasks: data loaders, prompt builders, training rewards and evaluation metrics.

A reward function has TRL's signature ``f(prompts, completions, **columns) -> list[float]``:
``completions`` are decoded strings and every dataset column arrives as a list, one entry per
completion. ``Task.score`` is the evaluation metric per completion with the same columns.

``get_task(name)`` returns the task object registered under ``name``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

RewardFunc = Callable[..., list[float]]

# name -> "module:attribute" of a zero-argument factory returning a Task
_REGISTRY: dict[str, str | Callable[[], Task]] = {
    "sudoku": "daca.tasks.sudoku:make_task",
    "countdown": "daca.tasks.countdown:make_task",
    "countdown-public": "daca.tasks.countdown:make_public_task",
    "sudoku-trace": "daca.tasks.sudoku_trace:make_task",
    "countdown-trace": "daca.tasks.countdown_trace:make_task",
    "gsm8k": "daca.tasks.gsm8k:make_task",
    "math500": "daca.tasks.math500:make_task",
    "mbpp": "daca.tasks.mbpp:make_task",
    "humaneval": "daca.tasks.humaneval:make_task",
    "json_schema": "daca.tasks.json_schema:make_task",
}


@dataclass
class Task:
    """Everything the trainer and the evaluator need to know about one benchmark.

    Attributes:
        name: registry name (``"sudoku"``, ``"gsm8k"``, ...).
        load: ``load(split="train"|"test", path=None, limit=None, seed=0) -> list[dict]``; each
            row holds the task's columns. ``path`` reads a local file; without it the task
            generates its data (Sudoku, Countdown) or asks ``datasets`` for the hub copy.
        chat_prompt: ``chat_prompt(row) -> str`` the user message for chat models (system prompt
            with the ``<reasoning>…</reasoning><answer>…</answer>`` format, METHOD.md §5).
        compact_prompt: ``compact_prompt(row) -> str`` the short character-level prompt of the
            embedded tiny model, or None when the tiny model does not do this task.
        reward_funcs / reward_weights: training rewards, combined as a weighted sum.
        score: ``score(completions, **columns) -> list[float]`` evaluation metric per completion.
        columns: names of the row fields that reward functions and ``score`` receive.
        executes_code: rewards run model-written code, so training and evaluation check
            first that the sandbox works (``daca.tasks.sandbox.isolation_available``).
        reference_completion: ``reference_completion(row) -> str`` the supervised target of
            ``daca pretrain`` (e.g. a solver's trace then the answer); None: ``row["solution"]``.
        compact_vocabulary: tokens beyond the tiny tokenizer's alphabet that the task's compact
            completions need (characters, and tags kept as one token each).
        trace_steps: ``trace_steps(completion, row) -> [(start, end, right)]`` for a task that
            reasons before it answers: each step written in the reasoning, its character span
            and whether it is right (analysis only, never a reward).
        answer_cells: ``answer_cells(completion, row) -> [(start, end, right)]`` beside
            ``trace_steps``: each graded unit of the answer (a Sudoku blank, a Countdown
            expression), its character span and whether it is right; with ``trace_steps``
            the ground truth of the oracle-credit control (``daca.tasks.credit_labels``).
    """

    name: str
    load: Callable[..., list[dict[str, Any]]]
    chat_prompt: Callable[[dict[str, Any]], str]
    reward_funcs: list[RewardFunc]
    score: RewardFunc
    columns: tuple[str, ...]
    reward_weights: list[float] = field(default_factory=list)
    compact_prompt: Callable[[dict[str, Any]], str] | None = None
    executes_code: bool = False  # its rewards run model-written code: needs daca.tasks.sandbox
    reference_completion: Callable[[dict[str, Any]], str] | None = None
    compact_vocabulary: tuple[str, ...] = ()
    trace_steps: Callable[[str, dict[str, Any]], list[tuple[int, int, bool]]] | None = None
    answer_cells: Callable[[str, dict[str, Any]], list[tuple[int, int, bool]]] | None = None

    def __post_init__(self):
        if not self.reward_weights:
            self.reward_weights = [1.0] * len(self.reward_funcs)
        if len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"task {self.name}: one weight per reward function")


def register_task(name: str, factory: str | Callable[[], Task]) -> None:
    """Make ``get_task(name)`` return ``factory()`` (a callable or a "module:attribute")."""
    _REGISTRY[name] = factory


def task_names() -> list[str]:
    return sorted(_REGISTRY)


def get_task(name: str) -> Task:
    """The task registered under ``name``; a clear error names the valid ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(task_names())}")
    factory = _REGISTRY[name]
    if isinstance(factory, str):
        module, attr = factory.split(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory()
