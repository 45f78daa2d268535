"""Tasks that reason before they answer: sudoku-trace and countdown-trace (solver traces,
rewards that never read the reasoning, bad input, the tiny tokenizer's tags, pretraining)."""

import pytest

from daca.models.tiny import build_tokenizer
from daca.shipped import tiny_for_task
from daca.tasks import countdown_trace, get_task, sudoku_trace
from daca.tasks.files import write_sudoku_csv
from daca.tasks.sudoku_grid import PEERS, UNITS

SOLUTION = "1234341221434321"  # rows 1234 / 3412 / 2143 / 4321
PUZZLE = "1034340220430321"  # SOLUTION with cells 1, 6, 9 and 12 blanked
RIGHT = "<reasoning>\nr1c2=2n r2c3=1n\n</reasoning>\n<answer>\n" + SOLUTION + "\n</answer>"


def _unit_cells(rule: str, cell: int) -> list[int]:
    """The row, column or box of ``cell`` that a hidden-single rule names."""
    row, col = divmod(cell, 4)
    box = 2 * (row // 2) + col // 2
    return {"r": UNITS[row], "c": UNITS[4 + col], "b": UNITS[8 + box]}[rule]


def _follows(cells: list[int], cell: int, digit: int, rule: str) -> bool:
    """Independent statement of each rule on the grid so far (0 = blank)."""
    if cells[cell] != 0:
        return False

    def allowed(i: int, d: int) -> bool:
        return cells[i] == 0 and all(cells[j] != d for j in PEERS[i])

    if rule == "n":
        return [d for d in range(1, 5) if allowed(cell, d)] == [digit]
    return [i for i in _unit_cells(rule, cell) if allowed(i, digit)] == [cell]


@pytest.mark.parametrize("split", ["train", "test"])
def test_every_step_of_the_solver_follows_from_the_puzzle_and_the_earlier_steps(split):
    rows = get_task("sudoku-trace").load(split, limit=300, seed=3)
    rules_seen = set()
    for row in rows:
        cells = [int(c) for c in row["puzzle"]]
        for step in sudoku_trace.deduce(row["puzzle"]):
            assert _follows(cells, step.cell, step.digit, step.rule), (row, step)
            assert str(step.digit) == row["solution"][step.cell]
            cells[step.cell] = step.digit
            rules_seen.add(step.rule)
        assert "".join(map(str, cells)) == row["solution"]  # propagation solves them all
    assert "n" in rules_seen


def test_a_hidden_single_is_found_when_no_cell_has_one_candidate():
    # 0001 / 2100 / 0000 / 0002: no blank has one candidate, but in row 1 only r1c3 can take
    # a 2 (column 1, box 1 and column 4 hold one). Two solutions: propagation stops there.
    puzzle = "0001210000000002"
    steps = sudoku_trace.deduce(puzzle)
    cells = [int(c) for c in puzzle]
    for step in steps:
        assert _follows(cells, step.cell, step.digit, step.rule)
        cells[step.cell] = step.digit
    assert [s.text for s in steps] == ["r1c3=2r", "r3c2=2r"]
    assert not sudoku_trace.trace_solves(puzzle)


def test_the_trace_text_names_row_column_digit_and_rule():
    steps = sudoku_trace.deduce(PUZZLE)
    assert [s.text for s in steps] == ["r1c2=2n", "r2c3=1n", "r3c2=1n", "r4c1=4n"]
    completion = sudoku_trace.reference_completion({"puzzle": PUZZLE, "solution": SOLUTION})
    reasoning = "r1c2=2n r2c3=1n r3c2=1n r4c1=4n" + " " * 4 * (10 - 4)
    assert completion.startswith(f"<reasoning>\n{reasoning}\n</reasoning>")
    assert completion.endswith(f"<answer>\n{SOLUTION}\n</answer>")


def test_a_puzzle_without_solution_is_refused():
    with pytest.raises(ValueError, match="no solution"):
        sudoku_trace.deduce("1100000000000000")
    with pytest.raises(ValueError, match="16 digits"):
        sudoku_trace.deduce("12")


def _rewards(task, completions, **columns):
    return [
        [f([""] * len(completions), completions, **columns)[i] * w
         for f, w in zip(task.reward_funcs, task.reward_weights, strict=True)]
        for i in range(len(completions))
    ]  # fmt: skip


def test_sudoku_reward_ignores_what_the_reasoning_says():
    task = get_task("sudoku-trace")
    garbage = "<reasoning>\nr1c1=4b r9c9=9x the moon is 4\n</reasoning>\n<answer>\n"
    completions = [RIGHT, garbage + SOLUTION + "\n</answer>"]
    cols = {"puzzle": [PUZZLE] * 2, "solution": [SOLUTION] * 2}
    right, bad_reasoning = _rewards(task, completions, **cols)
    # d1's Sudoku recipe: correctness (fraction of blanks right) + xml 0.5 + soft + strict 0.5
    assert right == bad_reasoning == [1.0, 0.5, 0.5, 0.5]
    assert task.score(completions, **cols) == [1.0, 1.0]


def test_sudoku_answer_counts_only_inside_the_answer_tags():
    task = get_task("sudoku-trace")
    half = SOLUTION[:1] + "1" + SOLUTION[2:6] + "4" + SOLUTION[7:]  # cells 1 and 6 wrong
    completions = [
        SOLUTION,  # no tags: nothing to read
        f"<reasoning>\n{SOLUTION}\n</reasoning>",  # the grid only in the reasoning
        f"<reasoning>\nx\n</reasoning>\n<answer>\n{half}\n</answer>",
        "<answer>" * 300_000 + "</reasoning>" * 300_000,  # ~10 MB of tags
        "",
    ]
    n = len(completions)
    scores = task.score(completions, puzzle=[PUZZLE] * n, solution=[SOLUTION] * n)
    assert scores == [0.0, 0.0, 0.5, 0.0, 0.0]


def test_step_correctness_reads_the_written_steps_against_the_solution():
    text = "<reasoning>\nr1c2=2n junk r2c3=4 r3c2=1b\n</reasoning>\n<answer>\nr4c1=1\n</answer>"
    assert sudoku_trace.step_correctness(text, SOLUTION) == [True, False, True]


def test_sudoku_trace_reads_the_sudoku_csv_and_names_a_bad_line(tmp_path):
    good = tmp_path / "good.csv"
    write_sudoku_csv(good, [{"puzzle": PUZZLE, "solution": SOLUTION}])
    assert get_task("sudoku-trace").load(path=str(good)) == [
        {"puzzle": PUZZLE, "solution": SOLUTION}
    ]
    bad = tmp_path / "bad.csv"
    bad.write_text(f"Puzzle,Solution\n{PUZZLE},{SOLUTION}\n{PUZZLE}\n")
    with pytest.raises(ValueError, match=r"bad.csv, line 3: expected 2"):
        get_task("sudoku-trace").load(path=str(bad))


def test_countdown_reference_steps_follow_the_order_of_computation():
    assert countdown_trace.reference_steps("(12+7)*3") == ["12+7=19", "19*3=57"]
    assert countdown_trace.reference_steps("20-8/4") == ["8/4=2", "20-2=18"]
    row = {"numbers": [12, 7, 3], "target": 57}
    completion = countdown_trace.reference_completion(row)
    assert completion.startswith("<reasoning>\n")
    assert completion.endswith("\n</answer>")
    assert countdown_trace.grade(completion, [12, 7, 3], 57) == 1.0
    with pytest.raises(ValueError, match="no expression"):
        countdown_trace.solution_of({"numbers": [1, 1, 1], "target": 100})


def test_countdown_reward_is_d1s_and_ignores_the_reasoning():
    task = get_task("countdown-trace")
    fmt = "<reasoning>\n{r}\n</reasoning>\n<answer>\n{a}\n</answer>"
    completions = [
        fmt.format(r="12+7=19 19*3=57", a="(12+7)*3"),
        fmt.format(r="1+1=5 nonsense", a="(12+7)*3"),  # wrong reasoning, right answer
        fmt.format(r="12+7=19", a="12+7+3"),  # well-formed, wrong value
        fmt.format(r="", a="12+"),  # unparsable
        "(12+7)*3",  # no tags
        "<answer>(" * 2_000_000,  # 18 MB, no closing tag
    ]
    n = len(completions)
    rewards = task.reward_funcs[0]([""] * n, completions, numbers=[[12, 7, 3]] * n, target=[57] * n)
    assert rewards == [1.0, 1.0, 0.1, 0.0, 0.0, 0.0]
    assert task.score(completions, numbers=[[12, 7, 3]] * n, target=[57] * n) == [
        1.0, 1.0, 0.0, 0.0, 0.0, 0.0,
    ]  # fmt: skip
    full = _rewards(task, completions[:2], numbers=[[12, 7, 3]] * 2, target=[57] * 2)
    assert full[0] == full[1] == [1.0, 0.5, 0.5, 0.5]


def test_countdown_step_correctness():
    text = "<reasoning>\n12+7=19 19*3=56 4/0=1\n</reasoning><answer>1+1=2</answer>"
    assert countdown_trace.step_correctness(text) == [True, False, False]


def test_the_tiny_tokenizer_keeps_tags_whole_and_round_trips():
    task = get_task("sudoku-trace")
    tok = build_tokenizer(task.compact_vocabulary)
    text = sudoku_trace.reference_completion({"puzzle": PUZZLE, "solution": SOLUTION})
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.unk_token_id not in ids
    assert ids[0] == tok.convert_tokens_to_ids("<reasoning>")
    assert ids[2] == tok.convert_tokens_to_ids("r1c2=")  # a step's head is one token
    # 4 tags, 5 newlines, 10 steps' tokens (3 each, 9 separators), 16 digits: L = 64
    assert len(ids) == 4 + 5 + 39 + 16 == 64
    # without extra words the tokenizer is the shipped models' one, unchanged
    plain = build_tokenizer()
    assert len(plain) == 4 + 19
    assert plain("12+3=", add_special_tokens=False)["input_ids"] == [5, 6, 14, 7, 20]


def test_tiny_means_the_trace_tasks_shipped_models():
    assert tiny_for_task("tiny", "sudoku-trace") == "tiny-sudoku-trace"
    assert tiny_for_task("tiny", "countdown-trace") == "tiny-countdown-trace"
    assert tiny_for_task("some/dir", "countdown-trace") == "some/dir"
    assert tiny_for_task("tiny", "countdown") == "tiny-countdown"


@pytest.mark.parametrize("task", ["sudoku-trace", "countdown-trace"])
def test_the_shipped_trace_models_reason_in_two_blocks_at_the_papers_ratio(task):
    """The run takes the model's lengths: L 64 in two blocks of 32, steps = L / 2."""
    from daca.train.config import load_config

    cfg = load_config(None, [f"task={task}"])
    g = cfg.generation
    assert cfg.model == f"tiny-{task}"
    assert (g.gen_length, g.block_length, g.steps) == (64, 32, 32)


@pytest.mark.slow
def test_a_pretrained_trace_model_loads_as_llada_and_evaluates(tmp_path, capsys):
    """Two pretraining steps at L 128 in 4 blocks: the saved model loads through the LLaDA
    path and ``daca eval`` reads the Sudoku CSV, printing L and block."""
    from daca.cli import main
    from daca.models.loading import load
    from daca.tools.pretrain import PretrainConfig, pretrain

    out = tmp_path / "model"
    cfg = PretrainConfig(
        task="sudoku-trace", out=str(out), max_steps=2, batch_size=4, eval_every=2,
        eval_size=2, train_size=8, target_accuracy=None, hidden_size=32, num_layers=1,
        num_heads=2, intermediate_size=64, gen_length=128, steps=64, block_length=32,
    )  # fmt: skip
    pretrain(cfg, progress=False, log=lambda *a: None)
    bundle = load(str(out))
    assert bundle.family == "llada"
    assert type(bundle.model).__name__ == "LLaDAForDiffusionLM"
    data = tmp_path / "p.csv"
    write_sudoku_csv(data, [{"puzzle": PUZZLE, "solution": SOLUTION}])
    code = main([
        "eval", "--task", "sudoku-trace", "--model", str(out), "--data-file", str(data),
        "--gen-length", "128", "--steps", "64", "--block-length", "32",
        "--out", str(tmp_path / "eval.jsonl"),
    ])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    assert "L=128" in printed and "block=32" in printed
