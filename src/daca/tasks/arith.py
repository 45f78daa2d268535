"""A safe, exact arithmetic evaluator for Countdown answers (never ``eval``).

Grammar (recursive descent, usual precedence, left-associative)::

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := INTEGER | "(" expr ")"

INTEGER is a run of ASCII digits (a non-negative integer; leading zeros are read as the integer,
``007`` is 7). Whitespace between tokens is ignored. ``×`` and ``÷`` are read as ``*`` and ``/``
and the Unicode minus ``−`` as ``-``, since chat models write them. Unary minus/plus, decimals,
powers, names and any other character are not part of the grammar: Countdown combines the given
numbers with binary operations only. Values are ``fractions.Fraction`` so ``1/3*3`` is exactly 1.
"""

from __future__ import annotations

import re
from fractions import Fraction

# Guards against pathological inputs (deep nesting would exhaust Python's recursion limit).
MAX_LENGTH = 1000
MAX_DEPTH = 50

_TOKEN_RE = re.compile(r"\s*(?:([0-9]+)|(.))", re.DOTALL)
_SYMBOLS = {
    "+": "+",
    "-": "-",
    "\u2212": "-",
    "*": "*",
    "×": "*",
    "/": "/",
    "÷": "/",
    "(": "(",
    ")": ")",
}


class ExpressionError(ValueError):
    """The text is not a well-formed expression, or it divides by zero."""


def tokenize(text: str) -> list[int | str]:
    """Integers (as ``int``) and operator/parenthesis symbols (as ``str``, normalised)."""
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"expression longer than {MAX_LENGTH} characters")
    tokens: list[int | str] = []
    for number, symbol in _TOKEN_RE.findall(text.rstrip()):
        if number:
            tokens.append(int(number))
        elif symbol in _SYMBOLS:
            tokens.append(_SYMBOLS[symbol])
        else:
            raise ExpressionError(f"unexpected character {symbol!r}")
    return tokens


class _Parser:
    def __init__(self, tokens: list[int | str]):
        self.tokens = tokens
        self.pos = 0
        self.depth = 0
        self.numbers: list[int] = []
        self.steps: list[tuple[Fraction, str, Fraction, Fraction]] = []  # (lhs, op, rhs, value)

    def peek(self) -> int | str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self.term()
            value = self._step(value, op, rhs, value + rhs if op == "+" else value - rhs)
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self.factor()
            if op == "/" and rhs == 0:
                raise ExpressionError("division by zero")
            value = self._step(value, op, rhs, value * rhs if op == "*" else value / rhs)
        return value

    def _step(self, lhs: Fraction, op: str, rhs: Fraction, value: Fraction) -> Fraction:
        self.steps.append((lhs, op, rhs, value))
        return value

    def factor(self) -> Fraction:
        token = self.peek()
        if token is None:
            raise ExpressionError("unexpected end of expression")
        self.pos += 1
        if isinstance(token, int):
            self.numbers.append(token)
            return Fraction(token)
        if token == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ExpressionError(f"parentheses nested deeper than {MAX_DEPTH}")
            value = self.expr()
            if self.peek() != ")":
                raise ExpressionError("unbalanced parentheses: missing ')'")
            self.pos += 1
            self.depth -= 1
            return value
        raise ExpressionError(f"expected a number or '(' but found {token!r}")


def evaluate(text: str) -> tuple[Fraction, list[int]]:
    """Exact value of ``text`` and the integers it uses, in order of appearance.

    >>> evaluate("(3 + 5) × 2")
    (Fraction(16, 1), [3, 5, 2])

    Raises ExpressionError for an empty or malformed expression, unbalanced parentheses,
    unary signs, unknown characters, and division by zero.
    """
    value, numbers, _ = evaluate_steps(text)
    return value, numbers


def evaluate_steps(text: str) -> tuple[Fraction, list[int], list[tuple]]:
    """``evaluate`` plus the binary operations in the order they are computed, each
    ``(lhs, op, rhs, value)`` with exact values.

    >>> [tuple(map(str, step)) for step in evaluate_steps("(3 + 5) * 2")[2]]
    [('3', '+', '5', '8'), ('8', '*', '2', '16')]
    """
    tokens = tokenize(text)
    if not tokens:
        raise ExpressionError("empty expression")
    parser = _Parser(tokens)
    value = parser.expr()
    if parser.pos != len(tokens):
        token = tokens[parser.pos]
        if token == ")":
            raise ExpressionError("unbalanced parentheses: unexpected ')'")
        raise ExpressionError(f"unexpected {token!r} after a complete expression")
    return value, parser.numbers, parser.steps
