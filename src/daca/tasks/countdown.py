"""Countdown with 3 numbers: generator, brute-force solver, prompts, reward and metric.

A row is ``{"numbers": [a, b, c], "target": t, "solution": "a*b-c"}``: an expression with + - * /
and parentheses that uses each number exactly once must equal ``t``. Generated numbers are
distinct integers in [1, max_number] and targets are integers in [1, max_target] reachable under
the chosen rules. Train and test split by the multiset of numbers (a fixed hash, independent of
the sampling seed), so no (numbers, target) pair - not even a set of numbers - is in both.
Answers are evaluated exactly by ``daca.tasks.arith`` (never ``eval``); METHOD.md §5 rewards.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import random
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from daca.tasks import Task
from daca.tasks.arith import ExpressionError, evaluate
from daca.tasks.common import (
    GENERATED_SIZES,
    answer_span,
    chat_user_message,
    check_lengths,
    completion_text,
    generated_or_file,
)
from daca.tasks.files import read_countdown_jsonl

TEST_PER_MILLE = 100  # share of number sets that belong to the test split
# Number and target ranges of the generator: "tiny", the embedded model's own task (numbers in
# 1-20); "public", the public benchmark's distribution (d1's Countdown test set: 3 numbers in
# 1-100, integer targets in 1-100), registered as the task "countdown-public".
PRESETS = {
    "tiny": {"max_number": 20, "max_target": 100},
    "public": {"max_number": 100, "max_target": 100},
}
# Consecutive draws without a new problem after which the generator gives up, so that asking
# for more problems than a split holds (the tiny preset's train split: 11,522) fails in seconds.
MAX_MISSES = 100_000
CORRECT_REWARD = 1.0
WELL_FORMED_REWARD = 0.1

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
# An expression while solving: (value, text, precedence of its top operator; 2 = a number).
_Item = tuple[Fraction, str, int]


def _combine(x: _Item, y: _Item, op: str, exact_division: bool) -> _Item | None:
    """``x op y`` with the fewest parentheses that keep its meaning; None if not allowed."""
    (xv, xt, xp), (yv, yt, yp) = x, y
    if op == "/" and (yv == 0 or (exact_division and xv % yv != 0)):
        return None
    value = _OPS[op](xv, yv)
    prec = 0 if op in "+-" else 1
    # Left operand: needs parentheses only under * or / when it is a sum or difference.
    left = f"({xt})" if xp < prec else xt
    # Right operand: also when equal precedence but the operator does not associate (- and /).
    right = f"({yt})" if yp < prec or (yp == prec and op in "-/") else yt
    return value, f"{left}{op}{right}", prec


def _reachable(items: list[_Item], exact_division: bool) -> list[_Item]:
    """Every expression using all ``items`` once: combine an ordered pair, recurse."""
    if len(items) == 1:
        return items
    out = []
    for i, x in enumerate(items):
        for j, y in enumerate(items):
            if i == j:
                continue
            rest = [z for k, z in enumerate(items) if k not in (i, j)]
            for op in "+-*/":
                combined = _combine(x, y, op, exact_division)
                if combined is not None:
                    out.extend(_reachable([*rest, combined], exact_division))
    return out


def solve_all(numbers: Sequence[int], *, exact_division: bool = True) -> dict[Fraction, str]:
    """Every value an expression over ``numbers`` (each used once) reaches, with the shortest
    such expression (ties broken alphabetically, so the result is deterministic).

    Brute force over all orderings and parenthesisations with + - * /. With ``exact_division``
    a division must leave an integer (classic Countdown; all intermediates are integers);
    otherwise any rational intermediate is allowed. Intermediates may be zero or negative;
    division by zero is never allowed.
    """
    if not numbers or any(int(n) != n or n < 0 for n in numbers):
        raise ValueError(f"numbers must be non-negative integers, got {list(numbers)}")
    return dict(_solve_sorted(tuple(sorted(int(n) for n in numbers)), exact_division))


@functools.lru_cache(maxsize=8192)  # the generator redraws the same number sets many times
def _solve_sorted(numbers: tuple[int, ...], exact_division: bool) -> dict[Fraction, str]:
    best: dict[Fraction, str] = {}
    for value, text, _ in _reachable([(Fraction(n), str(n), 2) for n in numbers], exact_division):
        if value not in best or (len(text), text) < (len(best[value]), best[value]):
            best[value] = text
    return best


def solve(numbers: Sequence[int], target: int, *, exact_division: bool = True) -> str | None:
    """The shortest expression over ``numbers`` equal to ``target``, or None if unsolvable."""
    return solve_all(numbers, exact_division=exact_division).get(Fraction(target))


def split_of(numbers: Sequence[int]) -> str:
    """The split ("train" or "test") of this multiset of numbers: a fixed hash, machine-free."""
    key = ",".join(str(n) for n in sorted(numbers)).encode()
    bucket = int.from_bytes(hashlib.sha256(key).digest()[:4], "big") % 1000
    return "test" if bucket < TEST_PER_MILLE else "train"


def generate_problems(
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    max_number: int = 20,
    max_target: int = 100,
    exact_division: bool = True,
) -> list[dict[str, Any]]:
    """``n`` distinct solvable problems of ``split``, deterministic given ``seed``.

    Each draws 3 distinct numbers in [1, max_number] (redrawn until they belong to ``split``),
    then a target uniformly among the integers in [1, max_target] that they reach (see
    ``solve_all`` for ``exact_division``), and keeps the shortest solution expression.
    """
    if split not in GENERATED_SIZES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if n < 0 or max_number < 3 or max_target < 1:
        raise ValueError(
            f"need n >= 0, max_number >= 3, max_target >= 1; got {n}, {max_number}, {max_target}"
        )
    rng = random.Random(f"countdown:{split}:{seed}")
    rows: list[dict[str, Any]] = []
    seen: set[tuple[tuple[int, ...], int]] = set()
    misses = 0  # draws since the last new problem: asking for more than exist fails quickly
    while len(rows) < n and misses < MAX_MISSES:
        misses += 1
        numbers = rng.sample(range(1, max_number + 1), 3)
        if split_of(numbers) != split:
            continue
        reachable = solve_all(numbers, exact_division=exact_division)
        targets = sorted(int(v) for v in reachable if v.denominator == 1 and 1 <= v <= max_target)
        if not targets:
            continue
        target = rng.choice(targets)
        key = (tuple(sorted(numbers)), target)
        if key in seen:
            continue
        seen.add(key)
        misses = 0
        rows.append({"numbers": numbers, "target": target, "solution": reachable[Fraction(target)]})
    if len(rows) == n:
        return rows
    raise ValueError(f"found only {len(rows)} of {n} distinct problems with these settings")


def answer_expression(completion: str) -> str:
    """The expression part of a completion: ``answer_span`` (tags optional), cut at the first
    ``=`` so that ``"3*5+2 = 17"`` gives ``"3*5+2"``."""
    return answer_span(completion).split("=", 1)[0].strip()


def grade(completion: str, numbers: Sequence[int], target: int) -> float:
    """1.0 if the answer uses exactly ``numbers`` (as a multiset) and equals ``target``; 0.1 if
    it is a well-formed expression that is wrong (value or numbers); 0.0 if it is empty or
    unparsable or divides by zero (METHOD.md §5; unlike d1, tags are not required and a
    division by zero earns nothing)."""
    try:
        value, used = evaluate(answer_expression(completion))
    except ExpressionError:
        return 0.0
    if sorted(used) == sorted(int(x) for x in numbers) and value == int(target):
        return CORRECT_REWARD
    return WELL_FORMED_REWARD


def countdown_reward(
    prompts: list, completions: list, *, numbers: list, target: list, **kwargs: Any
) -> list[float]:
    """Training reward (TRL signature): ``grade`` of each completion (1.0 / 0.1 / 0.0)."""
    check_lengths(completions, numbers=numbers, target=target)
    return [
        grade(completion_text(c), nums, t)
        for c, nums, t in zip(completions, numbers, target, strict=True)
    ]


def countdown_score(
    completions: list, *, numbers: list, target: list, **kwargs: Any
) -> list[float]:
    """Evaluation metric: 1.0 for a correct expression, else 0.0."""
    rewards = countdown_reward([], completions, numbers=numbers, target=target)
    return [float(r == CORRECT_REWARD) for r in rewards]


def compact_prompt(row: dict[str, Any]) -> str:
    """The tiny model's prompt ``"a,b,c:target="``; its completion is the expression."""
    return f"{','.join(str(n) for n in row['numbers'])}:{row['target']}="


def chat_prompt(row: dict[str, Any]) -> str:
    """The chat model's user message: numbers, target, rules and the answer format."""
    numbers = ", ".join(str(n) for n in row["numbers"])
    question = (
        f"Using the numbers [{numbers}], write an arithmetic expression that equals "
        f"{row['target']}. Use each number exactly once; you may use +, -, * and / and "
        "parentheses. Put only the expression inside <answer></answer> tags, for example "
        "<answer>(1 + 2) * 3</answer>."
    )
    return chat_user_message(question)


def load(
    split: str = "train",
    path: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    **gen_kwargs: Any,
) -> list[dict[str, Any]]:
    """Rows of a Countdown JSONL file at ``path`` (``split`` then only names it), else
    ``limit`` (default 2000 train / 200 test) generated problems; ``gen_kwargs`` go to
    ``generate_problems`` (``max_number``, ``max_target``, ``exact_division``)."""
    return generated_or_file(
        split,
        path,
        limit,
        seed,
        gen_kwargs,
        read_file=read_countdown_jsonl,
        generate=generate_problems,
    )


def make_task(preset: str = "tiny") -> Task:
    """The Countdown task on the generator's ``preset`` ranges (a file given to ``load`` is
    read as it is)."""
    ranges = PRESETS[preset]

    def load_preset(split="train", path=None, limit=None, seed=0, **gen_kwargs):
        return load(split, path, limit, seed, **(gen_kwargs if path else ranges | gen_kwargs))

    return Task(
        name="countdown" if preset == "tiny" else f"countdown-{preset}",
        load=load_preset,
        chat_prompt=chat_prompt,
        reward_funcs=[countdown_reward],
        score=countdown_score,
        columns=("numbers", "target"),
        compact_prompt=compact_prompt,
    )


def make_public_task() -> Task:
    return make_task("public")
