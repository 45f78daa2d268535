"""4x4 Sudoku that reasons before it answers: a solver's deduction trace, then the grid.

The completion is d1's format (METHOD.md §5)::

    <reasoning>
    r1c2=2n r2c3=1r r3c1=4b
    </reasoning>
    <answer>
    1234341221434321
    </answer>

Each step ``r{row}c{col}={digit}{rule}`` fills one blank, in the order a constraint-propagation
solver finds them (``deduce``): the rule that forced it is ``n`` (naked single: the only digit
its row, column and box leave) or ``r``/``c``/``b`` (hidden single: the only cell of its
row/column/box that can take the digit). Rows and data files are those of ``sudoku`` (the same
``Puzzle,Solution`` CSV), so the two tasks are scored on the same puzzles.

Rewards follow d1's Sudoku recipe: the fraction of the puzzle's blanks filled correctly in the
answer tags (no tags: 0), plus d1's three format terms (xml count, soft and strict format). The
reasoning is never scored for its content: a model is free to reason badly, as at scale.
``step_correctness`` reads the steps back, for analysis only (which steps were right).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from daca.tasks import Task, sudoku
from daca.tasks.common import (
    FORMAT_VOCABULARY,
    answer_tag_bounds,
    answer_tag_span,
    chat_user_message,
    check_lengths,
    completion_text,
)
from daca.tasks.formats import soft_format_reward, strict_format_reward, xmlcount_reward
from daca.tasks.sudoku_grid import PEERS, UNITS

# Rule letters of a step; the units of UNITS come in this order: 4 rows, 4 columns, 4 boxes.
RULES = {"n": "naked single", "r": "hidden single (row)", "c": "hidden single (column)",
         "b": "hidden single (box)"}  # fmt: skip
_UNIT_RULES = "r" * 4 + "c" * 4 + "b" * 4
# One step of a written trace; a model's reasoning may hold anything, only these are read back.
_STEP_RE = re.compile(r"r([1-4])c([1-4])=([0-9])([nrcb]?)")
_ANSWER_RE = re.compile(r"[0-9]{16}")


@dataclass(frozen=True)
class Deduction:
    """One solver step: ``digit`` goes into ``cell`` (row-major 0-15), forced by ``rule``."""

    cell: int
    digit: int
    rule: str

    @property
    def text(self) -> str:
        return f"r{self.cell // 4 + 1}c{self.cell % 4 + 1}={self.digit}{self.rule}"


def candidates(cells: list[int], i: int) -> set[int]:
    """Digits blank cell ``i`` can still take: those no peer holds."""
    return {1, 2, 3, 4} - {cells[j] for j in PEERS[i]}


def _next_deduction(cells: list[int]) -> Deduction | None:
    """The lowest-index naked single, else the first hidden single (units in UNITS order,
    digits ascending), else None (the puzzle needs a guess)."""
    blanks = [i for i in range(16) if cells[i] == 0]
    for i in blanks:
        options = candidates(cells, i)
        if len(options) == 1:
            return Deduction(i, options.pop(), "n")
    for unit, rule in zip(UNITS, _UNIT_RULES, strict=True):
        for digit in range(1, 5):
            if any(cells[i] == digit for i in unit):
                continue
            places = [i for i in unit if cells[i] == 0 and digit in candidates(cells, i)]
            if len(places) == 1:
                return Deduction(places[0], digit, rule)
    return None


def deduce(puzzle: str) -> list[Deduction]:
    """The solver's trace of ``puzzle``: one deduction per blank it fills, in order.

    It stops early when no single is left (the rest would need a guess); ``trace_solves``
    tells whether it filled every blank. Singles are sound, so on a solvable puzzle every step
    agrees with every solution; a puzzle with no solution raises ValueError.
    """
    if sudoku.count_solutions(puzzle, limit=1) == 0:
        raise ValueError(f"puzzle {puzzle!r} has no solution")
    cells = [int(c) for c in puzzle]
    steps: list[Deduction] = []
    while (step := _next_deduction(cells)) is not None:
        cells[step.cell] = step.digit
        steps.append(step)
    return steps


def trace_solves(puzzle: str) -> bool:
    """Whether propagation alone (``deduce``) fills every blank of ``puzzle``."""
    return len(deduce(puzzle)) == puzzle.count("0")


# The compact (tiny-model) vocabulary holds each step's head ``r1c3=`` as one token, so a step
# ``r1c3=2n`` is 3 tokens and a space separates steps: 10 steps (the generator's most blanks)
# take 39 tokens, and a completion is exactly 64 (L = 64, two blocks of 32).
STEP_HEADS = tuple(f"r{r}c{c}=" for r in range(1, 5) for c in range(1, 5))
MAX_STEPS = 10
# The reasoning of ``reference_completion`` is padded with 4 spaces per step short of
# MAX_STEPS (the tokens of one step and its separator), so that the answer starts at the same
# position whatever the number of steps: a tiny model then copies the givens at a fixed offset.
_STEP_PAD = "    "


def reference_completion(row: dict[str, Any]) -> str:
    """The solver's completion for ``row``: its trace (padded to MAX_STEPS steps' tokens),
    then the solution (pretraining target)."""
    steps = [step.text for step in deduce(row["puzzle"])]
    trace = " ".join(steps) + _STEP_PAD * max(0, MAX_STEPS - len(steps))
    return f"<reasoning>\n{trace}\n</reasoning>\n<answer>\n{row['solution']}\n</answer>"


def parse_answer(completion: str) -> str | None:
    """The 16 digits inside the last answer tags (whitespace, ``|`` and ``,`` dropped), or None
    when there are no tags or the span is not 16 digits."""
    span = answer_tag_span(completion)
    if span is None:
        return None
    digits = re.sub(r"[\s|,]", "", span)
    return digits if _ANSWER_RE.fullmatch(digits) else None


def step_spans(completion: str, solution: str) -> list[tuple[int, int, bool]]:
    """Each step written in the reasoning as (start, end, right): its character span in the
    completion and whether its digit is the solution's (the puzzle has one solution, so a
    right step is one the solver could justify). Analysis only."""
    text = completion_text(completion)
    end = text.find("</reasoning>")
    reasoning = text[: end if end >= 0 else len(text)]
    return [
        (m.start(), m.end(), solution[4 * (int(m[1]) - 1) + int(m[2]) - 1] == m[3])
        for m in _STEP_RE.finditer(reasoning)
    ]


def answer_cell_spans(completion: str, puzzle: str, solution: str) -> list[tuple[int, int, bool]]:
    """Each blank cell's digit in the answer as (start, end, right): its character span in the
    completion and whether it is the solution's (the cells the reward counts; givens are not
    graded). An answer that does not parse to 16 digits (reward 0) has every digit wrong.
    Analysis and the oracle-credit control only."""
    text = completion_text(completion)
    bounds = answer_tag_bounds(text)
    if bounds is None:
        return []
    digits = [m.start() + bounds[0] for m in re.finditer(r"[0-9]", text[bounds[0] : bounds[1]])]
    if parse_answer(text) is None:
        return [(at, at + 1, False) for at in digits]
    return [
        (at, at + 1, text[at] == solution[cell])
        for cell, at in enumerate(digits)
        if puzzle[cell] == "0"
    ]


def step_correctness(completion: str, solution: str) -> list[bool]:
    """For each step written in the reasoning, whether it is right (``step_spans``)."""
    return [right for _, _, right in step_spans(completion, solution)]


def trace_sudoku_score(
    completions: list, *, puzzle: list[str], solution: list[str], **kwargs: Any
) -> list[float]:
    """Evaluation metric: blank-cell accuracy of the grid in the answer tags (0 without)."""
    check_lengths(completions, puzzle=puzzle, solution=solution)
    return [
        sudoku.cell_accuracy(parse_answer(completion_text(c)), p, s)
        for c, p, s in zip(completions, puzzle, solution, strict=True)
    ]


def trace_sudoku_reward(
    prompts: list, completions: list, *, puzzle: list[str], solution: list[str], **kwargs: Any
) -> list[float]:
    """Correctness reward (TRL signature): ``trace_sudoku_score``, in [0, 1]."""
    return trace_sudoku_score(completions, puzzle=puzzle, solution=solution)


def chat_prompt(row: dict[str, Any]) -> str:
    """The chat model's user message: the puzzle, the trace's step format, the answer format."""
    puzzle = row["puzzle"]
    question = (
        "Solve this 4x4 Sudoku puzzle (digits 1-4; every row, column and 2x2 box holds each "
        f"digit once). The puzzle, row by row, 0 for an empty cell: {puzzle}.\n\n"
        "In the reasoning, fill the empty cells one at a time as steps like r1c3=2n: row 1, "
        "column 3 takes 2, with the rule that forces it (n: the only digit left for the cell; "
        "r, c or b: the only place for the digit in its row, column or box). Then give the "
        "solved grid as 16 digits in the answer."
    )
    return chat_user_message(question)


def make_task() -> Task:
    return Task(
        name="sudoku-trace",
        load=sudoku.load,
        chat_prompt=chat_prompt,
        reward_funcs=[
            trace_sudoku_reward,
            xmlcount_reward,
            soft_format_reward,
            strict_format_reward,
        ],
        score=trace_sudoku_score,
        columns=("puzzle", "solution"),
        compact_prompt=sudoku.compact_prompt,
        reference_completion=reference_completion,
        compact_vocabulary=(*FORMAT_VOCABULARY, *STEP_HEADS, "r", "c", "n", "b"),
        trace_steps=lambda completion, row: step_spans(completion, row["solution"]),
        answer_cells=lambda completion, row: answer_cell_spans(
            completion, row["puzzle"], row["solution"]
        ),
    )
