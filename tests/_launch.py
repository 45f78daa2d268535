"""Launch a script on 2 CPU processes with accelerate (gloo), never hanging a test."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_2PROC = ROOT / "configs" / "accelerate" / "cpu_2proc.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two(
    script: Path, args: list[str], *, timeout: float, env: dict | None = None
) -> tuple[int, str]:
    """(return code, output) of ``accelerate launch`` of ``script`` on 2 processes; on timeout
    the launcher and both ranks are killed and the test fails with the output's tail."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CPU_2PROC),
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        str(script),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks
        log, _ = proc.communicate()
        pytest.fail(f"accelerate launch did not end within {timeout} s:\n{log[-4000:]}")
    return proc.returncode, log
