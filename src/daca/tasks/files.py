"""Readers and writers for the public task file formats; every error names the file and line.

- Sudoku CSV: header ``Puzzle,Solution``, then one ``puzzle,solution`` pair of 16-character
  row-major strings per line (``0`` = blank) -> rows ``{"puzzle": str, "solution": str}``.
- Countdown JSONL: lines ``{"input": "30,100,93", "output": "23"}`` -> rows
  ``{"numbers": [30, 100, 93], "target": 23}``.
- ``read_jsonl``: any JSONL file of objects, blank lines skipped.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

from daca.tasks.sudoku_grid import is_valid_grid

SUDOKU_HEADER = "Puzzle,Solution"
_INT_RE = re.compile(r"-?[0-9]+")


def _error(path: str | os.PathLike, lineno: int, reason: str) -> ValueError:
    return ValueError(f"{os.fspath(path)}, line {lineno}: {reason}")


def _numbered_objects(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; bad JSON or a non-object raises."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise _error(path, lineno, f"invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise _error(path, lineno, f"expected a JSON object, got {type(row).__name__}")
            yield lineno, row


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """One dict per non-blank line; bad JSON or a non-object raises ValueError naming the line."""
    return [row for _, row in _numbered_objects(path)]


def sudoku_row_problem(puzzle: str, solution: str) -> str | None:
    """Why ``(puzzle, solution)`` is not a valid 4x4 Sudoku pair, or None when it is."""
    if len(puzzle) != 16 or len(solution) != 16:
        return f"puzzle and solution must have 16 characters (got {len(puzzle)}, {len(solution)})"
    if not re.fullmatch(r"[0-4]{16}", puzzle):
        return f"puzzle {puzzle!r} must contain only digits 0-4"
    if not re.fullmatch(r"[1-4]{16}", solution):
        return f"solution {solution!r} must contain only digits 1-4"
    if any(p != "0" and p != s for p, s in zip(puzzle, solution, strict=True)):
        return f"solution {solution!r} disagrees with the givens of puzzle {puzzle!r}"
    if not is_valid_grid(solution):
        return f"solution {solution!r} breaks a row, column or box constraint"
    return None


def read_sudoku_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    """Rows ``{"puzzle", "solution"}`` of a ``Puzzle,Solution`` CSV; every line is validated."""
    rows = []
    with open(path, encoding="utf-8-sig") as f:  # -sig: tolerate a byte-order mark
        header = f.readline().strip()
        if header != SUDOKU_HEADER:
            raise _error(path, 1, f"header must be {SUDOKU_HEADER!r}, got {header!r}")
        for lineno, line in enumerate(f, start=2):
            if not line.strip():
                continue
            fields = [field.strip() for field in line.split(",")]
            if len(fields) != 2:
                raise _error(path, lineno, f"expected 2 comma-separated fields, got {len(fields)}")
            problem = sudoku_row_problem(*fields)
            if problem:
                raise _error(path, lineno, problem)
            rows.append({"puzzle": fields[0], "solution": fields[1]})
    return rows


def write_sudoku_csv(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    """Write rows with ``puzzle`` and ``solution`` in the ``Puzzle,Solution`` format."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(SUDOKU_HEADER + "\n")
        for i, row in enumerate(rows):
            problem = sudoku_row_problem(row["puzzle"], row["solution"])
            if problem:
                raise ValueError(f"row {i}: {problem}")
            f.write(f"{row['puzzle']},{row['solution']}\n")


def _as_int(value: Any) -> int | None:
    """An int from a JSON int or a string of one; None for anything else (bools included)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _INT_RE.fullmatch(value.strip()):
        return int(value)
    return None


def countdown_row(record: dict[str, Any]) -> dict[str, Any]:
    """``{"input": "30,100,93", "output": "23"}`` -> ``{"numbers": [...], "target": 23}``.

    ``input`` may also be a JSON list of integers and ``output`` a JSON integer. Numbers must
    be non-negative (the answer grammar has no unary minus). Raises ValueError otherwise.
    """
    for key in ("input", "output"):
        if key not in record:
            raise ValueError(f"missing key {key!r}")
    raw = record["input"]
    items = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        raise ValueError(f"'input' must be comma-separated integers, got {raw!r}")
    numbers = [_as_int(item) for item in items]
    if any(n is None or n < 0 for n in numbers):
        raise ValueError(f"'input' must be comma-separated non-negative integers, got {raw!r}")
    target = _as_int(record["output"])
    if target is None:
        raise ValueError(f"'output' must be an integer, got {record['output']!r}")
    return {"numbers": numbers, "target": target}


def read_countdown_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows ``{"numbers": list[int], "target": int}`` of a Countdown JSONL file."""
    rows = []
    for lineno, record in _numbered_objects(path):
        try:
            rows.append(countdown_row(record))
        except ValueError as e:
            raise _error(path, lineno, str(e)) from None
    return rows


def write_countdown_jsonl(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    """Write rows with ``numbers`` and ``target`` as ``{"input": "a,b,c", "output": "t"}`` lines."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            record = {
                "input": ",".join(str(int(n)) for n in row["numbers"]),
                "output": str(int(row["target"])),
            }
            f.write(json.dumps(record) + "\n")
