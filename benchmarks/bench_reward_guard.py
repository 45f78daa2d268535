"""Cost of the reward guard: rewards per second of each task's reward functions called directly
(unguarded, in this thread) against ``daca.tasks.rewards.score_rewards`` (daca's functions in the
persistent worker process, killed at the deadline), on the seven tasks' real data.

A batch is 8 prompts x 8 completions (4 for the code tasks), as in a GRPO step; completions
alternate the reference answer (in the reasoning/answer format) and a wrong one. The two
variants alternate within each repetition; medians are reported (the CPU may be shared). MBPP
and HumanEval run only where the sandbox can execute (bubblewrap, or DACA_UNSAFE_EXEC=1).

It first prints the cost of one sandboxed execution as daca runs it now (a minimal view of the
host, limits per sandbox) against the old way (the host's / read-only, per-process limits), the
two alternating in the same run.

    python benchmarks/bench_reward_guard.py [--quick] [--data ../shared/data] [--sandbox-only]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from daca.tasks import get_task
from daca.tasks.rewards import score_rewards

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
PROMPTS, GENERATIONS, CODE_GENERATIONS = 8, 8, 4


def _tagged(reasoning: str, answer: str) -> str:
    return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{answer}\n</answer>"


def _fenced(code: str) -> str:
    return _tagged("Here is the function.", f"```python\n{code}\n```")


def _gsm8k(row, right):
    number = row["answer"].rsplit("####", 1)[-1].strip()
    return _tagged(row["answer"].split("####")[0], number if right else number + "1")


def _math500(row, right):
    return _tagged(row["solution"], f"\\boxed{{{row['answer'] if right else 'x+1'}}}")


COMPLETIONS = {
    "gsm8k": (_gsm8k, {"path": "gsm8k/test.jsonl"}),
    "math500": (_math500, {"path": "math500/test.jsonl"}),
    "sudoku": (lambda r, right: _tagged("", r["solution"] if right else r["puzzle"]), {}),
    "countdown": (lambda r, right: _tagged("", r["solution"] if right else "1+1"), {}),
    "json_schema": (
        lambda r, right: _tagged("", "{}" if right else '{"a": [1, 2]}'),
        {"path": "jsonschemabench/github_medium.jsonl"},
    ),
    "mbpp": (
        lambda r, right: _fenced(r["code"] if right else "def f():\n    return 0"),
        {"path": "mbpp/sanitized-mbpp.json"},
    ),
    "humaneval": (
        lambda r, right: _fenced(r["prompt"] + (r["canonical_solution"] if right else "    pass")),
        {},
    ),
}


def batch(name: str, data: Path):
    """(task, prompts, completions, columns) of one GRPO-sized batch, or a reason to skip."""
    make, where = COMPLETIONS[name]
    task = get_task(name)
    kwargs = {"path": data / where["path"]} if "path" in where else {}
    if kwargs and not kwargs["path"].exists():
        return f"{kwargs['path']} absent"
    rows = task.load("test", limit=PROMPTS, **kwargs)
    g = CODE_GENERATIONS if name in ("mbpp", "humaneval") else GENERATIONS
    rows = [r for r in rows for _ in range(g)]
    completions = [make(r, i % 2 == 0) for i, r in enumerate(rows)]
    columns = {c: [r.get(c) for r in rows] for c in task.columns}
    return task, ["p"] * len(rows), completions, columns


def direct(task, prompts, completions, columns) -> None:
    for func in task.reward_funcs:
        func(prompts=prompts, completions=completions, **columns)


def guarded(task, prompts, completions, columns) -> None:
    score_rewards(
        task.reward_funcs, task.reward_weights, prompts, completions, columns, timeout=600.0
    )


def rate(fn, args, n: int) -> float:
    start = time.perf_counter()
    fn(*args)
    return n / (time.perf_counter() - start)


def bench(name: str, data: Path, reps: int) -> float | None:
    got = batch(name, data)
    if isinstance(got, str):
        print(f"{name:12s} skipped: {got}")
        return None
    n = len(got[2])
    try:
        direct(*got)  # imports, compiled schemas, the worker: outside the timing
        guarded(*got)
    except Exception as e:  # noqa: BLE001 - e.g. no sandbox here: say so, go on
        print(f"{name:12s} skipped: {type(e).__name__}: {str(e)[:150]}")
        return None
    before, after = [], []
    for _ in range(reps):
        before.append(rate(direct, got, n))
        after.append(rate(guarded, got, n))
    b, a = statistics.median(before), statistics.median(after)
    print(f"{name:12s} {n:4d}  direct {b:9.1f}/s   guarded {a:9.1f}/s   ratio {a / b:5.2f}")
    return a / b


def sandbox_ratio(data: Path, reps: int) -> float | None:
    """Seconds per sandboxed execution (8 MBPP reference solutions, one at a time) with the
    minimal view and per-sandbox cgroups against the old way (the host's / bound read-only,
    per-process limits only), the two alternating in this run; prints the ratio new / old."""
    from daca.tasks import mbpp, sandbox

    path = data / "mbpp" / "sanitized-mbpp.json"
    if not path.exists():
        print(f"sandbox      skipped: {path} absent")
        return None
    rows = get_task("mbpp").load("test", path=path, limit=8)
    jobs = [
        (
            mbpp.program(_fenced(r["code"]), r["test_imports"]),
            mbpp.test_plan(tuple(r["test_list"]), tuple(r["test_imports"])).checks,
        )
        for r in rows
    ]

    def per_execution(old: bool) -> float:
        sandbox._FULL_HOST_VIEW, sandbox._USE_CGROUPS = old, not old
        start = time.perf_counter()
        for code, checks in jobs:
            if not sandbox.run_python(code, checks, **mbpp.SANDBOX_LIMITS).passed:
                raise RuntimeError("a reference solution failed in the sandbox")
        return (time.perf_counter() - start) / len(jobs)

    try:
        per_execution(True), per_execution(False)  # probe, runtime view: outside the timing
        old, new = [], []
        for _ in range(reps):
            old.append(per_execution(True))
            new.append(per_execution(False))
    except (sandbox.SandboxUnavailable, RuntimeError) as e:
        print(f"sandbox      skipped: {str(e)[:150]}")
        return None
    finally:
        sandbox._FULL_HOST_VIEW, sandbox._USE_CGROUPS = False, True
    o, n = statistics.median(old), statistics.median(new)
    cgroups = "cgroups" if sandbox._cgroup_parent_folders() else "no usable cgroups"
    print(
        f"sandboxed execution ({cgroups}), median of {reps} x {len(jobs)}: old view "
        f"{o * 1000:.1f} ms, minimal view + per-sandbox limits {n * 1000:.1f} ms, "
        f"ratio {n / o:.3f}"
    )
    return n / o


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared data folder")
    parser.add_argument("--tasks", nargs="*", default=list(COMPLETIONS), help="tasks to run")
    parser.add_argument(
        "--sandbox-only", action="store_true", help="only the cost per sandboxed execution"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    reps = 3 if args.quick else 7
    sandbox_ratio(args.data, reps * 3)
    if args.sandbox_only:
        return
    print(f"rewards per second, one batch per call, median of {reps} (completions in the batch)")
    ratios = [r for name in args.tasks if (r := bench(name, args.data, reps)) is not None]
    if ratios:
        print(f"geometric mean ratio {statistics.geometric_mean(ratios):.2f} over {len(ratios)}")


if __name__ == "__main__":
    main()
