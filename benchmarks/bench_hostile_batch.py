"""Cost of hostile completions in one batch: a batch of 10 JSON-schema completions of which k
make the schema's pattern backtrack for hours (in C, holding the GIL), scored through
``score_rewards`` at ``reward_timeout`` = 1 s. Each hostile example is stopped and scores 0; the
others keep their scores. Printed: seconds and reward-worker starts for k = 1 and k = 8, and
their ratio (8 hostile completions should cost about what one costs: they are stopped together,
after one restart).

    python benchmarks/bench_hostile_batch.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

from daca.tasks import get_task
from daca.tasks.rewards import RewardGuard, score_rewards

TIMEOUT = 1.0
SCHEMA = {"type": "string", "pattern": "^(?=a)(a+)+$"}  # Python's re: exponential on "a"*40+"!"
HOSTILE, GOOD = json.dumps("a" * 40 + "!"), json.dumps("aaa")


def _starts() -> list:
    starts, start = [], RewardGuard._start

    def counted(self):
        starts.append(1)
        return start(self)

    RewardGuard._start = counted
    return starts


def _batch(task, k: int, starts: list) -> tuple[float, int]:
    completions = [HOSTILE] * k + [GOOD] * (10 - k)
    before, t0 = len(starts), time.monotonic()
    _, total, errors = score_rewards(
        task.reward_funcs,
        task.reward_weights,
        ["p"] * 10,
        completions,
        {"schema": [SCHEMA] * 10},
        timeout=TIMEOUT,
    )
    seconds = time.monotonic() - t0
    assert errors == k and total.tolist()[k:] == [1.0] * (10 - k), (total, errors)
    return seconds, len(starts) - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # each stopped example is logged
    task, starts = get_task("json_schema"), _starts()
    _batch(task, 0, starts)  # the worker is up and has imported the task
    runs = {1: [], 8: []}
    for _ in range(args.repeats):
        for k in runs:
            runs[k].append(_batch(task, k, starts))
    for k, measured in runs.items():
        seconds = statistics.median(s for s, _ in measured)
        restarts = statistics.median(r for _, r in measured)
        print(f"{k} hostile of 10: {seconds:.2f} s, {restarts:g} worker start(s) (median)")
    ratio = statistics.median(s for s, _ in runs[8]) / statistics.median(s for s, _ in runs[1])
    print(f"8 hostile / 1 hostile: {ratio:.2f}x the time (reward_timeout={TIMEOUT:g} s)")


if __name__ == "__main__":
    main()
