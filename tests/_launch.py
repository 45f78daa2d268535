"""Launch a script on 2 CPU processes with accelerate (gloo), never hanging a test."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CPU_2PROC = ROOT / "configs" / "accelerate" / "cpu_2proc.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp_cpu_config(folder: Path) -> Path:
    """The shipped FSDP launch config on 2 processes without bf16, written to ``folder``
    (tests/_kill_worker.py lets accelerate run it on CPU)."""
    config = yaml.safe_load((ROOT / "configs" / "accelerate" / "fsdp.yaml").read_text())
    config.update(num_processes=2, mixed_precision="no")
    path = folder / "fsdp_cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (torchrun starts each rank in a session of its own, so
    killing the launcher's process group leaves the ranks running)."""
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


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL a launch: the launcher, its process group and every rank, at once."""
    ranks = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def start_two(
    script: Path, args: list[str], *, config: Path = CPU_2PROC, env: dict | None = None, **popen
) -> subprocess.Popen:
    """``accelerate launch`` of ``script`` on 2 processes with ``config``, in its own process
    group (``os.killpg`` ends the launcher and both ranks), output merged into stdout."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        str(script),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **popen,
    )


def launch_two(
    script: Path,
    args: list[str],
    *,
    timeout: float,
    env: dict | None = None,
    config: Path = CPU_2PROC,
) -> tuple[int, str]:
    """(return code, output) of ``accelerate launch`` of ``script`` on 2 processes; on timeout
    the launcher and both ranks are killed and the test fails with the output's tail."""
    proc = start_two(script, args, config=config, env=env)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(proc)
        log, _ = proc.communicate()
        pytest.fail(f"accelerate launch did not end within {timeout} s:\n{log[-4000:]}")
    return proc.returncode, log
