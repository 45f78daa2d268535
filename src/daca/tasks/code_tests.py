"""Asserts of code benchmarks judged outside the tested program.

An assert such as ``assert set(f(x)) == set((4, 5))`` is split in two: the parts that name the
program (``set(f(x))``) become ``sandbox.Call``s, evaluated in the sandbox after the program,
whose values come back as plain data; the rest (``__value_0 == set((4, 5))``, the comparison
and the expected values) is evaluated here, on data the program never sees. A program that
patches builtins, returns an object equal to everything or forges the sandbox's result lines
can then only supply values, never a pass.

What stays outside is restricted to comparisons, boolean logic, arithmetic, literals, a few
builtins (``SAFE_FUNCS``) and ``math`` constants and functions (``math.isclose``). An assert
outside that form (an expected value built by a comprehension, a check with loops or helper
state, ...) cannot be split: it runs in the sandbox as before, as a statement that passes when
nothing raises (``split_assert`` returns None for it).
"""

from __future__ import annotations

import ast
import builtins
import math
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass

from daca.tasks import sandbox

VALUE = "__value_{}"
# Builtins the judging side may call; they only ever see plain data rebuilt by the sandbox.
_SAFE_NAMES = ("abs", "all", "any", "bool", "complex", "dict", "float", "frozenset", "int", "len")
_SAFE_NAMES += ("list", "max", "min", "range", "round", "set", "sorted", "str", "sum", "tuple")
SAFE_FUNCS = {name: getattr(builtins, name) for name in _SAFE_NAMES}
_BUILTIN_NAMES = frozenset(dir(builtins))
# Standard-library modules are never the program, even when the test forgets to import them.
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) | {"math"}
_MATH_NAMES = ("isclose", "fabs", "sqrt", "floor", "ceil", "pi", "e", "inf", "nan")
MATH = types.SimpleNamespace(**{name: getattr(math, name) for name in _MATH_NAMES})
_OPERATORS = (
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
    ast.And, ast.Or, ast.Not, ast.USub, ast.UAdd,
    ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Is, ast.IsNot, ast.In, ast.NotIn,
)  # fmt: skip
_OUTSIDE_NODES = (
    ast.Expression, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.Constant, ast.Tuple,
    ast.List, ast.Set, ast.Dict, ast.Name, ast.Load, ast.Attribute, ast.Call, ast.keyword,
    ast.Subscript, ast.Slice, *_OPERATORS,
)  # fmt: skip


@dataclass(frozen=True)
class SplitAssert:
    """``calls``: expressions run in the sandbox; ``judge``: the verdict over their values
    (named ``__value_0``, ...), evaluated here."""

    calls: tuple[str, ...]
    judge: str


def _is_math_attribute(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "math"
        and hasattr(MATH, node.attr)
    )


def _free_names(node: ast.AST) -> set[str]:
    """Names ``node`` reads that it does not bind itself (comprehension variables, lambda
    arguments)."""
    read, bound = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            (read if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
    return read - bound


def _names_program(node: ast.AST, known: frozenset[str]) -> bool:
    """Whether ``node`` reads a name of the program: not a builtin, not a ``known`` module.

    Expressions built from builtins and modules alone (an expected value) must never enter
    the sandbox: the program could patch them there to agree with its own answers.
    """
    return any(name not in _BUILTIN_NAMES and name not in known for name in _free_names(node))


def _split(node: ast.expr, calls: list[str], known: frozenset[str]) -> ast.expr:
    """``node`` with each maximal part that names the program replaced by a value name."""
    if not _names_program(node, known):
        return node
    if isinstance(node, ast.Compare):
        left = _split(node.left, calls, known)
        return ast.Compare(left, node.ops, [_split(c, calls, known) for c in node.comparators])
    if isinstance(node, ast.BoolOp):
        return ast.BoolOp(node.op, [_split(v, calls, known) for v in node.values])
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return ast.UnaryOp(node.op, _split(node.operand, calls, known))
    if isinstance(node, ast.Call) and _is_math_attribute(node.func):
        args = [_split(a, calls, known) for a in node.args]
        keywords = [ast.keyword(k.arg, _split(k.value, calls, known)) for k in node.keywords]
        return ast.Call(node.func, args, keywords)
    calls.append(ast.unparse(node))
    return ast.Name(VALUE.format(len(calls) - 1), ast.Load())


def _judge_is_safe(tree: ast.Expression, n_values: int) -> bool:
    """Only comparisons, logic, arithmetic, literals, safe builtins and math on values."""
    allowed_names = set(SAFE_FUNCS) | {VALUE.format(i) for i in range(n_values)} | {"math"}
    for node in ast.walk(tree):
        if not isinstance(node, _OUTSIDE_NODES):
            return False
        if isinstance(node, ast.Name) and node.id not in allowed_names:
            return False
        if isinstance(node, ast.Attribute) and not _is_math_attribute(node):
            return False
        if isinstance(node, ast.Call) and not (
            (isinstance(node.func, ast.Name) and node.func.id in SAFE_FUNCS)
            or _is_math_attribute(node.func)
        ):
            return False
        if isinstance(node, ast.keyword) and node.arg is None:
            return False
    return True


def split_assert(
    source: str, rename: dict[str, str] | None = None, modules: Sequence[str] = ()
) -> SplitAssert | None:
    """The split of one ``assert`` statement, or None when it cannot be judged outside.

    ``rename`` maps names of the test to names of the program (HumanEval's ``candidate`` to
    the entry point); ``modules``: names the test's imports bind (standard-library modules
    always count). The assert's message is dropped.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    test = tree.body[0].test
    if rename:
        test = _Rename(rename).visit(test)
    known = _STDLIB | frozenset(modules)
    if any(n in _BUILTIN_NAMES or n in known for n in (rename or {}).values()):
        return None  # the program's function would be taken for a builtin
    calls: list[str] = []
    judge = ast.Expression(_split(test, calls, known))
    if not calls and any(isinstance(n, ast.Name | ast.Call) for n in ast.walk(test)):
        return None  # e.g. a program function named like a builtin: ``assert sum(1, 2) == 3``
    if not _judge_is_safe(judge, len(calls)):
        return None
    return SplitAssert(tuple(calls), ast.unparse(ast.fix_missing_locations(judge)))


class _Rename(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]):
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.copy_location(ast.Name(self.names.get(node.id, node.id), node.ctx), node)


def judge(split: SplitAssert, values: Sequence) -> bool:
    """The verdict of ``split`` on the values its calls returned (plain data), here."""
    scope = {"__builtins__": {}, **SAFE_FUNCS, "math": MATH}
    scope.update({VALUE.format(i): v for i, v in enumerate(values)})
    try:
        return bool(eval(compile(split.judge, "<judge>", "eval"), scope))  # noqa: S307 - checked
    except Exception:  # comparing the program's values may raise: the assert fails
        return False


@dataclass(frozen=True)
class TestPlan:
    """The sandbox checks for a list of asserts, and how each assert reads their results.

    ``parts[i]``: the split of assert i and the check indices of its calls, or None and the
    index of its statement check.
    """

    checks: tuple[str | sandbox.Call, ...]
    parts: tuple[tuple[SplitAssert | None, tuple[int, ...]], ...]

    @property
    def split_count(self) -> int:
        return sum(split is not None for split, _ in self.parts)


def plan(
    asserts: Sequence[str], rename: dict[str, str] | None = None, imports: Sequence[str] = ()
) -> TestPlan:
    """Split each assert where possible; the others stay statement checks, in order.
    ``imports``: the test's import statements (MBPP's ``test_imports``)."""
    modules = imported_names(imports)
    checks: list[str | sandbox.Call] = []
    parts = []
    for source in asserts:
        split = split_assert(source, rename, modules)
        if split is None:
            stmt = source
            if rename:
                stmt = ast.unparse(_Rename(rename).visit(ast.parse(source)))
            parts.append((None, (len(checks),)))
            checks.append(stmt)
        else:
            first = len(checks)
            checks.extend(sandbox.Call(c) for c in split.calls)
            parts.append((split, tuple(range(first, len(checks)))))
    return TestPlan(tuple(checks), tuple(parts))


def imported_names(imports: Sequence[str]) -> list[str]:
    """Names bound by import statements (``import a.b`` binds ``a``); unreadable ones skipped."""
    names = []
    for statement in imports:
        try:
            nodes = ast.parse(statement).body
        except SyntaxError:
            continue
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                names += [(a.asname or a.name).split(".")[0] for a in node.names]
    return names


def assert_results(test_plan: TestPlan, result: sandbox.ExecResult) -> list[bool]:
    """Whether each assert of ``test_plan`` passed in the sandbox run ``result``."""
    passed = []
    for split, indices in test_plan.parts:
        if split is None:
            ok = indices[0] in result.passed_indices
        else:
            ok = all(i in result.values for i in indices) and judge(
                split, [result.values[i] for i in indices]
            )
        passed.append(ok)
    return passed
