"""``daca --help`` and every command's help are instant: the parser is built without the
training stack (torch, transformers, the trainer), which each command imports when it runs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import daca
from daca.cli import COMMANDS

SRC = str(Path(daca.__file__).resolve().parents[1])
HEAVY = ("torch", "transformers", "accelerate", "daca.train.trainer", "daca.models.loading")

# The process measures its own CPU time (user + system, interpreter start included): CPU time,
# unlike wall time, does not grow when other jobs load the machine.
MEASURED = """
import resource, sys
from daca.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
usage = resource.getrusage(resource.RUSAGE_SELF)
print(f"CPU {usage.ru_utime + usage.ru_stime}", file=sys.stderr)
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300
    )


HELPS = [["--help"], *([name, "--help"] for name in COMMANDS), ["train", "--help-config"]]


@pytest.mark.parametrize("argv", HELPS, ids=" ".join)
def test_help_costs_under_a_second_of_cpu(argv):
    done = _python(MEASURED, *argv)
    cpu = float(done.stderr.strip().splitlines()[-1].removeprefix("CPU "))
    assert done.stdout.strip(), done.stderr  # the help itself was printed
    assert cpu < 1.0, f"daca {' '.join(argv)} took {cpu:.2f} s of CPU"


def test_building_the_parser_imports_no_training_stack():
    code = "import sys; from daca.cli import build_parser; build_parser(); print(*sys.modules)"
    loaded = set(_python(code).stdout.split())
    assert not loaded & set(HEAVY)


def test_help_config_documents_every_key_without_torch():
    code = (
        "import sys; from daca.cli import main; main(['train', '--help-config']); "
        "print('torch' in sys.modules)"
    )
    out = _python(code).stdout.splitlines()
    assert out[-1] == "False"
    assert any(line.startswith("dps.lam = ") and "#" in line for line in out)
