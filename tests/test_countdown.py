"""Countdown: the safe arithmetic parser, the solver, the generator, the reward and prompts."""

import itertools
import operator
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daca.tasks import get_task
from daca.tasks.arith import ExpressionError, evaluate, tokenize
from daca.tasks.common import SYSTEM_PROMPT
from daca.tasks.countdown import (
    chat_prompt,
    compact_prompt,
    countdown_reward,
    countdown_score,
    generate_problems,
    solve,
    solve_all,
    split_of,
)

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}

# ---------------------------------------------------------------- parser


@pytest.mark.parametrize(
    "text, value, numbers",
    [
        ("2+3*4", 14, [2, 3, 4]),
        ("(2+3)*4", 20, [2, 3, 4]),
        ("10-4-3", 3, [10, 4, 3]),  # left-associative
        ("24/4/2", 3, [24, 4, 2]),
        ("1/3*3", 1, [1, 3, 3]),  # exact, no rounding
        ("7/2", Fraction(7, 2), [7, 2]),
        (" ( 1 +\n 2 ) * ((3)) ", 9, [1, 2, 3]),
        ("6×2÷3−1", 3, [6, 2, 3, 1]),  # × ÷ and the Unicode minus
        ("007+1", 8, [7, 1]),
        ("0/5", 0, [0, 5]),
        ("100-93+16", 23, [100, 93, 16]),
    ],
)
def test_evaluate(text, value, numbers):
    assert evaluate(text) == (Fraction(value), numbers)


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("   \n", "empty"),
        ("1+", "end of expression"),
        ("+1", "expected a number"),  # unary plus
        ("-1+2", "expected a number"),  # unary minus
        ("2*-3", "expected a number"),
        ("(1+2", "missing '\\)'"),
        ("1+2)", "unexpected '\\)'"),
        ("()", "expected a number"),
        ("1 2", "after a complete expression"),
        ("2**3", "expected a number"),
        ("2^3", "unexpected character"),
        ("1.5+1", "unexpected character"),
        ("abc", "unexpected character"),
        ("__import__('os')", "unexpected character"),
        ("٣+1", "unexpected character"),  # non-ASCII digit
        ("5/0", "division by zero"),
        ("5/(3-3)", "division by zero"),
        ("(" * 60 + "1" + ")" * 60, "nested deeper"),
        ("1+" * 600 + "1", "longer than"),
    ],
)
def test_evaluate_rejects(text, message):
    with pytest.raises(ExpressionError, match=message):
        evaluate(text)


def test_expression_error_is_a_value_error_and_tokens_are_normalised():
    assert issubclass(ExpressionError, ValueError)
    assert tokenize("12 × (3÷4)") == [12, "*", "(", 3, "/", 4, ")"]


def expressions():
    """(fully parenthesised text, exact value or None on division by zero, numbers in order)."""
    leaves = st.integers(0, 30).map(lambda n: (str(n), Fraction(n), [n]))

    def combine(children):
        def build(args):
            (lt, lv, ln), (rt, rv, rn), op = args
            undefined = lv is None or rv is None or (op == "/" and rv == 0)
            value = None if undefined else OPS[op](lv, rv)
            return f"({lt}){op}({rt})", value, ln + rn

        return st.tuples(children, children, st.sampled_from("+-*/")).map(build)

    return st.recursive(leaves, combine, max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(expressions())
def test_evaluate_matches_a_reference_evaluator(expr):
    text, value, numbers = expr
    if value is None:
        with pytest.raises(ExpressionError, match="division by zero"):
            evaluate(text)
    else:
        assert evaluate(text) == (value, numbers)


# ---------------------------------------------------------------- solver


def reference_values(numbers):
    """All values of (a o b) o c and a o (b o c) over every ordering, exact rationals."""
    ops = {
        "+": lambda x, y: x + y,
        "-": lambda x, y: x - y,
        "*": lambda x, y: x * y,
        "/": lambda x, y: x / y if y else None,
    }
    values = set()
    for a, b, c in itertools.permutations([Fraction(n) for n in numbers]):
        for f, g in itertools.product(ops.values(), repeat=2):
            left = f(a, b)
            if left is not None and g(left, c) is not None:
                values.add(g(left, c))
            right = g(b, c)
            if right is not None and f(a, right) is not None:
                values.add(f(a, right))
    return values


@pytest.mark.parametrize("numbers", [[3, 5, 7], [1, 2, 7], [4, 4, 2], [20, 1, 13], [6, 3, 0]])
def test_solver_reaches_exactly_the_reference_values(numbers):
    found = solve_all(numbers, exact_division=False)
    assert set(found) == reference_values(numbers)
    for exact in (True, False):
        for target, text in solve_all(numbers, exact_division=exact).items():
            value, used = evaluate(text)  # the minimal-parenthesis text keeps its meaning
            assert value == target and sorted(used) == sorted(numbers)


def test_solver_hand_cases():
    assert solve([3, 5, 7], 22) == "3*5+7"  # shortest, then alphabetical
    assert solve([7, 5, 3], 22) == "3*5+7"  # order of the numbers does not matter
    assert solve([3, 5, 7], 56) == "(3+5)*7"
    assert solve([2, 3, 4], 1000) is None
    assert solve([8, 3, 1], 2) == "8/(1+3)"
    # With 3 numbers exact division loses no integer target, but rational values disappear ...
    rational, exact = solve_all([1, 2, 7], exact_division=False), solve_all([1, 2, 7])
    assert Fraction(7, 2) in rational and Fraction(7, 2) not in exact
    assert {v for v in rational if v.denominator == 1} == set(exact)
    # ... and with 4 the classic 6/(1-3/4) = 24 needs a fraction on the way.
    assert solve([1, 3, 4, 6], 24) is None
    assert evaluate(solve([1, 3, 4, 6], 24, exact_division=False))[0] == 24
    with pytest.raises(ValueError, match="non-negative"):
        solve_all([3, -1, 2])


# ---------------------------------------------------------------- generator


def check_rows(rows, max_number=20, max_target=100):
    for row in rows:
        numbers, target = row["numbers"], row["target"]
        assert len(numbers) == 3 == len(set(numbers))
        assert all(1 <= n <= max_number for n in numbers)
        assert isinstance(target, int) and 1 <= target <= max_target
        value, used = evaluate(row["solution"])
        assert value == target and sorted(used) == sorted(numbers)


def test_generated_problems_are_solvable():
    check_rows(generate_problems(300, seed=4))
    check_rows(generate_problems(100, split="test", seed=4))
    small = generate_problems(50, max_number=6, max_target=10)
    check_rows(small, max_number=6, max_target=10)
    check_rows(generate_problems(100, exact_division=False))


def test_splits_are_disjoint_and_deterministic():
    train = generate_problems(500, split="train", seed=1)
    test = generate_problems(200, split="test", seed=1)
    number_sets = {
        s: {tuple(sorted(r["numbers"])) for r in rows}
        for s, rows in [("train", train), ("test", test)]
    }
    assert not number_sets["train"] & number_sets["test"]
    assert all(split_of(r["numbers"]) == "train" for r in train)
    assert all(split_of(r["numbers"]) == "test" for r in test)
    assert split_of([3, 5, 7]) == split_of([7, 3, 5])
    keys = [(tuple(sorted(r["numbers"])), r["target"]) for r in train]
    assert len(set(keys)) == len(keys)
    assert generate_problems(30, seed=2) == generate_problems(30, seed=2)
    assert generate_problems(30, seed=2) != generate_problems(30, seed=3)
    # Roughly a tenth of all number sets are held out for testing.
    triples = list(itertools.combinations(range(1, 21), 3))
    share = sum(split_of(t) == "test" for t in triples) / len(triples)
    assert 0.05 < share < 0.15


def test_generator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        generate_problems(3, split="dev")
    with pytest.raises(ValueError, match="max_number"):
        generate_problems(3, max_number=2)
    # 1..3 is the only number set and reaches each target 1..5: a sixth problem cannot exist.
    split = split_of([1, 2, 3])
    assert len(generate_problems(5, split=split, max_number=3, max_target=5)) == 5
    with pytest.raises(ValueError, match="found only 5 of 6"):
        generate_problems(6, split=split, max_number=3, max_target=5)
    # Asking for far more than exist gives up after MAX_MISSES draws without a new one.
    with pytest.raises(ValueError, match="found only 5 of 100000000"):
        generate_problems(10**8, split=split, max_number=3, max_target=5)


# ---------------------------------------------------------------- reward


def reward(completions, numbers=(3, 5, 7), target=22, **extra):
    n = len(completions)
    return countdown_reward(
        ["p"] * n, completions, numbers=[list(numbers)] * n, target=[target] * n, **extra
    )


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("3*5+7", 1.0),
        ("7 + 5 × 3", 1.0),
        ("<answer>(3*5)+7</answer>", 1.0),
        ("<reasoning>15 and 7</reasoning>\n<answer>\n3*5\n+7\n</answer>", 1.0),  # multi-line
        ("3*5+7 = 22", 1.0),  # the part before '='
        ("<answer>3 * 5 + 7 = 22</answer>", 1.0),
        ("3*5-7", 0.1),  # wrong value
        ("5*5-3", 0.1),  # 22, but 5 used twice and 7 unused
        ("15+7", 0.1),  # 22, but 15 is not given
        ("3*5+7+0", 0.1),  # an extra number
        ("3*5+7*1", 0.1),
        ("I think 3*5+7 <answer>3*5-7</answer>", 0.1),  # only the tags count
        ("<answer>3*5+7</answer> <answer>3+5+7</answer>", 0.1),  # the last tags count
        ("7/(5-5)+3", 0.0),  # division by zero
        ("", 0.0),
        ("<answer></answer>", 0.0),
        ("= 22", 0.0),
        ("3*5+", 0.0),
        ("-3+5*5", 0.0),  # unary minus is not part of the grammar
        ("twenty-two", 0.0),
    ],
)
def test_reward_hand_checked(completion, expected):
    assert reward([completion]) == [expected]


def test_reward_exact_rationals_and_string_columns():
    assert reward(["3/2*4"], numbers=(2, 3, 4), target=6) == [1.0]
    assert reward(["4/3*3"], numbers=(3, 3, 4), target=4) == [1.0]  # a repeated given number
    out = countdown_reward(["p"], ["3*5+7"], numbers=[["3", "5", "7"]], target=["22"])
    assert out == [1.0]


def test_reward_batch_conversational_and_extra_columns():
    chat = [{"role": "assistant", "content": "<answer>3*5+7</answer>"}]
    out = countdown_reward(
        ["a", "b", "c"],
        [chat, "3+5+7", "oops"],
        numbers=[[3, 5, 7]] * 3,
        target=[22, 22, 22],
        solution=["3*5+7"] * 3,  # generated rows carry this column; it is ignored
    )
    assert out == [1.0, 0.1, 0.0]
    score = countdown_score([chat, "3+5+7", "oops"], numbers=[[3, 5, 7]] * 3, target=[22] * 3)
    assert score == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 completions but 1"):
        countdown_reward(["a", "b"], ["1", "2"], numbers=[[1]], target=[1, 2])


def test_prompts():
    row = {"numbers": [30, 100, 93], "target": 23}
    assert compact_prompt(row) == "30,100,93:23="
    text = chat_prompt(row)
    assert text.startswith(SYSTEM_PROMPT)
    assert "[30, 100, 93]" in text and "23" in text and "<answer>" in text


def test_task_registry_and_load(tmp_path):
    task = get_task("countdown")
    assert task.name == "countdown" and task.columns == ("numbers", "target")
    assert task.reward_funcs == [countdown_reward] and task.score is countdown_score
    rows = task.load("test", limit=4, seed=1, max_target=50)
    assert rows == generate_problems(4, split="test", seed=1, max_target=50)
    assert task.compact_prompt(rows[0]).endswith(f":{rows[0]['target']}=")
    path = tmp_path / "c.jsonl"
    path.write_text('{"input": "30,100,93", "output": "23"}\n{"input": "1,2,3", "output": "6"}\n')
    assert task.load(path=str(path), limit=1) == [{"numbers": [30, 100, 93], "target": 23}]
    with pytest.raises(ValueError, match="do not apply"):
        task.load(path=str(path), max_number=9)
