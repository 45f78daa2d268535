"""Hostile completions: rewards return a score within the time limit, and the next call works.

Each case goes through ``score_rewards`` / ``score_completions`` the way the trainer calls them,
with a limit of LIMIT seconds; a case passes when the deadline stopped what had to be stopped
(a score of 0, an error counted) and the call returned. The wall-clock bounds are ceilings a
loaded 2-core machine meets many times over (a backtracking pattern left to run takes hours),
not speed claims.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daca.tasks import get_task
from daca.tasks.common import answer_tag_span
from daca.tasks.formats import fenced_blocks, is_soft_format, is_strict_format
from daca.tasks.mathcheck import last_boxed, math_equal
from daca.tasks.rewards import RewardError, RewardGuard, score_completions, score_rewards

pytest.importorskip("jsonschema")

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
LIMIT = 1.0
SLACK = 30.0  # ceiling on killing a worker and starting the next, whatever the machine's load
FLOOD_LIMIT = 20.0  # a quadratic scan of 320 KB takes minutes; the linear one 0.1 s here
ORG_PATTERN = "^(?:[A-Za-z0-9]+[-]?)+[A-Za-z0-9]$"  # Github_medium o10310: nested quantifiers
ORG_VALUE = "my-awesome-organization-name-for-the-project-"  # ~1.9x slower per character


def _timed(func, *args, **kwargs):
    start = time.monotonic()
    value = func(*args, **kwargs)
    return value, time.monotonic() - start


def _rewards(task, completions, columns, **kwargs):
    """Total rewards, failures, seconds of the task's reward functions on ``completions``."""
    prompts = ["p"] * len(completions)
    (_, total, errors), seconds = _timed(
        score_rewards,
        task.reward_funcs,
        task.reward_weights,
        prompts,
        completions,
        columns,
        **{"timeout": LIMIT, **kwargs},
    )
    return total.tolist(), errors, seconds


def _github_medium(schema_id: str) -> dict:
    path = DATA / "jsonschemabench" / "github_medium.jsonl"
    if not path.exists():
        pytest.skip(f"{path} absent (the shared data folder is not mounted)")
    for line in path.open():
        row = json.loads(line)
        if row["id"] == schema_id:
            return row["schema"]
    raise AssertionError(f"{schema_id} not in {path}")


# ---------------------------------------------------------------- regexes on data (ReDoS)
def test_python_re_really_backtracks_on_the_org_pattern():
    """The hazard is real: each character more costs Python's re about twice the time
    (0.1 s here for 21 characters, 4 s for 25)."""
    _, seconds = _timed(re.search, ORG_PATTERN, "a" * 20 + "-")
    assert seconds > 0.02


def test_an_inline_redos_schema_scores_within_the_limit_and_the_next_call_works():
    task = get_task("json_schema")
    schema = {"type": "object", "properties": {"orgName": {"type": "string"}}}
    schema["properties"]["orgName"]["pattern"] = ORG_PATTERN
    completions = [json.dumps({"orgName": ORG_VALUE}), json.dumps({"orgName": "my-org"})]
    total, errors, seconds = _rewards(task, completions, {"schema": [schema] * 2})
    assert total == [0.0, 1.0] and seconds < LIMIT + SLACK


def test_a_pattern_re2_cannot_compile_is_stopped_at_the_deadline():
    """A lookahead keeps the pattern on Python's re: the worker is killed at the deadline,
    the example scores 0 (logged with its index) and a fresh worker scores the next one."""
    task = get_task("json_schema")
    schema = {"type": "string", "pattern": "^(?=a)(a+)+$"}
    completions = [json.dumps("a" * 40 + "!"), '"aaa"', '"b"']
    total, errors, seconds = _rewards(task, completions, {"schema": [schema] * 3})
    assert total == [0.0, 1.0, 0.0] and errors == 1
    assert LIMIT <= seconds < LIMIT + SLACK
    total, errors, seconds = _rewards(task, ['"aa"'], {"schema": [schema]})
    assert total == [1.0] and errors == 0 and seconds < SLACK
    with pytest.raises(RewardError, match=r"schema_valid_reward was stopped on example 0"):
        _rewards(task, completions[:1], {"schema": [schema]}, on_timeout="raise")


@pytest.mark.parametrize(
    ("schema_id", "completion"),
    [
        ("o10310", {"orgName": ORG_VALUE}),
        ("o42552", {"_schema": "pbj:a:b:c:d:1-0-0", "name": "x", "link_url": "a" * 40 + "!"}),
    ],
)
def test_github_medium_redos_schemas(schema_id, completion):
    task = get_task("json_schema")
    schema = _github_medium(schema_id)
    total, errors, seconds = _rewards(task, [json.dumps(completion)], {"schema": [schema]})
    assert total == [0.0] and seconds < LIMIT + SLACK
    valid = {"_schema": "pbj:a:b:c:d:1-0-0", "name": "x"} if schema_id == "o42552" else None
    if valid is not None:
        assert _rewards(task, [json.dumps(valid)], {"schema": [schema]})[0] == [1.0]


# ---------------------------------------------------------------- parsers (crashes)
@pytest.mark.parametrize("depth", [991, 100_000])
def test_deeply_nested_json_scores_zero_in_training_and_evaluation(depth):
    task = get_task("json_schema")
    completions = ["[" * depth, "[" * depth + "]" * depth, "[[1]]"]
    columns = {"schema": [{"type": "array"}] * 3}
    total, errors, seconds = _rewards(task, completions, columns)  # on_error="raise"
    assert total[0] == 0.0 and total[2] == 1.0 and errors == 0 and seconds < LIMIT + SLACK
    scores = score_completions(task.score, completions, columns, timeout=LIMIT)
    assert scores[0] == 0.0 and scores[2] == 1.0


def _recursion(prompts, completions, **columns):
    if "deep" in completions:
        raise RecursionError("maximum recursion depth exceeded")
    return [1.0] * len(completions)


def _bug(prompts, completions, **columns):
    return [1.0 / (c != "bad") for c in completions]


@pytest.mark.parametrize("guard", ["process", "thread"])
def test_parser_errors_score_zero_but_bugs_still_raise(guard):
    _recursion.reward_guard = _bug.reward_guard = guard
    per, total, errors = score_rewards(
        [_recursion], [1.0], ["p"] * 2, ["deep", "ok"], {}, timeout=SLACK
    )
    assert total.tolist() == [0.0, 1.0] and errors == 1
    with pytest.raises(RewardError, match=r"_bug failed on example 1 .*ZeroDivisionError"):
        score_rewards([_bug], [1.0], ["p"] * 2, ["ok", "bad"], {}, timeout=SLACK)


def _dies(prompts, completions, **columns):
    if "die" in completions:
        os.kill(os.getpid(), signal.SIGKILL)
    return [1.0] * len(completions)


_dies.reward_guard = "process"


def test_a_worker_that_dies_costs_only_its_example():
    per, total, errors = score_rewards(
        [_dies], [1.0], ["p"] * 3, ["a", "die", "b"], {}, timeout=SLACK
    )
    assert total.tolist() == [1.0, 0.0, 1.0] and errors == 1


# ---------------------------------------------------------------- floods (quadratic regexes)
FLOODS = {
    "answer": "<answer>" * 40_000,  # 320 KB
    "fences": "```\n" * 80_000,
    "boxed": "\\boxed" * 53_000,
    "tags": "<reasoning>\n" * 13_000 + "\n</reasoning>\n<answer>\n" * 7_000,
}
_COLUMNS = {
    "gsm8k": {"question": "q", "answer": "#### 5"},
    "math500": {"problem": "p", "answer": "5"},
    "sudoku": {"puzzle": "1234341221434321", "solution": "1234341221434321"},
    "countdown": {"numbers": [1, 2, 3], "target": 6},
    "json_schema": {"schema": {"type": "array"}},
}


@pytest.mark.parametrize("name", sorted(_COLUMNS))
def test_a_320_kb_flood_scores_before_a_generous_deadline(name):
    task = get_task(name)
    completions = [*FLOODS.values(), "<answer>\n5\n</answer>"]
    columns = {c: [_COLUMNS[name][c]] * len(completions) for c in task.columns}
    score_rewards(
        task.reward_funcs,
        task.reward_weights,
        ["p"],
        completions[-1:],
        {c: v[-1:] for c, v in columns.items()},
    )  # the worker has imported the task's modules: time the scoring only
    total, errors, seconds = _rewards(task, completions, columns, timeout=FLOOD_LIMIT)
    assert errors == 0, (name, seconds)  # no function needed the deadline


# The regexes the linear functions replace: same answers on every small text.
_ALPHABET = ["<answer>", "</answer>", "<reasoning>", "</reasoning>", "\n", " ", "x", "```", "py"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_ALPHABET), max_size=12).map("".join))
def test_linear_rewrites_agree_with_the_regexes(text):
    strict = r"<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\s*"
    soft = r"\s*<reasoning>.*?</reasoning>\s*<answer>.*?</answer>"
    fence = r"```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```"
    answers = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    assert is_strict_format(text) == bool(re.fullmatch(strict, text, re.DOTALL))
    assert is_soft_format(text) == bool(re.match(soft, text, re.DOTALL))
    assert fenced_blocks(text) == [b for _, b in re.findall(fence, text, re.DOTALL)]
    assert answer_tag_span(text) == (answers[-1].strip() if answers else None)


def test_last_boxed_still_reads_boxes():
    assert last_boxed("so \\boxed{\\frac{1}{2}} and \\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("\\boxed 5 then \\boxed\\alpha") == "5"
    assert last_boxed("\\boxed{1} \\boxed{2") is None


# ---------------------------------------------------------------- answers that are not LaTeX
def test_a_python_power_is_not_a_latex_answer():
    assert not math_equal("9", "9**9**9**9") and not math_equal("9", "9**9")
    assert math_equal("9", "9") and math_equal("512", "2^9")
    task = get_task("math500")
    completions = ["\\boxed{9**9**9**9}", "\\boxed{9}"]
    columns = {"problem": ["p"] * 2, "answer": ["9"] * 2}
    assert score_completions(task.score, completions, columns, timeout=LIMIT) == [0.0, 1.0]


# ---------------------------------------------------------------- exit
def test_an_abandoned_batch_does_not_keep_the_process_alive(tmp_path):
    """A batch still scoring when the program ends: the program exits (a worker kept alive
    would hold it for hours) and the worker is killed."""
    script = tmp_path / "abandon.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, threading, time
            from daca.tasks import rewards
            from daca.tasks import get_task

            task = get_task("json_schema")
            schema = {"type": "string", "pattern": "^(?=a)(a+)+$"}
            args = ([task.reward_funcs[0]], [1.0], ["p"], [json.dumps("a" * 60 + "!")])
            kwargs = {"timeout": None}
            threading.Thread(
                target=rewards.score_rewards, args=(*args, {"schema": [schema]}), kwargs=kwargs,
                daemon=True,
            ).start()
            while rewards.reward_guard()._proc is None:
                time.sleep(0.05)
            print(rewards.reward_guard()._proc.pid, flush=True)
            time.sleep(1.0)
            """
        )
    )
    run = [sys.executable, str(script)]
    done = subprocess.run(run, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 60  # the kill is sent at exit; init reaps it when it can
    while _alive(pid):
        assert time.monotonic() < deadline, f"worker {pid} still alive"
        time.sleep(0.1)


# ---------------------------------------------------------------- the time bound per completion
def _worker_starts(monkeypatch) -> list:
    """Appends one entry per reward worker started (a restart after a kill included)."""
    starts = []
    start = RewardGuard._start

    def counted(self):
        starts.append(1)
        return start(self)

    monkeypatch.setattr(RewardGuard, "_start", counted)
    return starts


def _hangs_on(prompts, completions, **columns):
    if any("hang" in c for c in completions):
        time.sleep(3600)
    return [1.0] * len(completions)


def _also_hangs_on(prompts, completions, **columns):
    return _hangs_on(prompts, completions)


_hangs_on.reward_guard = _also_hangs_on.reward_guard = "process"


@pytest.mark.parametrize(
    "flood",
    ["\\boxed{" * 1_430_000, "\\boxed{" + "1+" * 5_000_000 + "1}"],
    ids=["10MB-open-boxes", "10MB-closed-box"],
)
def test_math500_on_10_mb_of_boxes_stops_nothing_and_keeps_the_others(flood):
    """The answer extraction and math-verify's input are capped by size: nothing has to be
    stopped (errors 0: before, correctness_reward ran past the limit), the flood earns no
    correctness, and the other completions keep their rewards."""
    task = get_task("math500")
    completions = ["\\boxed{5}", flood, "<answer>\\boxed{5}</answer>"]
    columns = {"problem": ["p"] * 3, "answer": ["5"] * 3}
    per, total, errors = score_rewards(
        task.reward_funcs, task.reward_weights, ["p"] * 3, completions, columns, timeout=LIMIT
    )
    assert errors == 0
    assert per[:, 0].tolist() == [2.0, 0.0, 2.0] and total[0] == 2.5 and total[2] == 3.0


def test_two_reward_functions_share_one_budget_and_one_restart(monkeypatch):
    """Both functions hang on example 1: the first uses up the example's time (cause: timeout,
    one error), the second is not run on it, the others keep their rewards, and one worker
    restart serves both functions (before: each function had its own limit and restarts)."""
    score_rewards([_hangs_on], [1.0], ["p"], ["ok"], {}, timeout=LIMIT)  # a worker is up
    starts = _worker_starts(monkeypatch)
    completions = ["a", "hang", "b"]
    per, total, errors = score_rewards(
        [_hangs_on, _also_hangs_on], [1.0, 1.0], ["p"] * 3, completions, {}, timeout=LIMIT
    )
    assert per.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]] and errors == 1
    assert len(starts) == 1  # the fact that bounds the time (a loaded machine stretches it)
    with pytest.raises(RewardError, match=r"_hangs_on was stopped on example 1 \(no answer"):
        score_rewards(
            [_hangs_on], [1.0], ["p"] * 2, ["a", "hang"], {}, on_timeout="raise", timeout=LIMIT
        )


def test_eight_hanging_completions_in_ten_cost_one_restart(monkeypatch):
    """8 of 10 completions hang: they are stopped together, the 2 others are scored, and the
    batch costs one worker restart (before: one restart and one limit per hanging example)."""
    score_rewards([_hangs_on], [1.0], ["p"], ["ok"], {}, timeout=LIMIT)
    starts = _worker_starts(monkeypatch)
    completions = ["a", *["hang"] * 4, "b", *["hang"] * 4]
    (per, total, errors), seconds = _timed(
        score_rewards, [_hangs_on], [1.0], ["p"] * 10, completions, {}, timeout=LIMIT
    )
    assert total.tolist() == [1.0, *[0.0] * 4, 1.0, *[0.0] * 4] and errors == 8
    assert len(starts) == 1  # before: 8 (one per hanging example, each after its own limit)
    assert seconds < 30  # a ceiling for a loaded machine; alone it took 2.5-3 s


def _closes_its_pipes(prompts, completions, **columns):
    if "close" in completions:
        os.closerange(3, 4096)  # the worker's socket, and in a rescue the pipe of its outcomes
        time.sleep(3600)
    return [1.0] * len(completions)


_closes_its_pipes.reward_guard = "process"


def test_an_example_that_closes_its_pipes_is_stopped_and_the_others_kept():
    """The worker loses its socket (the batch is rescued); the example's own process then
    closes its pipe and sleeps: it is stopped at once, not waited for."""
    (per, total, errors), seconds = _timed(
        score_rewards, [_closes_its_pipes], [1.0], ["p"] * 3, ["a", "close", "b"], {}, timeout=60
    )
    assert total.tolist() == [1.0, 0.0, 1.0] and errors == 1
    assert seconds < 30  # well within the 60 s that the example could have had


_IMPORTED = []


def _import_slowly():
    time.sleep(1.5)  # stands for a heavy import (math-verify and sympy: ~0.4 s, more under load)
    _IMPORTED.append(True)


def _imports_on_first_use(prompts, completions, **columns):
    if not _IMPORTED:
        _import_slowly()
    return [1.0] * len(completions)


_imports_on_first_use.reward_guard = "process"
_imports_on_first_use.reward_warmup = _import_slowly


def test_a_reward_warmup_runs_when_the_function_is_loaded_not_within_the_limit():
    per, total, errors = score_rewards([_imports_on_first_use], [1.0], ["p"], ["a"], {}, timeout=1)
    assert total.tolist() == [1.0] and errors == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
