"""Training under sandbox load: memory and leftovers (issue 16, "Load").

Runs ``--steps`` training steps (default 500) of a small random model in the tiny model's
format, each scoring its 8 completions with 8 sandboxed MBPP executions at once
(``daca.tasks.mbpp.run_tests`` → ``daca.tasks.sandbox.run_many``, 8 workers). Completion i of a step
runs the reference solution of a different MBPP problem (sanitized MBPP, ../shared/data or
``--mbpp``), broken by a ``raise`` when the model's completion holds an odd number of '1's:
the reward (the share of asserts passed) depends on the model, so the updates run too.

Prints the resident memory (VmRSS) at 20 points of the run, its least-squares slope from
10 % of the steps on (MiB per 100 steps; flat memory is ~0), and what the run left behind: live
descendant processes of this one (the reward guard's worker, if used, counted apart) and
entries left in the temporary folder (a fresh TMPDIR for the run), sockets opened and not
closed, and processes of a sandbox uid or sandbox cgroups still there.

    python benchmarks/bench_reward_load.py               # 500 steps
    python benchmarks/bench_reward_load.py --steps 60    # a short run
    python benchmarks/bench_reward_load.py --no-execution  # control: no sandbox, same steps
Exit status 1 when processes, temporary files, sockets or sandboxes are left over.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_memory_leak import MIB, random_tiny_model, rss  # same folder

EXECUTIONS = 8  # sandboxed programs per step, all at once
MBPP = Path(__file__).resolve().parents[2] / "shared" / "data" / "mbpp" / "sanitized-mbpp.json"


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (from /proc/<pid>/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def socket_fds() -> int:
    """Sockets this process holds open."""
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd).startswith("socket:")
    return count


def sandbox_leftovers() -> list[str]:
    """Live processes of this run's sandboxes (zombies, which init reaps within seconds,
    aside), and this run's sandbox cgroups still holding tasks. With cgroups, a process is this
    run's when it sits in one of its cgroups; without (not root), any process of a sandbox uid
    counts (other runs on the machine included)."""
    from daca.tasks import sandbox

    mine = f"/daca-sandbox-{os.getpid()}-"
    cgroups = bool(sandbox._cgroup_parent_folders())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = dict(x.split(":", 1) for x in (entry / "status").read_text().splitlines())
            groups = (entry / "cgroup").read_text()
        except (OSError, ValueError):
            continue
        uid, state = int(fields["Uid"].split()[0]), fields["State"].split()[0]
        sandboxed = sandbox._UID_BASE <= uid < sandbox._UID_BASE + sandbox._UID_SPAN
        if state != "Z" and (mine in groups if cgroups else sandboxed):
            found.append(f"process {entry.name} of uid {uid}: {cmdline(int(entry.name))}")
    for _, parent in sandbox._cgroup_parent_folders():
        for name in os.listdir(parent):
            folder = os.path.join(parent, name)
            if ("/" + name).startswith(mine) and sandbox._tasks_in(folder):
                found.append(f"cgroup {folder} holds {sandbox._tasks_in(folder)}")
    return found


def slope_per_100(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of (step, bytes) in MiB per 100 steps."""
    n = len(points)
    mx = sum(s for s, _ in points) / n
    my = sum(b for _, b in points) / n
    var = sum((s - mx) ** 2 for s, _ in points)
    cov = sum((s - mx) * (b - my) for s, b in points)
    return 100 * cov / var / MIB if var else 0.0


def mbpp_reward(rows: list[dict], execute: bool = True):
    """The reward: completion i of call k runs the reference solution of row 8k + i (without
    ``execute``, the control: the same reward as if every assert passed, nothing run)."""
    from daca.tasks import mbpp

    calls = [0]

    def mbpp_load(prompts, completions, **kw):
        start = calls[0] * EXECUTIONS
        calls[0] += 1
        chosen = [rows[(start + i) % len(rows)] for i in range(len(completions))]
        if not execute:
            return [float(c.count("1") % 2 == 0) for c in completions]
        codes = [
            "```python\n"
            + r["code"]
            + ("\nraise ValueError('broken')" if c.count("1") % 2 else "")
            + "\n```"
            for r, c in zip(chosen, completions, strict=True)
        ]
        results = mbpp.run_tests(
            codes,
            [r["test_list"] for r in chosen],
            [r["test_imports"] for r in chosen],
            workers=EXECUTIONS,
        )
        return [sum(passed) / len(passed) if passed else 0.0 for _, passed in results]

    return mbpp_load


def register_load_task(reward) -> None:
    """Sudoku rows (prompts the tiny model reads) scored by ``reward``."""
    from daca.tasks import Task, get_task, register_task

    sudoku = get_task("sudoku")
    register_task(
        "mbpp_load",
        lambda: Task(
            name="mbpp_load",
            load=sudoku.load,
            chat_prompt=sudoku.chat_prompt,
            compact_prompt=sudoku.compact_prompt,
            reward_funcs=[reward],
            score=lambda completions, **kw: [0.0] * len(completions),
            columns=sudoku.columns,
        ),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=500, help="training steps (default 500)")
    ap.add_argument("--mbpp", type=Path, default=MBPP, help="sanitized MBPP JSON list")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--no-execution", action="store_true", help="control: the same run without the sandbox"
    )
    args = ap.parse_args()
    if args.steps < 20:
        ap.error("--steps must be >= 20")
    torch.set_num_threads(args.threads)
    scratch = Path(tempfile.mkdtemp(prefix="bench-reward-load-"))
    tmp = scratch / "tmp"
    tmp.mkdir()
    scratch.chmod(0o755)  # like /tmp: the sandbox's uid must reach its run folders in there
    tmp.chmod(0o1777)
    os.environ["TMPDIR"] = str(tmp)  # the run's temporary files, and only them, land here
    tempfile.tempdir = None

    rows = [r for r in json.loads(args.mbpp.read_text()) if r["task_id"] in range(11, 511)]
    for r in rows:
        r.setdefault("test_imports", [])
    register_load_task(mbpp_reward(rows, execute=not args.no_execution))

    from daca.train.config import load_config
    from daca.train.trainer import Trainer

    model = random_tiny_model(scratch / "model")
    cfg = load_config(
        None,
        [
            f"model={model}",
            f"output_dir={scratch}",
            "name=load",
            "task=mbpp_load",
            "device=cpu",
            "method=wd1",
            f"per_device_train_batch_size={EXECUTIONS}",
            "num_generations=2",
            "train_size=100",
            "eval_size=2",
            "eval_every=0",
            f"max_steps={args.steps}",
            f"save_every={args.steps}",
            "save_rollouts_every=0",
            "tensorboard=false",
            "generation.steps=4",
            "generation.gen_length=16",
            "generation.block_length=8",
            "reward_timeout=30",
        ],
    )
    trainer = Trainer(cfg, progress=False)
    sockets_before = socket_fds()
    every = max(1, args.steps // 20)
    samples, t0 = [], time.monotonic()
    for _ in range(args.steps):
        trainer.history.append(trainer.train_step())
        if trainer.step % every == 0 or trainer.step == args.steps:
            samples.append((trainer.step, rss()))
    took = time.monotonic() - t0
    history_mib = len(json.dumps(trainer.history).encode()) / MIB
    rewards = [h["reward"] for h in trainer.history]

    time.sleep(1.0)  # sandboxes killed at their deadline are reaped by then
    from daca.tasks import rewards as rewards_module

    guard = getattr(rewards_module, "_guard", None)
    guard_pids = {guard._proc.pid} if guard is not None and getattr(guard, "_proc", None) else set()
    left = [p for p in descendants(os.getpid()) if p not in guard_pids]
    # torch's own compile cache (torchinductor_<user>) is not the run's.
    files = sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torch"))
    sockets = socket_fds() - sockets_before
    sandboxes = sandbox_leftovers()

    print(
        f"\n{args.steps} steps, {0 if args.no_execution else EXECUTIONS} sandboxed MBPP "
        f"executions each, {took:.0f} s "
        f"({took / args.steps:.2f} s/step); mean reward {sum(rewards) / len(rewards):.3f}"
    )
    for step, b in samples:
        print(f"  after step {step:4d}: {b / MIB:8.1f} MiB")
    steady = [(s, b) for s, b in samples if s >= args.steps // 10]
    slope = slope_per_100(steady)
    print(
        f"resident memory slope from step {steady[0][0]} on: {slope:+.2f} MiB per 100 steps "
        f"(the run's history, kept by design, holds {history_mib:.2f} MiB as JSON)"
    )
    print(f"leftover processes: {len(left)}" + "".join(f"\n  {p}: {cmdline(p)}" for p in left))
    print(f"leftover temporary files: {len(files)}" + "".join(f"\n  {f}" for f in files[:10]))
    print(f"sockets opened and not closed: {sockets}")
    print(f"leftover sandboxes: {len(sandboxes)}" + "".join(f"\n  {x}" for x in sandboxes[:10]))
    return 1 if left or files or sockets > 0 or sandboxes else 0


if __name__ == "__main__":
    sys.exit(main())
