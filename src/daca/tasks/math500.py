"""MATH-500: competition math with LaTeX answers, judged by math-verify equivalence.

Rows ``{"problem", "answer", ...}``; ``answer`` is the gold LaTeX (``\\frac{14}{3}``), or a full
solution, whose last ``\\boxed{}`` is then the gold. The prediction is the last ``\\boxed{}`` of the
completion; without one, the text inside the answer tags. Training rewards (METHOD.md §5, d1):
correctness 2.0 + a format reward of 0.5 x (1 for answer tags + 1 for a ``\\boxed{}`` inside the
answer, else 0.5) - d1's check tested for a backspace character (``"\\boxed"`` unescaped) and so
never saw a box; this one does.
"""

from __future__ import annotations

from typing import Any

from daca.tasks import Task
from daca.tasks.common import answer_tag_span, chat_user_message
from daca.tasks.formats import completion_texts, hub_rows, read_records
from daca.tasks.mathcheck import last_boxed, math_equal, warm_up

CORRECT_REWARD = 2.0
FORMAT_UNIT = 0.5
INSTRUCTION = "Solve the following problem step by step. Put the final answer in \\boxed{}."


def gold_answer(answer: str) -> str:
    """The gold LaTeX: the last ``\\boxed{}`` of a full solution, else ``answer`` itself."""
    boxed = last_boxed(str(answer))
    return boxed if boxed is not None else str(answer).strip()


def predicted_answer(completion: str) -> str | None:
    """The last ``\\boxed{}`` of the completion; else the answer tags' text; else None."""
    boxed = last_boxed(completion)
    return boxed if boxed is not None else answer_tag_span(completion)


def is_correct(completion: str, answer: str) -> bool:
    return math_equal(gold_answer(answer), predicted_answer(completion))


def correctness_reward(prompts, completions, answer, **columns) -> list[float]:
    """2.0 when the last boxed answer is equivalent to the gold, else 0."""
    texts = completion_texts(completions)
    return [CORRECT_REWARD * is_correct(t, a) for t, a in zip(texts, answer, strict=True)]


def boxed_format_reward(prompts, completions, **columns) -> list[float]:
    """0.5 x (1 if answer tags + (1 if a ``\\boxed{}`` is in the answer else 0.5)): 0.25-1.0.

    Without answer tags the whole completion is searched for the box (as in d1).
    """
    rewards = []
    for text in completion_texts(completions):
        span = answer_tag_span(text)
        boxed = last_boxed(text if span is None else span) is not None
        rewards.append(FORMAT_UNIT * ((span is not None) + (1.0 if boxed else 0.5)))
    return rewards


def score(completions, answer, **columns) -> list[float]:
    """1.0 when the predicted answer is equivalent to the gold, else 0.0."""
    texts = completion_texts(completions)
    return [float(is_correct(t, a)) for t, a in zip(texts, answer, strict=True)]


# The reward worker imports math-verify when it loads these, not within the first batch's time.
correctness_reward.reward_warmup = score.reward_warmup = warm_up


def chat_prompt(row: dict[str, Any]) -> str:
    return chat_user_message(f"{INSTRUCTION}\n\n{row['problem']}")


def load(
    split: str = "test", path=None, limit: int | None = None, seed: int = 0
) -> list[dict[str, Any]]:
    """MATH-500 rows from a JSONL file, else ``HuggingFaceH4/MATH-500`` (test split only).

    Rows keep all fields of the file; ``limit`` takes the first ones (``seed`` is unused).
    """
    if split != "test":
        raise ValueError(f"MATH-500 has only a 'test' split, got {split!r}")
    if path is not None:
        rows = read_records(path, ("problem", "answer"))
    else:
        rows = hub_rows("HuggingFaceH4/MATH-500", None, "test")
    return rows if limit is None else rows[:limit]


def make_task() -> Task:
    return Task(
        name="math500",
        load=load,
        chat_prompt=chat_prompt,
        reward_funcs=[correctness_reward, boxed_format_reward],
        score=score,
        columns=("problem", "answer"),
    )
