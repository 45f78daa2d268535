"""Readers and writers of the public Sudoku CSV and Countdown JSONL formats."""

import json

import pytest

from daca.tasks.countdown import generate_problems
from daca.tasks.files import (
    read_countdown_jsonl,
    read_jsonl,
    read_sudoku_csv,
    write_countdown_jsonl,
    write_sudoku_csv,
)
from daca.tasks.sudoku import generate_puzzles

SOLUTION = "1234341221434321"
PUZZLE = "1034340220430321"


def test_read_jsonl_skips_blank_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"a": 1}\n\n  \n{"b": [2]}\n')
    assert read_jsonl(path) == [{"a": 1}, {"b": [2]}]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"a": 1', "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ("7", "expected a JSON object, got int"),
    ],
)
def test_read_jsonl_names_the_bad_line(tmp_path, bad_line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"ok": 1}\n\n' + bad_line + '\n{"ok": 2}\n')
    with pytest.raises(ValueError, match=f"bad.jsonl, line 3: {message}"):
        read_jsonl(path)


def test_read_sudoku_csv_public_format(tmp_path):
    path = tmp_path / "sudoku.csv"
    # A byte-order mark, Windows line ends and a trailing blank line are tolerated.
    path.write_bytes(
        f"\ufeffPuzzle,Solution\r\n{PUZZLE},{SOLUTION}\r\n{SOLUTION},{SOLUTION}\r\n\r\n".encode()
    )
    assert read_sudoku_csv(path) == [
        {"puzzle": PUZZLE, "solution": SOLUTION},
        {"puzzle": SOLUTION, "solution": SOLUTION},
    ]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        (f"{PUZZLE[:15]},{SOLUTION}", "16 characters"),
        (f"{PUZZLE},{SOLUTION}1", "16 characters"),
        (f"5{PUZZLE[1:]},{SOLUTION}", "only digits 0-4"),
        (f"{PUZZLE},0{SOLUTION[1:]}", "only digits 1-4"),
        (f"{PUZZLE},{SOLUTION[:15]}a", "16 characters|only digits"),
        (f"2{PUZZLE[1:]},{SOLUTION}", "disagrees with the givens"),
        ("1234123412341234,1234123412341234", "row, column or box"),
        (f"{PUZZLE},{SOLUTION},extra", "2 comma-separated fields"),
        (f"{PUZZLE}{SOLUTION}", "2 comma-separated fields"),
    ],
)
def test_read_sudoku_csv_names_the_bad_line(tmp_path, bad_line, message):
    path = tmp_path / "bad.csv"
    path.write_text(f"Puzzle,Solution\n{PUZZLE},{SOLUTION}\n{bad_line}\n{PUZZLE},{SOLUTION}\n")
    with pytest.raises(ValueError, match=f"bad.csv, line 3: .*({message})"):
        read_sudoku_csv(path)


def test_read_sudoku_csv_requires_the_header(tmp_path):
    path = tmp_path / "noheader.csv"
    path.write_text(f"{PUZZLE},{SOLUTION}\n")
    with pytest.raises(ValueError, match="noheader.csv, line 1: header must be 'Puzzle,Solution'"):
        read_sudoku_csv(path)
    path.write_text(f"puzzle,solution\n{PUZZLE},{SOLUTION}\n")
    with pytest.raises(ValueError, match="line 1"):
        read_sudoku_csv(path)


def test_read_countdown_jsonl_public_format(tmp_path):
    path = tmp_path / "countdown.jsonl"
    lines = [
        '{"input": "30,100,93", "output": "23"}',
        "",
        '{"input": "3, 5, 7", "output": 22, "extra": "ignored"}',
        '{"input": [1, 2, 3, 4], "output": "-2"}',
    ]
    path.write_text("\n".join(lines) + "\n")
    assert read_countdown_jsonl(path) == [
        {"numbers": [30, 100, 93], "target": 23},
        {"numbers": [3, 5, 7], "target": 22},
        {"numbers": [1, 2, 3, 4], "target": -2},
    ]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"input": "1,2,3", "output": "6"', "invalid JSON"),
        ('["1,2,3", "6"]', "expected a JSON object"),
        ('{"input": "1,2,3"}', "missing key 'output'"),
        ('{"output": "6"}', "missing key 'input'"),
        ('{"input": "1,x,3", "output": "6"}', "'input' must be"),
        ('{"input": "1,2.5,3", "output": "6"}', "'input' must be"),
        ('{"input": "1,-2,3", "output": "6"}', "'input' must be comma-separated non-negative"),
        ('{"input": "", "output": "6"}', "'input' must be"),
        ('{"input": 123, "output": "6"}', "'input' must be"),
        ('{"input": "1,2,3", "output": "6.5"}', "'output' must be an integer"),
        ('{"input": "1,2,3", "output": true}', "'output' must be an integer"),
        ('{"input": "1,2,3", "output": null}', "'output' must be an integer"),
    ],
)
def test_read_countdown_jsonl_names_the_bad_line(tmp_path, bad_line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input": "1,2,3", "output": "6"}\n\n' + bad_line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl, line 3: {message}"):
        read_countdown_jsonl(path)


def test_sudoku_writer_round_trips(tmp_path):
    rows = generate_puzzles(30, split="test", seed=7)
    path = tmp_path / "out.csv"
    write_sudoku_csv(path, rows)
    assert path.read_text().splitlines()[0] == "Puzzle,Solution"
    assert read_sudoku_csv(path) == rows
    with pytest.raises(ValueError, match="row 1: .*disagrees"):
        write_sudoku_csv(path, [rows[0], {"puzzle": "2" + PUZZLE[1:], "solution": SOLUTION}])


def test_countdown_writer_round_trips(tmp_path):
    rows = generate_problems(30, split="test", seed=7)
    path = tmp_path / "out.jsonl"
    write_countdown_jsonl(path, rows)
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {
        "input": ",".join(map(str, rows[0]["numbers"])),
        "output": str(rows[0]["target"]),
    }
    assert read_countdown_jsonl(path) == [
        {"numbers": r["numbers"], "target": r["target"]} for r in rows
    ]
