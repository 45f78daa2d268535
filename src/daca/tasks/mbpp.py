"""MBPP (sanitized): write a Python function that passes the task's assert statements.

Rows ``{"task_id", "prompt", "code", "test_imports", "test_list"}``. The program is the task's
``test_imports`` followed by the completion's code (``formats.extract_code``); it runs in the
sandbox (``daca.tasks.sandbox``, never in this process). Each assert of ``test_list`` is judged
outside the program (``code_tests``): the sandbox returns the values of its calls and the
comparison with the expected values happens here. Of the sanitized file's 427 tasks, 2 cannot
be split (126: its function is named ``sum``, like the builtin; 596: its expected values call
``sys.getsizeof``): their asserts run as statements in a second sandbox, apart from the
program, calling its function through a pipe (``sandbox.SeparateChecks``; docs/sandbox.md).
Training rewards: the fraction of asserts that pass (d1's code reward counts them one by one)
+ 0.5 for a python block inside the answer tags. ``score``: 1.0 when all asserts pass.
Splits of the sanitized file by task id (as on the hub): prompt 1-10, test 11-510,
validation 511-600, train 601-974.
"""

from __future__ import annotations

import functools
from typing import Any

from daca.tasks import Task, code_tests, sandbox
from daca.tasks.common import chat_user_message
from daca.tasks.formats import (
    PYTHON_TAGS,
    answer_block_reward,
    completion_texts,
    extract_code,
    hub_rows,
    read_records,
)

SPLIT_IDS = {
    "prompt": range(1, 11),
    "test": range(11, 511),
    "validation": range(511, 601),
    "train": range(601, 975),
}
SANDBOX_LIMITS = {"timeout": 5.0, "memory_mb": 1024, "max_procs": 32}
INSTRUCTION = (
    "Write the Python function in a ```python code block inside the answer tags. "
    "Your code should pass these tests:"
)


def program(completion: str, test_imports) -> str:
    """The code the sandbox runs before the asserts: test imports, then the completion's code."""
    return "\n".join([*test_imports, extract_code(completion)]) + "\n"


@functools.lru_cache(maxsize=4096)
def test_plan(test_list: tuple[str, ...], test_imports: tuple[str, ...]) -> code_tests.TestPlan:
    """The sandbox checks of a task's asserts (cached: a GRPO group shares them)."""
    return code_tests.plan(test_list, imports=test_imports)


def run_tests(completions, test_list, test_imports, *, workers=2, **limits):
    """Per completion: (its ``sandbox.ExecResult``, whether each assert passed)."""
    texts = completion_texts(completions)
    codes = [program(t, imports) for t, imports in zip(texts, test_imports, strict=True)]
    plans = [test_plan(tuple(t), tuple(i)) for t, i in zip(test_list, test_imports, strict=True)]
    checks = [p.checks for p in plans]
    results = sandbox.run_many(codes, checks, workers=workers, **{**SANDBOX_LIMITS, **limits})
    return [(r, code_tests.assert_results(p, r)) for r, p in zip(results, plans, strict=True)]


def make_task(workers: int = 2, **limits) -> Task:
    """The MBPP task; ``workers`` sandboxes run at once, ``limits`` go to ``run_python``."""

    def pass_rate_reward(prompts, completions, test_list, test_imports, **columns):
        """Fraction of the task's asserts that pass, in [0, 1]."""
        results = run_tests(completions, test_list, test_imports, workers=workers, **limits)
        return [sum(passed) / len(passed) if passed else 0.0 for _, passed in results]

    def score(completions, test_list, test_imports, **columns) -> list[float]:
        """1.0 when every assert passes (and the program ran to its end), else 0.0."""
        results = run_tests(completions, test_list, test_imports, workers=workers, **limits)
        return [float(r.passed and all(passed)) for r, passed in results]

    return Task(
        name="mbpp",
        load=load,
        chat_prompt=chat_prompt,
        reward_funcs=[pass_rate_reward, answer_block_reward(PYTHON_TAGS, "code_block_reward")],
        score=score,
        columns=("test_list", "test_imports"),
        executes_code=True,
    )


def chat_prompt(row: dict[str, Any]) -> str:
    tests = "\n".join(row["test_list"])
    return chat_user_message(f"{row['prompt']}\n\n{INSTRUCTION}\n{tests}")


def load(
    split: str = "test", path=None, limit: int | None = None, seed: int = 0
) -> list[dict[str, Any]]:
    """Rows of the sanitized MBPP JSON list (``split`` picks task ids), else the hub's
    ``google-research-datasets/mbpp`` config sanitized. ``limit`` takes the first rows."""
    if split not in SPLIT_IDS:
        raise ValueError(f"MBPP splits are {', '.join(SPLIT_IDS)}, got {split!r}")
    if path is not None:
        rows = read_records(path, ("task_id", "prompt", "test_list"))
        rows = [r for r in rows if r["task_id"] in SPLIT_IDS[split]]
    else:
        rows = hub_rows("google-research-datasets/mbpp", "sanitized", split)
    for row in rows:
        row.setdefault("test_imports", [])
        row["test_list"], row["test_imports"] = list(row["test_list"]), list(row["test_imports"])
    return rows if limit is None else rows[:limit]
