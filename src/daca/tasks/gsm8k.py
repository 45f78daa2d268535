"""GSM8K: grade-school math word problems with a numeric answer.

Rows ``{"question", "answer"}``; ``answer`` is the full reference solution ending ``#### n`` (as
in the dataset) or a bare number. A completion is right when the last number of its answer span
(commas, currency and units ignored) equals the gold number. Training rewards follow d1
(METHOD.md §5): correctness 2.0 + integer answer 0.5 + strict format 0.5 + soft format 0.5 +
xml-count up to 0.5, with the format defects fixed (see ``daca.tasks.formats``).
"""

from __future__ import annotations

import re
from typing import Any

from daca.tasks import Task
from daca.tasks.common import answer_span, chat_user_message
from daca.tasks.formats import (
    completion_texts,
    hub_rows,
    read_records,
    soft_format_reward,
    strict_format_reward,
    xmlcount_reward,
)
from daca.tasks.mathcheck import numbers_equal

CORRECT_REWARD = 2.0
INTEGER_REWARD = 0.5


def gold_number_text(answer: str) -> str:
    """The gold answer's text: what follows the last ``####``, or all of it (a bare number)."""
    return str(answer).rsplit("####", 1)[-1].strip()


def is_correct(completion: str, answer: str) -> bool:
    """Whether the last number of the completion's answer span equals the gold number."""
    return numbers_equal(gold_number_text(answer), answer_span(completion))


def correctness_reward(prompts, completions, answer, **columns) -> list[float]:
    """2.0 for a right final number, else 0."""
    texts = completion_texts(completions)
    return [CORRECT_REWARD * is_correct(t, a) for t, a in zip(texts, answer, strict=True)]


def integer_reward(prompts, completions, **columns) -> list[float]:
    """0.5 when the answer span is a plain non-negative integer (d1's ``isdigit``, ASCII)."""
    spans = (answer_span(t) for t in completion_texts(completions))
    return [INTEGER_REWARD * bool(re.fullmatch(r"[0-9]+", s)) for s in spans]


def score(completions, answer, **columns) -> list[float]:
    """1.0 for a right final number, else 0.0."""
    texts = completion_texts(completions)
    return [float(is_correct(t, a)) for t, a in zip(texts, answer, strict=True)]


def chat_prompt(row: dict[str, Any]) -> str:
    return chat_user_message(row["question"])


def load(
    split: str = "test", path=None, limit: int | None = None, seed: int = 0
) -> list[dict[str, Any]]:
    """Rows ``{"question", "answer"}`` from a JSONL file, else ``openai/gsm8k`` (config main).

    Rows keep the file's order; ``limit`` takes the first ones (``seed`` is unused: the data
    is fixed).
    """
    if split not in ("train", "test"):
        raise ValueError(f"gsm8k has splits 'train' and 'test', got {split!r}")
    if path is not None:
        rows = read_records(path, ("question", "answer"))
    else:
        rows = hub_rows("openai/gsm8k", "main", split)
    rows = [{"question": r["question"], "answer": r["answer"]} for r in rows]
    return rows if limit is None else rows[:limit]


def make_task() -> Task:
    return Task(
        name="gsm8k",
        load=load,
        chat_prompt=chat_prompt,
        reward_funcs=[
            correctness_reward,
            integer_reward,
            strict_format_reward,
            soft_format_reward,
            xmlcount_reward,
        ],
        score=score,
        columns=("question", "answer"),
    )
