"""Countdown that reasons before it answers: the arithmetic steps, then the expression.

The completion is d1's format (METHOD.md §5)::

    <reasoning>
    12+7=19 19*3=57
    </reasoning>
    <answer>
    (12+7)*3
    </answer>

The reasoning lists the binary operations of a solution in the order they are computed
(``reference_steps``). Rows and data files are those of ``countdown`` (the same JSONL), so the
two tasks are scored on the same problems.

Rewards follow d1's Countdown recipe: 1.0 when the expression in the answer tags uses exactly
the given numbers and hits the target, 0.1 when it is well-formed but wrong, 0 without answer
tags or with an unparsable one; plus d1's three format terms (xml count, soft and strict
format). The reasoning is never scored for its content; ``step_correctness`` reads its steps
back for analysis only (is each written equation true).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from daca.tasks import Task, countdown
from daca.tasks.arith import ExpressionError, evaluate_steps
from daca.tasks.common import (
    FORMAT_VOCABULARY,
    answer_tag_bounds,
    answer_tag_span,
    chat_user_message,
    check_lengths,
    completion_text,
)
from daca.tasks.formats import soft_format_reward, strict_format_reward, xmlcount_reward

# One written step ``a op b = c`` (non-negative integers); anything else in the reasoning is
# free text that is never read.
_STEP_RE = re.compile(r"([0-9]{1,12})\s*([-+*/])\s*([0-9]{1,12})\s*=\s*(-?[0-9]{1,12})")


def _number(value: Fraction) -> str:
    return f"{value.numerator}" + ("" if value.denominator == 1 else f"/{value.denominator}")


def reference_steps(expression: str) -> list[str]:
    """The steps ``a+b=c`` of ``expression``, in the order they are computed."""
    _, _, steps = evaluate_steps(expression)
    return [f"{_number(a)}{op}{_number(b)}={_number(v)}" for a, op, b, v in steps]


def solution_of(row: dict[str, Any]) -> str:
    """The row's solution expression: its ``solution`` field, else the solver's shortest one;
    ValueError when the target is unreachable."""
    if row.get("solution"):
        return row["solution"]
    found = countdown.solve(row["numbers"], row["target"])
    if found is None:
        raise ValueError(f"no expression over {row['numbers']} reaches {row['target']}")
    return found


def reference_completion(row: dict[str, Any]) -> str:
    """A solution's completion for ``row``: its steps, then the expression (pretraining target)."""
    expression = solution_of(row)
    steps = " ".join(reference_steps(expression))
    return f"<reasoning>\n{steps}\n</reasoning>\n<answer>\n{expression}\n</answer>"


def grade(completion: str, numbers: list[int], target: int) -> float:
    """d1's grade of the expression inside the answer tags: 1.0 / 0.1 / 0.0 (no tags: 0)."""
    span = answer_tag_span(completion)
    if span is None:
        return 0.0
    return countdown.grade(f"<answer>{span}</answer>", numbers, target)


def step_spans(completion: str) -> list[tuple[int, int, bool]]:
    """Each ``a op b = c`` written in the reasoning as (start, end, right): its character span
    in the completion and whether it is arithmetically true. Analysis only."""
    text = completion_text(completion)
    end = text.find("</reasoning>")
    out = []
    for m in _STEP_RE.finditer(text[: end if end >= 0 else len(text)]):
        a, op, b, c = m.groups()
        try:
            value, _, _ = evaluate_steps(f"{a}{op}{b}")
        except ExpressionError:  # division by zero
            value = None
        out.append((m.start(), m.end(), value == int(c)))
    return out


def answer_spans(completion: str, numbers: list[int], target: int) -> list[tuple[int, int, bool]]:
    """The answer's expression as one graded unit (start, end, right): the stripped text inside
    the last answer tags, right when ``grade`` gives the full reward. Analysis and the
    oracle-credit control only."""
    text = completion_text(completion)
    bounds = answer_tag_bounds(text)
    if bounds is None:
        return []
    inner = text[bounds[0] : bounds[1]]
    start = bounds[0] + len(inner) - len(inner.lstrip())
    end = bounds[0] + len(inner.rstrip())
    if start >= end:
        return []
    return [(start, end, grade(text, numbers, target) == countdown.CORRECT_REWARD)]


def step_correctness(completion: str) -> list[bool]:
    """For each ``a op b = c`` written in the reasoning, whether it is true (``step_spans``)."""
    return [right for _, _, right in step_spans(completion)]


def trace_countdown_reward(
    prompts: list, completions: list, *, numbers: list, target: list, **kwargs: Any
) -> list[float]:
    """Correctness reward (TRL signature): ``grade`` of each completion (1.0 / 0.1 / 0.0)."""
    check_lengths(completions, numbers=numbers, target=target)
    return [
        grade(completion_text(c), nums, t)
        for c, nums, t in zip(completions, numbers, target, strict=True)
    ]


def trace_countdown_score(
    completions: list, *, numbers: list, target: list, **kwargs: Any
) -> list[float]:
    """Evaluation metric: 1.0 for a correct expression in the answer tags, else 0.0."""
    rewards = trace_countdown_reward([], completions, numbers=numbers, target=target)
    return [float(r == countdown.CORRECT_REWARD) for r in rewards]


def chat_prompt(row: dict[str, Any]) -> str:
    """The chat model's user message: numbers, target, the step format, the answer format."""
    numbers = ", ".join(str(n) for n in row["numbers"])
    question = (
        f"Using the numbers [{numbers}], write an arithmetic expression that equals "
        f"{row['target']}. Use each number exactly once with +, -, * and / and parentheses. "
        "In the reasoning, write each operation you compute as a step like 12+7=19; put only "
        "the expression inside the answer tags, for example <answer>(12+7)*3</answer>."
    )
    return chat_user_message(question)


def make_task(preset: str = "tiny") -> Task:
    """Countdown with a reasoning trace, on the generator's ``preset`` ranges."""
    base = countdown.make_task(preset)
    return Task(
        name=base.name.replace("countdown", "countdown-trace"),
        load=base.load,
        chat_prompt=chat_prompt,
        reward_funcs=[
            trace_countdown_reward,
            xmlcount_reward,
            soft_format_reward,
            strict_format_reward,
        ],
        score=trace_countdown_score,
        columns=("numbers", "target"),
        compact_prompt=countdown.compact_prompt,
        reference_completion=reference_completion,
        compact_vocabulary=FORMAT_VOCABULARY,
        trace_steps=lambda completion, row: step_spans(completion),
        answer_cells=lambda completion, row: answer_spans(
            completion, row["numbers"], row["target"]
        ),
    )
