"""``daca credit``: the mean DPS multiplier by token role, by hand and on a real recorded run."""

import json

import numpy as np
import pytest
from conftest import SMALL_RUN

from daca.cli import main
from daca.tasks import get_task, sudoku_trace
from daca.tools.credit import credit_rows, credit_table, token_roles
from daca.tools.separation import (
    auc,
    graded_tokens,
    separation_table,
    separations,
    sequence_weights,
)

SOLUTION = "1234341221434321"
PUZZLE = "1034340220430321"  # cells 1, 6, 9, 12 blank
SPECIAL = {"[PAD]", "[EOS]"}


def _tokens(text: str) -> list[str]:
    """The tiny tokenizer's tokens of ``text`` (step heads and tags whole)."""
    from daca.models.tiny import build_tokenizer

    tok = build_tokenizer(get_task("sudoku-trace").compact_vocabulary)
    return tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])


def test_token_roles_by_hand():
    # r1c2=2 is right (solution cell 1 is 2), r2c3=4 is wrong (cell 6 is 1).
    text = "<reasoning>\nr1c2=2n r2c3=4n\n</reasoning>\n<answer>\n" + SOLUTION + "\n</answer>"
    tokens = [*_tokens(text), "[EOS]", "[PAD]"]
    steps = sudoku_trace.step_spans(text, SOLUTION)
    assert [right for _, _, right in steps] == [True, False]
    roles = token_roles(tokens, SPECIAL, steps)
    by_token = list(zip(tokens, roles, strict=True))
    assert by_token[0] == ("<reasoning>", {"other"})
    assert by_token[2] == ("r1c2=", {"reasoning", "step right", "first step"})
    assert by_token[3] == ("2", {"reasoning", "step right", "first step"})
    assert by_token[5] == (" ", {"reasoning"})  # the separator belongs to no step
    assert by_token[6] == ("r2c3=", {"reasoning", "step wrong", "later steps"})
    assert by_token[8] == ("n", {"reasoning", "step wrong", "later steps"})
    answer = [t for t, r in by_token if r == {"answer"}]
    assert answer == ["\n", *SOLUTION, "\n"]  # everything inside the tags
    assert by_token[-2:] == [("[EOS]", set()), ("[PAD]", set())]


def test_credit_rows_average_by_role_and_sign():
    text = "<reasoning>\nr1c2=2n\n</reasoning>\n<answer>\n" + SOLUTION + "\n</answer>"
    tokens = _tokens(text)
    n = len(tokens)
    # Completion 0 (A > 0): multiplier 2 on the step's 3 tokens, 1 elsewhere; completion 1
    # (A < 0): 0.5 everywhere; completion 2 (A = 0): left out.
    step = {2, 3, 4}
    record = {
        "task": "sudoku-trace",
        "tokens": [tokens, tokens, tokens],
        "multipliers": [[2.0 if i in step else 1.0 for i in range(n)], [0.5] * n, [9.0] * n],
        "advantages": [1.0, -1.0, 0.0],
        "columns": {"puzzle": [PUZZLE] * 3, "solution": [SOLUTION] * 3},
    }
    rows = {
        (r.role, r.sign): r for r in credit_rows([record], get_task("sudoku-trace").trace_steps)
    }
    assert rows[("step right", "A > 0")].mean == 2.0 and rows[("step right", "A > 0")].tokens == 3
    assert ("step wrong", "A > 0") not in rows
    # reasoning: the step's 3 tokens at 2 and nothing else inside the tags but the newlines
    reasoning = [i for i, r in enumerate(token_roles(tokens, SPECIAL)) if "reasoning" in r]
    expected = sum(2.0 if i in step else 1.0 for i in reasoning) / len(reasoning)
    assert rows[("reasoning", "A > 0")].mean == pytest.approx(expected)
    assert all(r.mean == 0.5 for (_, sign), r in rows.items() if sign == "A < 0")
    # "all" counts the zero-advantage completion too: (3 x 2 + 3 x 0.5 + 3 x 9) / 9
    assert rows[("step right", "all")].mean == pytest.approx(34.5 / 9)
    table = credit_table(list(rows.values()))
    assert "| step right | 3.833 (9) | 2.000 (3) | 0.500 (3) |" in table


@pytest.mark.slow
def test_daca_credit_reads_a_real_run(tmp_path, capsys):
    """Two steps of wd1 + DPS on sudoku-trace with a random tiny LLaDA of the task's vocabulary;
    every recorded step; the table and the plot."""
    from daca.models.tiny import new_tiny, save_tiny

    model, tok = new_tiny(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=96,
        words=get_task("sudoku-trace").compact_vocabulary,
    )  # fmt: skip
    folder = save_tiny(tmp_path / "model", model, tok)
    code = main([
        "train", f"model={folder}", "task=sudoku-trace", f"output_dir={tmp_path}", "name=run",
        *SMALL_RUN, "max_steps=2", "save_rollouts_every=1", "dps.enabled=true", "dps.stride=2",
        "generation.gen_length=64", "generation.block_length=32", "generation.steps=8",
    ])  # fmt: skip
    assert code == 0
    record = json.loads((tmp_path / "run" / "rollouts" / "step-0000002.json").read_text())
    assert set(record["columns"]) == {"puzzle", "solution"}
    capsys.readouterr()
    assert main(["credit", str(tmp_path / "run")]) == 0
    printed = capsys.readouterr().out
    assert "completions of steps 1..2" in printed and "| role |" in printed
    assert "Does DPS tell right tokens from wrong ones?" in printed
    assert (tmp_path / "run" / "credit" / "separation.md").is_file()
    assert (tmp_path / "run" / "credit" / "credit.png").stat().st_size > 1000
    assert main(["credit", str(tmp_path / "run"), "--first-step", "5"]) == 2

    # A model's own rollouts, never trained on: every group of the batches, the weights unchanged.
    out = tmp_path / "fresh"
    assert main([
        "credit", "--model", str(folder), "--task", "sudoku-trace", "--batches", "2",
        "--out", str(out), "--set", *SMALL_RUN, "generation.gen_length=64",
        "generation.block_length=32", "generation.steps=8", "dps.stride=2",
    ]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "sudoku-trace: 8 completions of steps 0..1" in printed  # 2 steps x 4 completions
    assert (out / "credit.md").is_file()
    assert main(["credit"]) == 2 and main(["credit", "x", "--model", "y"]) == 2


def test_auc_by_hand():
    scores = np.array([1.0, 2.0, 3.0, 3.0])
    positive = np.array([False, True, True, False])
    # Pairs (right, wrong): 2>1, 2<3, 3>1, 3=3 (half): 2.5 of 4.
    assert auc(scores, positive) == 0.625
    # The first wrong token counted twice: 2>1 twice, 2<3, 3>1 twice, 3=3: 4.5 of 6.
    assert auc(scores, positive, np.array([2, 1, 1, 1])) == 0.75
    assert np.isnan(auc(scores, np.zeros(4, dtype=bool)))


def test_separation_reads_each_graded_token_of_a_record():
    """One completion, right step r1c2=2 and wrong r2c3=4 born in intervals 0 and 1; its blanks
    right but cell 9 (born in interval 1): the AUCs follow from the scores of those tokens."""
    answer = SOLUTION[:9] + "2" + SOLUTION[10:]
    text = f"<reasoning>\nr1c2=2n r2c3=4n\n</reasoning>\n<answer>\n{answer}\n</answer>"
    tokens = [*_tokens(text), "[EOS]"]
    first_digit = tokens.index("<answer>") + 2
    birth = [0] * len(tokens)
    for n in range(6, 9):  # the wrong step's three tokens
        birth[n] = 5
    birth[first_digit + 9] = 5  # the wrong answer cell
    record = {
        "tokens": [tokens], "columns": {"puzzle": [PUZZLE], "solution": [SOLUTION]},
        "recorded_steps": [0, 4], "birth_step": [birth], "advantages": [0.5],
        "deltas": [[0.3, -0.1]], "multipliers": [[1.5 if b == 0 else 0.7 for b in birth]],
    }  # fmt: skip
    got = graded_tokens([record], get_task("sudoku-trace"))
    assert got.right.tolist() == [True] * 3 + [False] * 3 + [True, True, False, True]
    assert got.unit.tolist() == [0] * 6 + [1] * 4
    assert got.interval.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 1, 0]
    assert got.delta.tolist() == [0.3] * 3 + [-0.1] * 3 + [0.3, 0.3, -0.1, 0.3]
    rows = {(r.units, r.score, r.interval): r for r in separations(got, resamples=20)}
    # Every right token was born in interval 0, every wrong one in 1: a perfect separation.
    assert rows["all units", "δ̄", None].auc == 1.0
    assert rows["all units", "multiplier", None].auc == 1.0
    assert rows["all units", "aligned", None].auc == 1.0  # A > 0: right tokens agree with it
    assert (rows["trace steps", "δ̄", None].positives, rows["trace steps", "δ̄", None].negatives) == (
        3,
        3,
    )
    assert ("all units", "δ̄", 0) not in rows  # interval 0 holds right tokens only
    assert "| birth interval J |" not in separation_table(list(rows.values()))


def test_sequence_weights_by_hand():
    """Each completion's mean multiplier up to its end of sequence, by the sign of A, and the
    net effective advantage sum A·m̄ / sum |A|."""
    record = {
        "tokens": [
            ["a", "[EOS]", "[PAD]"],
            ["a", "b", "[EOS]"],
            ["x", "y", "z"],
            ["q", "[EOS]", "p"],
        ],
        "advantages": [1.0, -0.5, -0.5, 0.0],
        "multipliers": [[2.0, 1.0, 9.0], [0.0, 1.0, 2.0], [1.0, 1.0, 4.0], [5.0, 5.0, 5.0]],
    }
    w = sequence_weights([record])
    # Means 1.5 (A 1), 1.0 (A -0.5), 2.0 (A -0.5, no end of sequence: all three); A = 0 left out.
    assert (w.positive, w.negative, w.completions) == (1.5, 1.5, 3)
    assert w.net == pytest.approx((1.5 - 0.5 - 1.0) / 2.0)
