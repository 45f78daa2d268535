"""Throughput of the rewards that cost something: sandboxed code execution and math-verify.

1. MBPP reference solutions with their asserts, pool of 2: ``daca.tasks.sandbox.run_many``
   (bwrap, or the fallback) against a plain unsandboxed ``subprocess.run`` of the same
   interpreter on the same program, also 2 at a time. Prints executions per second and the ratio.
2. MATH-500 answers: ``math_equal`` (math-verify) from the main thread and from a worker thread
   (which goes through the worker process) against a plain string compare. Pairs are a gold
   answer and the next problem's gold, so nearly every check runs math-verify in full.

The two variants alternate within each repetition; medians are reported (the CPU may be shared).

    python benchmarks/bench_rewards.py [--quick] [--data ../shared/data]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from daca.tasks import sandbox
from daca.tasks.formats import read_records
from daca.tasks.mathcheck import math_equal

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def mbpp_programs(data: Path, n: int) -> list[tuple[str, list[str]]]:
    path = data / "mbpp" / "sanitized-mbpp.json"
    if path.exists():
        rows = [r for r in read_records(path) if 11 <= r["task_id"] <= 510][:n]
        return [("\n".join([*r["test_imports"], r["code"]]) + "\n", r["test_list"]) for r in rows]
    print(f"({path} absent: synthetic programs instead)")
    return [(f"def f(x):\n    return x + {i}\n", [f"assert f(1) == {i + 1}"]) for i in range(n)]


def plain_run(python: str, program: str, checks: list[str]) -> bool:
    source = program + "\n" + "\n".join(checks) + "\n"
    done = subprocess.run([python, "-c", source], capture_output=True, timeout=30)
    return done.returncode == 0


def timed(fn):
    """(seconds, fn())."""
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def bench_sandbox(programs, reps: int) -> None:
    isolation = sandbox.isolation_available()
    python = sandbox._interpreter(isolation)
    codes, checks = zip(*programs, strict=True)
    sandboxed, plain = [], []
    with ThreadPoolExecutor(2) as pool:
        for _ in range(reps):
            seconds, results = timed(lambda: sandbox.run_many(codes, checks, workers=2))
            assert all(r.passed for r in results), [r.reason for r in results if not r.passed]
            sandboxed.append(len(codes) / seconds)
            seconds, ok = timed(lambda: list(pool.map(lambda p: plain_run(python, *p), programs)))
            assert all(ok)
            plain.append(len(codes) / seconds)
    s, p = statistics.median(sandboxed), statistics.median(plain)
    print(f"sandbox ({isolation}, {python}), {len(codes)} MBPP programs x {reps}, pool of 2:")
    print(f"  sandboxed {s:7.1f} exec/s   plain subprocess {p:7.1f} exec/s   ratio {s / p:.2f}")


def bench_math(data: Path, n: int, reps: int) -> None:
    path = data / "math500" / "test.jsonl"
    if path.exists():
        golds = [r["answer"] for r in read_records(path)][: n + 1]
    else:
        print(f"({path} absent: synthetic answers instead)")
        golds = [f"\\frac{{{i}}}{{{i + 2}}}" for i in range(n + 1)]
    pairs = list(zip(golds[:-1], golds[1:], strict=True))
    math_equal("1", "1")  # import math-verify outside the timing

    def in_thread(fn):
        thread = threading.Thread(target=fn)
        thread.start()
        thread.join()

    in_thread(lambda: math_equal("1", "1"))  # start the worker process outside the timing

    def verify_all():
        return [math_equal(g, p) for g, p in pairs]

    main, worker, plain = [], [], []
    for _ in range(reps):
        main.append(len(pairs) / timed(verify_all)[0])
        worker.append(len(pairs) / timed(lambda: in_thread(verify_all))[0])
        plain.append(len(pairs) / timed(lambda: [g.strip() == p.strip() for g, p in pairs])[0])
    m, w, b = (statistics.median(x) for x in (main, worker, plain))
    print(f"math-verify, {len(pairs)} MATH-500 answer pairs x {reps}:")
    print(f"  main thread {m:8.1f} checks/s   worker thread {w:8.1f} checks/s")
    print(f"  string compare {b:12.0f} checks/s   ratio math-verify/string {m / b:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer programs and answers")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared data folder")
    args = parser.parse_args()
    torch.set_num_threads(1)
    n_code, n_math, reps = (20, 40, 3) if args.quick else (60, 150, 3)
    bench_sandbox(mbpp_programs(args.data, n_code), reps)
    bench_math(args.data, n_math, reps)


if __name__ == "__main__":
    main()
