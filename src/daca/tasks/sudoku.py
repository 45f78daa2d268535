"""4x4 Sudoku (digits 1-4, 2x2 boxes): generator, prompts, reward and metric (METHOD.md §5).

A grid or puzzle is a 16-character row-major string; ``0`` marks a blank. There are exactly 288
valid grids; they are split once, by a fixed permutation (``SPLIT_SEED``), into 240 train and 48
test grids, so no test puzzle (nor its solution) is ever seen in training, whatever the sampling
seed. Rows are ``{"puzzle": str, "solution": str}``.
"""

from __future__ import annotations

import functools
import random
import re
from typing import Any

from daca.tasks import Task
from daca.tasks.common import (
    answer_span,
    chat_user_message,
    check_lengths,
    completion_text,
    generated_or_file,
)
from daca.tasks.files import read_sudoku_csv
from daca.tasks.sudoku_grid import PEERS

SPLIT_SEED = 0
NUM_TRAIN_GRIDS = 240

_PUZZLE_RE = re.compile(r"[0-4]{16}")
_ANSWER_SEPARATORS = re.compile(r"[\s|,]")
_ANSWER_RE = re.compile(r"[0-9]{16}")


def _search(cells: list[int], limit: int) -> int:
    """Number of completions of ``cells`` (0 = blank), counting no further than ``limit``."""
    if 0 not in cells:
        return 1
    i = cells.index(0)
    total = 0
    for digit in range(1, 5):
        if all(cells[j] != digit for j in PEERS[i]):
            cells[i] = digit
            total += _search(cells, limit - total)
            cells[i] = 0
            if total >= limit:
                break
    return total


def count_solutions(puzzle: str, limit: int = 2) -> int:
    """Number of valid grids completing ``puzzle``, capped at ``limit`` (2 decides uniqueness)."""
    if not _PUZZLE_RE.fullmatch(puzzle):
        raise ValueError(f"a puzzle is 16 digits 0-4, got {puzzle!r}")
    cells = [int(c) for c in puzzle]
    # Givens that clash with each other admit no solution (the search only checks blanks).
    if any(cells[i] and cells[i] == cells[j] for i in range(16) for j in PEERS[i]):
        return 0
    return _search(cells, limit)


@functools.cache
def all_grids() -> tuple[str, ...]:
    """The 288 valid 4x4 grids in lexicographic order."""
    grids: list[str] = []

    def fill(cells: list[int], i: int) -> None:
        if i == 16:
            grids.append("".join(map(str, cells)))
            return
        for digit in range(1, 5):
            if all(cells[j] != digit for j in PEERS[i]):
                cells[i] = digit
                fill(cells, i + 1)
                cells[i] = 0

    fill([0] * 16, 0)
    return tuple(grids)


def split_grids(split: str) -> list[str]:
    """The grids of ``split`` ("train": 240, "test": 48); fixed, disjoint, independent of seeds."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    grids = list(all_grids())
    random.Random(SPLIT_SEED).shuffle(grids)
    return grids[:NUM_TRAIN_GRIDS] if split == "train" else grids[NUM_TRAIN_GRIDS:]


def generate_puzzles(
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    min_blanks: int = 4,
    max_blanks: int = 10,
    unique: bool = True,
) -> list[dict[str, str]]:
    """``n`` distinct puzzles from the grids of ``split``, deterministic given ``seed``.

    Each puzzle takes a random grid of the split, a number of blanks uniform in
    [min_blanks, max_blanks] and that many random cells blanked; with ``unique`` a puzzle is
    redrawn until its solution is unique. A 4x4 puzzle needs at least 4 givens to be unique, so
    ``unique`` requires ``max_blanks <= 12``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 0 <= min_blanks <= max_blanks <= 16:
        raise ValueError(
            f"need 0 <= min_blanks <= max_blanks <= 16, got {min_blanks}, {max_blanks}"
        )
    if unique and max_blanks > 12:
        raise ValueError(f"unique puzzles have at most 12 blanks, got max_blanks={max_blanks}")
    grids = split_grids(split)
    rng = random.Random(f"sudoku:{split}:{seed}")
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    for _ in range(1000 * n + 1000):  # bounded: asking for more distinct puzzles than exist fails
        if len(rows) == n:
            return rows
        grid = rng.choice(grids)
        blanks = set(rng.sample(range(16), rng.randint(min_blanks, max_blanks)))
        puzzle = "".join("0" if i in blanks else g for i, g in enumerate(grid))
        if puzzle in seen or (unique and count_solutions(puzzle) != 1):
            continue
        seen.add(puzzle)
        rows.append({"puzzle": puzzle, "solution": grid})
    if len(rows) == n:
        return rows
    raise ValueError(f"found only {len(rows)} of {n} distinct puzzles with these settings")


def parse_answer(completion: str) -> str | None:
    """The 16-digit grid a completion answers, or None when it is unparsable.

    Rule: take ``answer_span`` (inside the last ``<answer>`` tags if present, else the whole
    completion), delete whitespace, ``|`` and ``,``; the rest must be exactly 16 ASCII digits
    0-9 (so a row-per-line grid is accepted). Anything else (other length, letters) is None.
    """
    digits = _ANSWER_SEPARATORS.sub("", answer_span(completion))
    return digits if _ANSWER_RE.fullmatch(digits) else None


def cell_accuracy(answer: str | None, puzzle: str, solution: str) -> float:
    """Fraction of the puzzle's blank cells that ``answer`` fills correctly (METHOD.md §5).

    0 for an unparsable (None) answer. A puzzle without blanks scores 1 if the answer equals
    the solution, else 0.
    """
    if answer is None:
        return 0.0
    blanks = [i for i, p in enumerate(puzzle) if p == "0"]
    if not blanks:
        return float(answer == solution)
    return sum(answer[i] == solution[i] for i in blanks) / len(blanks)


def sudoku_score(
    completions: list, *, puzzle: list[str], solution: list[str], **kwargs: Any
) -> list[float]:
    """Evaluation metric: blank-cell accuracy of each completion (``parse_answer`` rule)."""
    check_lengths(completions, puzzle=puzzle, solution=solution)
    return [
        cell_accuracy(parse_answer(completion_text(c)), p, s)
        for c, p, s in zip(completions, puzzle, solution, strict=True)
    ]


def sudoku_reward(
    prompts: list, completions: list, *, puzzle: list[str], solution: list[str], **kwargs: Any
) -> list[float]:
    """Training reward (TRL signature): fraction of blanks filled correctly, 0 if unparsable."""
    return sudoku_score(completions, puzzle=puzzle, solution=solution)


def compact_prompt(row: dict[str, Any]) -> str:
    """The tiny model's prompt: the puzzle then ``=``; its completion is the full 16-digit grid."""
    return f"{row['puzzle']}="


def chat_prompt(row: dict[str, Any]) -> str:
    """The chat model's user message: rules, the puzzle as a string and as a grid, answer format."""
    puzzle = row["puzzle"]
    lines = [f"{puzzle[r : r + 2]} {puzzle[r + 2 : r + 4]}" for r in range(0, 16, 4)]
    grid = "\n".join(lines[:2] + [""] + lines[2:])  # blank line between the box rows
    question = (
        "Solve this 4x4 Sudoku puzzle. Fill every empty cell with a digit from 1 to 4 so that "
        "each row, each column and each of the four 2x2 boxes contains 1, 2, 3 and 4 exactly "
        "once.\n\n"
        f"The puzzle is the 16-character string {puzzle}, read left to right and top to "
        "bottom, where 0 marks an empty cell. As a grid (boxes separated by spaces):\n\n"
        f"{grid}\n\n"
        "Give the complete solved grid as one string of 16 digits, row by row, inside "
        "<answer></answer> tags."
    )
    return chat_user_message(question)


def load(
    split: str = "train",
    path: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    **gen_kwargs: Any,
) -> list[dict[str, str]]:
    """Rows of a ``Puzzle,Solution`` CSV at ``path`` (``split`` then only names it), else
    ``limit`` (default 2000 train / 200 test) generated puzzles; ``gen_kwargs`` go to
    ``generate_puzzles`` (``min_blanks``, ``max_blanks``, ``unique``)."""
    return generated_or_file(
        split, path, limit, seed, gen_kwargs, read_file=read_sudoku_csv, generate=generate_puzzles
    )


def make_task() -> Task:
    return Task(
        name="sudoku",
        load=load,
        chat_prompt=chat_prompt,
        reward_funcs=[sudoku_reward],
        score=sudoku_score,
        columns=("puzzle", "solution"),
        compact_prompt=compact_prompt,
    )
