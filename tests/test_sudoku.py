"""4x4 Sudoku: grids, solver, generator, reward parsing and prompts."""

import itertools

import numpy as np
import pytest

from daca.tasks import get_task
from daca.tasks.common import SYSTEM_PROMPT
from daca.tasks.sudoku import (
    all_grids,
    chat_prompt,
    compact_prompt,
    count_solutions,
    generate_puzzles,
    parse_answer,
    split_grids,
    sudoku_reward,
    sudoku_score,
)
from daca.tasks.sudoku_grid import is_valid_grid

SOLUTION = "1234341221434321"  # rows 1234 / 3412 / 2143 / 4321
PUZZLE = "1034340220430321"  # SOLUTION with cells 1, 6, 9 and 12 blanked


def reference_grids() -> np.ndarray:
    """All valid grids, built independently: stack permutation rows, pruning on columns/boxes."""
    perms = [np.array(p) for p in itertools.permutations(range(1, 5))]

    def ok(rows: list) -> bool:
        g = np.array(rows)
        boxes = [g[r : r + 2, c : c + 2].ravel() for r in range(0, len(g), 2) for c in (0, 2)]
        units = [g[:, c] for c in range(4)] + boxes
        return all(len(set(u)) == u.size for u in units)

    partial = [[]]
    for _ in range(4):
        partial = [rows + [p] for rows in partial for p in perms if ok(rows + [p])]
    return np.array([np.concatenate(rows) for rows in partial])


@pytest.fixture(scope="module")
def ref_grids():
    return reference_grids()


def brute_force_count(puzzle: str, grids: np.ndarray) -> int:
    """How many valid grids agree with the puzzle's givens."""
    p = np.array([int(c) for c in puzzle])
    return int(((grids == p) | (p == 0)).all(axis=1).sum())


def to_str(grid) -> str:
    return "".join(str(int(d)) for d in grid)


def test_all_grids_are_the_288_valid_grids(ref_grids):
    assert len(ref_grids) == 288
    grids = all_grids()
    assert len(grids) == 288 == len(set(grids))
    assert set(grids) == {to_str(g) for g in ref_grids}
    assert list(grids) == sorted(grids)


def test_is_valid_grid_hand_cases():
    assert is_valid_grid(SOLUTION)
    assert not is_valid_grid("2134341221434321")  # first two cells swapped: columns break
    assert not is_valid_grid("1234123412341234")  # rows fine, columns repeat
    assert not is_valid_grid("1234341221434325")  # digit 5
    assert not is_valid_grid(PUZZLE)  # blanks
    assert not is_valid_grid(SOLUTION[:15])


def test_count_solutions_hand_cases(ref_grids):
    assert count_solutions(SOLUTION) == 1
    assert count_solutions(PUZZLE) == 1
    # Cells 0, 1, 8, 9 hold 12/21: swapping them gives a second valid grid.
    two = "0034341200434321"
    assert count_solutions(two) == 2 == brute_force_count(two, ref_grids)
    assert count_solutions("0" * 16) == 2  # capped at the default limit
    assert count_solutions("0" * 16, limit=1000) == 288
    assert count_solutions("1100" + "0" * 12) == 0  # clashing givens
    assert count_solutions("1" + "0" * 15, limit=1000) == 72
    with pytest.raises(ValueError, match="16 digits"):
        count_solutions("12345")


def test_generated_puzzles_are_valid_and_unique(ref_grids):
    rows = generate_puzzles(300, seed=3, min_blanks=4, max_blanks=12)
    blanks = []
    for row in rows:
        puzzle, solution = row["puzzle"], row["solution"]
        assert is_valid_grid(solution)
        assert all(p in ("0", s) for p, s in zip(puzzle, solution, strict=True))
        blanks.append(puzzle.count("0"))
        assert brute_force_count(puzzle, ref_grids) == 1
    assert min(blanks) == 4 and max(blanks) >= 11
    assert len({r["puzzle"] for r in rows}) == len(rows)


def test_blank_count_and_non_unique_option(ref_grids):
    rows = generate_puzzles(50, min_blanks=8, max_blanks=8)
    assert {r["puzzle"].count("0") for r in rows} == {8}
    loose = generate_puzzles(200, min_blanks=12, max_blanks=14, unique=False)
    counts = [brute_force_count(r["puzzle"], ref_grids) for r in loose]
    assert min(counts) >= 1 and max(counts) > 1  # the solution always fits; some are ambiguous


def test_splits_are_disjoint_and_cover_all_grids():
    train, test = split_grids("train"), split_grids("test")
    assert len(train) == 240 and len(test) == 48
    assert set(train) | set(test) == set(all_grids()) and not set(train) & set(test)
    train_rows = generate_puzzles(1000, split="train", seed=1)
    test_rows = generate_puzzles(200, split="test", seed=1)
    assert {r["solution"] for r in train_rows} <= set(train)
    assert {r["solution"] for r in test_rows} <= set(test)
    assert not {r["puzzle"] for r in train_rows} & {r["puzzle"] for r in test_rows}


def test_generation_is_deterministic_by_seed():
    assert generate_puzzles(20, seed=5) == generate_puzzles(20, seed=5)
    assert generate_puzzles(20, seed=5) != generate_puzzles(20, seed=6)


def test_generator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at most 12"):
        generate_puzzles(5, max_blanks=13)
    with pytest.raises(ValueError, match="min_blanks"):
        generate_puzzles(5, min_blanks=8, max_blanks=6)
    with pytest.raises(ValueError, match="split"):
        generate_puzzles(5, split="valid")
    # Only 48 test grids, hence only 48 distinct puzzles without blanks.
    assert len(generate_puzzles(48, split="test", min_blanks=0, max_blanks=0)) == 48
    with pytest.raises(ValueError, match="found only 48 of 49"):
        generate_puzzles(49, split="test", min_blanks=0, max_blanks=0)


def reward(completions, puzzle=PUZZLE, solution=SOLUTION, **extra):
    n = len(completions)
    return sudoku_reward(
        ["p"] * n, completions, puzzle=[puzzle] * n, solution=[solution] * n, **extra
    )


@pytest.mark.parametrize(
    "completion, expected",
    [
        (SOLUTION, 1.0),
        ("1134341221434321", 0.75),  # blank cell 1 wrong
        ("1534340221434321", 0.5),  # blank cells 1 and 6 wrong (5 and 0 still parse)
        ("4234341221434321", 1.0),  # a wrong given is not scored
        (PUZZLE, 0.0),  # blanks left blank
        ("1234 3412 2143 4321", 1.0),  # no tags, spaces
        ("<answer>\n1234\n3412\n2143\n4321\n</answer>", 1.0),  # multi-line answer tags
        ("<reasoning>easy</reasoning>\n<answer>1234|3412|2143|4321</answer>", 1.0),
        ("<answer>1,2,3,4,3,4,1,2,2,1,4,3,4,3,2,1</answer>", 1.0),
        (f"{SOLUTION} <answer>1134341221434321</answer>", 0.75),  # only the tags count
        (f"<answer>{PUZZLE}</answer><answer>{SOLUTION}</answer>", 1.0),  # the last tags
        (SOLUTION[:15], 0.0),  # wrong length
        (SOLUTION + "1", 0.0),
        ("12343412214343a1", 0.0),  # a letter
        ("1234-3412-2143-4321", 0.0),  # '-' is not a separator
        ("", 0.0),
        ("<answer></answer>", 0.0),
    ],
)
def test_reward_hand_checked(completion, expected):
    assert reward([completion]) == [pytest.approx(expected)]


def test_parse_answer_rule():
    assert parse_answer(" 1234\t3412|2143,4321\n") == SOLUTION
    assert parse_answer("1234 3412 2143 432") is None
    assert parse_answer("١٢٣٤٣٤١٢٢١٤٣٤٣٢١") is None  # non-ASCII digits


def test_reward_batch_conversational_and_extra_columns():
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": SOLUTION}]
    out = sudoku_reward(
        ["a", "b"],
        [chat, "0" * 16],
        puzzle=[PUZZLE, PUZZLE],
        solution=[SOLUTION, SOLUTION],
        answer=["ignored", "ignored"],
    )
    assert out == [1.0, 0.0]
    assert sudoku_score(
        [SOLUTION, "1134341221434321"], puzzle=[PUZZLE] * 2, solution=[SOLUTION] * 2
    ) == [1.0, 0.75]
    with pytest.raises(ValueError, match="2 completions but 1"):
        sudoku_reward(["a", "b"], [SOLUTION] * 2, puzzle=[PUZZLE], solution=[SOLUTION] * 2)


def test_puzzle_without_blanks_scores_exact_match():
    assert reward([SOLUTION], puzzle=SOLUTION) == [1.0]
    assert reward(["4234341221434321"], puzzle=SOLUTION) == [0.0]


def test_prompts():
    row = {"puzzle": PUZZLE, "solution": SOLUTION}
    assert compact_prompt(row) == PUZZLE + "="
    text = chat_prompt(row)
    assert text.startswith(SYSTEM_PROMPT)
    assert PUZZLE in text and "<answer>" in text and "4x4" in text
    assert "10 34\n34 02\n\n20 43\n03 21" in text
    assert SOLUTION not in text


def test_task_registry_and_load(tmp_path):
    task = get_task("sudoku")
    assert task.name == "sudoku" and task.columns == ("puzzle", "solution")
    assert task.reward_funcs == [sudoku_reward] and task.score is sudoku_score
    rows = task.load("test", limit=5, seed=2, min_blanks=8, max_blanks=8)
    assert rows == generate_puzzles(5, split="test", seed=2, min_blanks=8, max_blanks=8)
    assert task.compact_prompt(rows[0]) == rows[0]["puzzle"] + "="
    path = tmp_path / "s.csv"
    path.write_text(f"Puzzle,Solution\n{PUZZLE},{SOLUTION}\n{SOLUTION},{SOLUTION}\n")
    assert task.load(path=str(path), limit=1) == [{"puzzle": PUZZLE, "solution": SOLUTION}]
    with pytest.raises(ValueError, match="split"):
        task.load("dev")
    with pytest.raises(ValueError, match="do not apply"):
        task.load(path=str(path), max_blanks=8)
