"""GSM8K and MATH-500: answer extraction, math-verify equivalence, rewards, format rewards."""

import sys
import threading
import time
from pathlib import Path

import pytest

from daca.tasks import get_task
from daca.tasks.formats import (
    completion_text,
    count_xml,
    soft_format_reward,
    strict_format_reward,
    xmlcount_reward,
)
from daca.tasks.mathcheck import _worker, last_boxed, last_number, math_equal

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def tagged(reasoning: str, answer: str) -> str:
    return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{answer}\n</answer>\n"


def rewards(task, completions, **columns):
    prompts = [""] * len(completions)
    return [f(prompts=prompts, completions=completions, **columns) for f in task.reward_funcs]


# ---- formats -------------------------------------------------------------------------------


def test_completion_text_accepts_strings_and_conversations():
    assert completion_text("abc") == "abc"
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert completion_text(conversation) == "a"
    assert completion_text([]) == ""
    with pytest.raises(ValueError, match="completion"):
        completion_text(3)


def test_format_rewards_work_on_multiline_reasoning():
    good = tagged("step one\nstep two\n\nstep three", "72")
    assert strict_format_reward([""], [good]) == [0.5]
    assert soft_format_reward([""], [good]) == [0.5]
    assert xmlcount_reward([""], [good]) == [0.5]
    # Ending right at the tag (a decoded completion often does) is still strict.
    assert strict_format_reward([""], [good.rstrip("\n")]) == [0.5]
    one_line = "<reasoning>x</reasoning> <answer>72</answer>"
    assert strict_format_reward([""], [one_line]) == [0.0]
    assert soft_format_reward([""], [one_line]) == [0.5]
    assert xmlcount_reward([""], [one_line]) == [0.0]
    for broken in ("72", "<reasoning>\nx\n</reasoning>\n72", "<answer>\n72\n</answer>"):
        assert strict_format_reward([""], [broken]) == [0.0]
        assert soft_format_reward([""], [broken]) == [0.0]


def test_count_xml_by_hand():
    good = tagged("a\nb", "7")
    assert count_xml(good) == 0.5
    assert count_xml(good.rstrip("\n")) == 0.5  # d1 paid 0.501 here
    # 5 characters after "</answer>\n": 0.001 each off the two answer-tag parts.
    assert count_xml(good + "extra") == pytest.approx(0.25 + 2 * (0.125 - 0.005))
    # A long tail cannot push a part below zero.
    assert count_xml(good + "x" * 500) == pytest.approx(0.25)
    assert count_xml("<reasoning>\nonly reasoning\n</reasoning>\n") == 0.25


# ---- GSM8K ---------------------------------------------------------------------------------


def test_last_number_strips_commas_units_and_keeps_signs():
    assert last_number("It costs $1,200.") == 1200
    assert last_number("5-3=2") == 2
    assert last_number("x = -3 degrees") == -3
    assert last_number("50% of 18.00 dollars") == 18
    assert last_number("no digits") is None


def test_gsm8k_rewards_by_hand():
    task = get_task("gsm8k")
    gold = "Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72"
    completions = [
        tagged("She sold 48 in April\nand 24 in May.", "72"),  # right, perfect format
        tagged("Sum it up.", "$72.00"),  # right number with units
        tagged("Sum it up.", "73"),  # wrong
        "The answer is 72",  # right number, no tags at all
        [{"role": "assistant", "content": tagged("r", "1,072")}],  # conversational, wrong
    ]
    got = rewards(task, completions, answer=[gold] * 5, question=["q"] * 5, extra=[0] * 5)
    correctness, integer, strict, soft, xml = got
    assert correctness == [2.0, 2.0, 0.0, 2.0, 0.0]
    assert integer == [0.5, 0.0, 0.5, 0.0, 0.0]
    assert strict == [0.5, 0.5, 0.5, 0.0, 0.5]
    assert soft == [0.5, 0.5, 0.5, 0.0, 0.5]
    assert xml == [0.5, 0.5, 0.5, 0.0, 0.5]
    assert task.score(completions, answer=[gold] * 5) == [1.0, 1.0, 0.0, 1.0, 0.0]
    # A bare gold number and a gold with commas work too.
    assert task.score([tagged("", "1200")], answer=["1,200"]) == [1.0]


def test_gsm8k_loader_and_gold_solution_scores(tmp_path):
    path = DATA / "gsm8k" / "test.jsonl"
    if not path.exists():
        pytest.skip(f"{path} absent (the shared data folder is not mounted)")
    task = get_task("gsm8k")
    rows = task.load("test", path=path, limit=5)
    assert len(rows) == 5 and all(set(r) == {"question", "answer"} for r in rows)
    assert "####" in rows[0]["answer"] and rows[0]["question"] in task.chat_prompt(rows[0])
    golds = [r["answer"] for r in rows]
    reasoning = [a.split("####")[0].strip() for a in golds]
    numbers = [a.split("####")[1].strip() for a in golds]
    right = [tagged(r, n) for r, n in zip(reasoning, numbers, strict=True)]
    assert task.score(right, answer=golds) == [1.0] * 5
    assert task.score([tagged("", a) for a in golds], answer=golds) == [1.0] * 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n\n{"question": "q"}\n')
    with pytest.raises(ValueError, match="line 3: missing answer"):
        task.load("test", path=bad)
    with pytest.raises(ValueError, match="split"):
        task.load("dev", path=path)


def test_hub_loading_gives_clear_errors(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="path="):
        get_task("gsm8k").load("test")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(RuntimeError, match="pip install"):
        get_task("math500").load("test")


# ---- MATH-500 ------------------------------------------------------------------------------


def test_last_boxed_balances_nested_braces():
    assert (
        last_boxed(r"first \boxed{1}, then \boxed{\frac{\sqrt{3}}{2}} done")
        == r"\frac{\sqrt{3}}{2}"
    )
    assert last_boxed(r"\boxed 5 and that's it") == "5"
    assert last_boxed(r"\fbox{x^{2}}") == "x^{2}"
    assert last_boxed(r"\boxed{3} but then \boxed{4") is None  # the final box is cut off
    assert last_boxed("no box; \b backspace is not a box") is None


@pytest.mark.parametrize("pred", [r"\frac12", "0.5", r"\dfrac{1}{2}", "1/2", r"\frac{2}{4}"])
def test_math_equal_agrees_on_equivalent_forms(pred):
    assert math_equal(r"\frac{1}{2}", pred)


def test_math_equal_rejects_different_or_missing_answers():
    assert not math_equal(r"\frac{1}{2}", r"\frac{1}{3}")
    assert not math_equal("[1,2]", "[1,2)")
    assert not math_equal("3", None)
    assert not math_equal("3", "")
    with pytest.raises(ValueError, match="timeout"):
        math_equal("1", "1", timeout=0)


def test_math_equal_from_a_thread_matches_main_thread():
    cases = [(r"\frac12", "0.5"), ("2", r"\sqrt{4}"), ("3", "4"), (r"\pi", "3.14")]
    main = [math_equal(g, p) for g, p in cases]
    assert main == [True, True, False, False]
    out, errors = {}, []

    def work():
        try:
            out["first"] = [math_equal(g, p) for g, p in cases]
            if _worker._proc is not None:  # a dead worker is restarted transparently
                _worker._proc.kill()
                _worker._proc.wait()
            out["after_kill"] = [math_equal(g, p) for g, p in cases]
            start = time.monotonic()
            out["huge"] = math_equal("3", "9^{9^{9^{9}}}", timeout=1)  # bounded, not hung
            out["huge_seconds_ok"] = time.monotonic() - start < 60  # stopped, not left to run
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=600)
    assert not errors
    assert out == {"first": main, "after_kill": main, "huge": False, "huge_seconds_ok": True}


def test_math500_rewards_by_hand():
    task = get_task("math500")
    gold = r"\frac{1}{2}"
    completions = [
        tagged(r"Halve it: \boxed{0.4} is wrong,", r"\boxed{\dfrac{1}{2}}"),  # last box right
        tagged("Plain answer.", "1/2"),  # no box: the answer tags' text
        r"So the answer is \boxed{0.5}.",  # box, no tags
        tagged(r"\boxed{0.5} in reasoning", r"\boxed{3}"),  # last box wrong
        "no answer at all",
    ]
    correctness, fmt = rewards(task, completions, answer=[gold] * 5, problem=["p"] * 5)
    assert correctness == [2.0, 2.0, 2.0, 0.0, 0.0]
    assert fmt == [1.0, 0.75, 0.5, 1.0, 0.25]
    assert task.score(completions, answer=[gold] * 5) == [1.0, 1.0, 1.0, 0.0, 0.0]
    # Gold given as a full solution: its last box is the gold answer.
    solution = r"We get $x = \boxed{\left( 3, \frac{\pi}{2} \right)}$."
    assert task.score([tagged("", r"\boxed{(3, \pi/2)}")], answer=[solution]) == [1.0]


def test_math500_loader_and_gold_scores():
    path = DATA / "math500" / "test.jsonl"
    if not path.exists():
        pytest.skip(f"{path} absent (the shared data folder is not mounted)")
    task = get_task("math500")
    rows = task.load("test", path=path, limit=8)
    assert len(rows) == 8 and {"problem", "answer", "solution"} <= set(rows[0])
    assert r"\boxed{}" in task.chat_prompt(rows[0]) and rows[0]["problem"] in task.chat_prompt(
        rows[0]
    )
    golds = [r["answer"] for r in rows]
    assert task.score([tagged("", f"\\boxed{{{a}}}") for a in golds], answer=golds) == [1.0] * 8
    assert task.score([r["solution"] for r in rows], answer=golds) == [1.0] * 8
    with pytest.raises(ValueError, match="test"):
        task.load("train", path=path)
