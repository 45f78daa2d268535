"""Asserts of code benchmarks judged outside the tested program.

An assert such as ``assert set(f(x)) == set((4, 5))`` is split in two: the parts that name the
program (``set(f(x))``) become ``sandbox.Call``s, evaluated in the sandbox after the program,
whose values come back as plain data; the rest (``__value_0 == set((4, 5))``, the comparison
and the expected values) is evaluated here, on data the program never sees. Arithmetic that
mixes the program's values with the test's (``abs(candidate(x) - 0.5) < 1e-6``) stays here too:
only ``candidate(x)`` runs inside. A program that patches builtins, returns an object equal to
everything or whose ``__sub__`` returns 0, or forges the sandbox's result lines, can then only
supply values, never a pass. The judging here is total and bounded (``judge``).

What stays outside is restricted to comparisons, boolean logic, arithmetic, literals, a few
builtins (``SAFE_FUNCS``) and ``math`` constants and functions (``math.isclose``). When an
assert of a test is outside that form (an expected value built by a comprehension, a function
named like a builtin, ...), the whole test runs as statements in a second sandbox apart from
the program, which it calls through a pipe (``sandbox.SeparateChecks``; docs/sandbox.md).
"""

from __future__ import annotations

import ast
import builtins
import functools
import math
import operator
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
    if isinstance(node, ast.UnaryOp | ast.BinOp) and _mixes(node, known):
        if isinstance(node, ast.UnaryOp):
            return ast.UnaryOp(node.op, _split(node.operand, calls, known))
        return ast.BinOp(_split(node.left, calls, known), node.op, _split(node.right, calls, known))
    if isinstance(node, ast.Call) and (
        _is_math_attribute(node.func) or (_is_safe_builtin(node.func) and _mixes(node, known))
    ):
        args = [_split(a, calls, known) for a in node.args]
        keywords = [ast.keyword(k.arg, _split(k.value, calls, known)) for k in node.keywords]
        return ast.Call(node.func, args, keywords)
    calls.append(ast.unparse(node))
    return ast.Name(VALUE.format(len(calls) - 1), ast.Load())


def _is_safe_builtin(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in SAFE_FUNCS


def _mixes(node: ast.AST, known: frozenset[str]) -> bool:
    """Whether ``node`` holds arithmetic between the program's values and values of the test
    (``candidate(x) - 0.5``): that arithmetic must run here, where the program cannot answer
    it (a value whose ``__sub__`` returns 0.0 would pass ``abs(...) < 1e-6`` inside)."""
    return any(
        isinstance(n, ast.BinOp)
        and _names_program(n, known)
        and not (_names_program(n.left, known) and _names_program(n.right, known))
        for n in ast.walk(node)
    )


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
    """The verdict of ``split`` on the values its calls returned (plain data), here.

    Total and bounded: arithmetic goes through ``_arithmetic`` (numbers of bounded size,
    sequences of bounded length), ``range`` is bounded and ``set``/``dict`` refuse
    hash-colliding keys, so no value can make the host raise or spin; an error fails the assert.
    """
    scope = {"__builtins__": {}, **_GUARDED_FUNCS, "math": MATH, _ARITHMETIC: _arithmetic}
    scope.update({VALUE.format(i): v for i, v in enumerate(values)})
    try:
        return bool(eval(_compiled_judge(split.judge), scope))  # noqa: S307 - checked
    except Exception:  # comparing the program's values may raise: the assert fails
        return False


MAX_INT_BITS = 1 << 16  # operands of the judge's arithmetic
MAX_RESULT_ITEMS = 1 << 20  # length of a sequence or range the judge builds
_ARITHMETIC = "__arithmetic"
_OPERATIONS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos,
}  # fmt: skip
_NUMBERS = (bool, int, float, complex)
_SEQUENCES = (str, bytes, list, tuple)


@functools.lru_cache(maxsize=4096)
def _compiled_judge(text: str):
    tree = _GuardArithmetic().visit(ast.parse(text, mode="eval"))
    return compile(ast.fix_missing_locations(tree), "<judge>", "eval")


class _GuardArithmetic(ast.NodeTransformer):
    """``a - b`` becomes ``__arithmetic('Sub', a, b)``: checked before it runs."""

    def visit_BinOp(self, node: ast.BinOp) -> ast.Call:
        node = self.generic_visit(node)
        args = [ast.Constant(type(node.op).__name__), node.left, node.right]
        return ast.Call(ast.Name(_ARITHMETIC, ast.Load()), args, [])

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        node = self.generic_visit(node)
        if isinstance(node.op, ast.Not):
            return node
        args = [ast.Constant(type(node.op).__name__), node.operand]
        return ast.Call(ast.Name(_ARITHMETIC, ast.Load()), args, [])


_OPERATION_NAMES = {op.__name__: f for op, f in _OPERATIONS.items()}


def _arithmetic(name: str, *operands):
    """One operation of the judge, refused (ValueError) when its cost is not small: numbers
    only, ints of at most MAX_INT_BITS bits, powers and repeated sequences of bounded size;
    sequences may be concatenated or repeated, nothing else."""
    if name not in _OPERATION_NAMES:
        raise ValueError(f"operation {name} is not allowed")
    numbers = all(isinstance(x, _NUMBERS) for x in operands)
    for x in operands:
        if isinstance(x, int) and x.bit_length() > MAX_INT_BITS:
            raise ValueError("integer operand too large")
    if numbers and name == "Pow":
        base, exponent = operands
        if isinstance(exponent, int) and isinstance(base, int | complex) and base not in (0, 1, -1):
            bits = max(abs(base).bit_length() if isinstance(base, int) else 64, 1)
            if abs(exponent) * bits > MAX_INT_BITS:
                raise ValueError("power too large")
    elif not numbers:
        kinds = tuple(type(x) for x in operands)
        if name == "Add" and len(set(kinds)) == 1 and kinds[0] in _SEQUENCES:
            pass
        elif name == "Mult" and {k in _SEQUENCES for k in kinds} == {True, False}:
            sequence, count = operands if kinds[0] in _SEQUENCES else operands[::-1]
            if not isinstance(count, int) or len(sequence) * max(count, 0) > MAX_RESULT_ITEMS:
                raise ValueError("repetition too long")
        else:
            raise ValueError(f"{name} of {', '.join(k.__name__ for k in kinds)}")
    return _OPERATION_NAMES[name](*operands)


def _bounded_range(*args):
    r = range(*args)
    if len(r) > MAX_RESULT_ITEMS:
        raise ValueError("range too long")
    return r


def _hash_checked(build):
    """``build`` (set, frozenset, dict) that refuses many distinct keys sharing one hash."""

    def checked(items=(), **keywords):
        items = items if isinstance(items, dict) else list(items)
        keys = list(items) if build is not dict or isinstance(items, dict) else []
        if build is dict and not isinstance(items, dict):
            keys = [pair[0] for pair in items]
        sandbox.check_hashes(keys)
        return build(items, **keywords)

    return checked


def _bounded_sum(items, start=0):
    # Concatenating sequences costs time quadratic in their number.
    if not isinstance(start, _NUMBERS) and len(items) > 1024:
        raise ValueError("sum of too many sequences")
    return sum(items, start)


_GUARDED_FUNCS = {
    **SAFE_FUNCS,
    "range": _bounded_range,
    "set": _hash_checked(set),
    "frozenset": _hash_checked(frozenset),
    "dict": _hash_checked(dict),
    "sum": _bounded_sum,
}


@dataclass(frozen=True)
class TestPlan:
    """The sandbox checks for a list of asserts, and how each assert reads their results.

    ``parts[i]``: the split of assert i and the check indices of its calls, or None and the
    index of its statement among the ``SeparateChecks``.
    """

    checks: tuple[sandbox.Call, ...] | sandbox.SeparateChecks
    parts: tuple[tuple[SplitAssert | None, tuple[int, ...]], ...]

    @property
    def split_count(self) -> int:
        return sum(split is not None for split, _ in self.parts)


def plan(
    asserts: Sequence[str], rename: dict[str, str] | None = None, imports: Sequence[str] = ()
) -> TestPlan:
    """Split each assert where possible. When one cannot be split, none is: all run as
    statements in a sandbox apart from the program (``sandbox.SeparateChecks``), after the
    test's ``imports`` (MBPP's ``test_imports``), calling the program's functions through a
    pipe."""
    modules = imported_names(imports)
    checks: list[sandbox.Call] = []
    parts = []
    for source in asserts:
        split = split_assert(source, rename, modules)
        if split is None:
            return _separate_plan(asserts, rename, imports, modules)
        first = len(checks)
        checks.extend(sandbox.Call(c) for c in split.calls)
        parts.append((split, tuple(range(first, len(checks)))))
    return TestPlan(tuple(checks), tuple(parts))


def _separate_plan(asserts, rename, imports, modules) -> TestPlan:
    statements = []
    for source in asserts:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            statements.append(source)  # fails in the checks' sandbox, as it would have here
            continue
        statements.append(ast.unparse(_Rename(rename).visit(tree)) if rename else source)
    proxies = called_names(statements, _STDLIB | frozenset(modules))
    # Standard-library modules a test uses without importing them (MBPP 596's ``sys``: the
    # program imported it, and the checks once ran in its namespace).
    used = set().union(*(_free_names(_parsed(s)) for s in statements))
    missing = sorted((used & _STDLIB) - set(modules) - set(proxies))
    prelude = [*imports, *(f"import {name}" for name in missing), ""]
    separate = sandbox.SeparateChecks("\n".join(prelude), tuple(statements), proxies)
    return TestPlan(separate, tuple((None, (i,)) for i in range(len(statements))))


def _parsed(source: str) -> ast.AST:
    try:
        return ast.parse(source)
    except SyntaxError:
        return ast.Module([], [])


def called_names(statements: Sequence[str], known: frozenset[str]) -> tuple[str, ...]:
    """Names the statements call that must be the program's: not builtins nor ``known``
    modules; for a statement calling none such, the outermost function it calls (a program
    function named like a builtin: MBPP 126's ``sum``)."""
    names: dict[str, None] = {}
    for statement in statements:
        try:
            calls = [n for n in ast.walk(ast.parse(statement)) if isinstance(n, ast.Call)]
        except SyntaxError:
            continue
        called = [c.func.id for c in calls if isinstance(c.func, ast.Name)]
        own = [n for n in called if n not in _BUILTIN_NAMES and n not in known]
        names.update(dict.fromkeys(own or called[:1]))
    return tuple(names)


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
