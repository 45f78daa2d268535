"""The code sandbox: right code passes, escape attempts score 0 and leave nothing behind."""

import itertools
import os
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from daca.tasks import sandbox
from daca.tasks.sandbox import ExecResult, isolation_available, run_many, run_python

ROOT = os.geteuid() == 0
# Both isolations as root (the fallback's file and signal protection relies on a separate uid).
ISOLATIONS = [pytest.param("bwrap", id="bwrap"), pytest.param("fallback", id="fallback")]
# timeout: a ceiling for programs that end by themselves (a hang sets its own, shorter one).
FAST = {"timeout": 30.0, "memory_mb": 256, "max_procs": 16, "max_file_mb": 1, "scratch_mb": 4}


def _default_isolation():
    """The isolation plain calls use here; skip where there is none (and no opt-in)."""
    try:
        return isolation_available()
    except sandbox.SandboxUnavailable:
        pytest.skip("bubblewrap is not installed or does not work here (user namespaces?)")


def _skip_unusable(isolation):
    if isolation == "bwrap" and _default_isolation() != "bwrap":
        pytest.skip("bubblewrap is not installed or does not work here (user namespaces?)")
    if isolation == "fallback" and not ROOT:
        pytest.skip("the fallback only isolates files and signals when run as root")


def _processes():
    """pid -> (parent pid, real uid, state letter) of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                ppid, uid = int(fields["PPid"]), int(fields["Uid"].split()[0])
                table[int(entry)] = (ppid, uid, fields["State"].split()[0])
            except (OSError, KeyError, ValueError):  # gone meanwhile
                pass
    return table


def _descendants(table, root):
    children = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


class Guard:
    """Pins the sandbox uid and checks that a test leaves no process of its own behind."""

    def __init__(self, uid):
        self.uid = uid
        self.before = _descendants(_processes(), os.getpid())

    def leftovers(self):
        """New descendants, and processes of the sandbox uid, still alive (zombies excluded)."""
        table = _processes()
        new = _descendants(table, os.getpid()) - self.before
        return sorted(
            pid
            for pid, (_, uid, state) in table.items()
            if state != "Z" and (pid in new or (ROOT and uid == self.uid))
        )

    def assert_clean(self):
        deadline = time.monotonic() + 30.0  # the kernel tears a pid namespace down later
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.leftovers() == []


_guard_uids = itertools.count()


@pytest.fixture
def guard(monkeypatch):
    """A fixed sandbox uid for the test, so that its processes can be found afterwards; a new
    one per test: the zombies of an earlier test's fork bomb, until init reaps them, still count
    against RLIMIT_NPROC of their uid."""
    # outside the library's range: no clash with other runs
    uid = 60100 + (os.getpid() * 31 + next(_guard_uids)) % 900
    monkeypatch.setattr(sandbox, "_next_uid", lambda: uid)
    return Guard(uid)


def _run(isolation, code, checks=(), **limits):
    _skip_unusable(isolation)
    result = run_python(code, checks, isolation=isolation, **{**FAST, **limits})
    assert isinstance(result, ExecResult)
    return result


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_right_solution_passes_and_counts_checks(isolation, guard):
    code = "def add(a, b):\n    return a + b\nprint('hello')\n"
    ok = _run(isolation, code, ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"])
    assert ok.passed and ok.reason == "passed" and ok.returncode == 0
    assert (ok.checks_passed, ok.checks_total, ok.pass_rate) == (2, 2, 1.0)
    assert ok.stdout_tail == "hello\n"
    half = _run(isolation, code, ["assert add(1, 2) == 3", "assert add(1, 1) == 3"])
    assert not half.passed and (half.checks_passed, half.pass_rate) == (1, 0.5)
    assert "AssertionError" in half.stderr_tail
    guard.assert_clean()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_syntax_error_and_early_exit_do_not_pass(isolation, guard):
    bad = _run(isolation, "def f(:\n    pass\n", ["assert True"])
    assert not bad.passed and "SyntaxError" in bad.reason and bad.checks_passed == 0
    # Exiting before the checks run cannot fake success, whatever the exit status.
    for code in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"):
        early = _run(isolation, code, ["assert False"])
        assert not early.passed and early.checks_passed == 0
    guard.assert_clean()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_infinite_loop_times_out(isolation, guard):
    start = time.monotonic()
    result = _run(isolation, "while True:\n    pass\n", timeout=1.0)
    assert time.monotonic() - start < 60  # a ceiling: the loop was stopped, not left to run
    assert result.timed_out and not result.passed and result.reason.startswith("timed out")
    # Checks that passed before a later one hangs still count.
    slow = _run(isolation, "x = 1", ["assert x == 1", "while True:\n    pass"], timeout=1.0)
    assert slow.timed_out and (slow.checks_passed, slow.checks_total) == (1, 2)
    guard.assert_clean()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_fork_is_capped_then_fork_bomb_is_contained(isolation, guard):
    # Safe version first: at most 200 short-lived children; RLIMIT_NPROC stops them early.
    bounded = (
        "import os, time\nn = 0\nfor i in range(200):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(1)\n"
        "        os._exit(0)\n    n += 1\nprint(n)\n"
    )
    capped = _run(isolation, bounded, max_procs=16)
    assert capped.passed and int(capped.stdout_tail) < 16
    guard.assert_clean()
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = _run(isolation, bomb, timeout=1.5, max_procs=16)
    assert not result.passed and result.timed_out
    guard.assert_clean()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_memory_bomb_fails(isolation, guard):
    for code in ("x = bytearray(10**10)", "x = []\nwhile True:\n    x.append(bytearray(10**7))"):
        result = _run(isolation, code, memory_mb=256)
        assert not result.passed and not result.timed_out
        assert "MemoryError" in result.stderr_tail
    guard.assert_clean()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_files_outside_the_sandbox_are_untouchable(isolation, guard, tmp_path):
    _skip_unusable(isolation)
    places = [tmp_path]
    if isolation == "bwrap":
        # World-writable and visible inside: only the read-only mount protects it.
        shared = Path(tempfile.mkdtemp(dir="/var/tmp"))
        shared.chmod(0o777)
        places.append(shared)
    try:
        for place in places:
            sentinel = place / "sentinel.txt"
            sentinel.write_text("keep me")
            sentinel.chmod(0o666)
            attacks = [
                f"import os\nos.remove({str(sentinel)!r})\n",
                f"open({str(sentinel)!r}, 'w').write('gotcha')\n",
                f"open({str(place / 'new.txt')!r}, 'w').write('gotcha')\n",
                f"import shutil\nshutil.rmtree({str(place)!r})\n",
            ]
            for code in attacks:
                assert not _run(isolation, code).passed
            assert sentinel.read_text() == "keep me"
            assert sorted(p.name for p in place.iterdir()) == ["sentinel.txt"]
    finally:
        for place in places[1:]:
            for p in place.iterdir():
                p.unlink()
            place.rmdir()
    # The sandbox's own scratch space is writable (and private).
    scratch = _run(isolation, "open('f.txt', 'w').write('x')\nassert open('f.txt').read() == 'x'")
    assert scratch.passed
    guard.assert_clean()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_no_network_to_localhost(isolation, guard):
    _skip_unusable(isolation)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        attacks = [
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n",
            f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))\n",
        ]
        for code in attacks:
            result = _run(isolation, code)
            assert not result.passed
        with pytest.raises(BlockingIOError):  # nothing ever connected
            listener.accept()
    guard.assert_clean()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_cannot_kill_parent_or_test_process(isolation, guard):
    me = os.getpid()
    code = f"import os\nos.kill(os.getppid(), 9)\nos.kill({me}, 9)"
    result = _run(isolation, code)
    assert not result.passed and result.returncode is not None  # a normal verdict came back
    # The harness itself still works afterwards.
    assert _run(isolation, "x = 1", ["assert x == 1"]).passed
    guard.assert_clean()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_huge_output_is_cut_and_bounded(isolation, guard):
    for code in (
        "import sys\nsys.stdout.write('x' * 100_000_000)\nsys.stdout.flush()\n",
        "while True:\n    print('y' * 1000)\n",
    ):
        result = _run(isolation, code, max_file_mb=1)
        assert not result.passed
        assert len(result.stdout_tail) <= sandbox.TAIL_BYTES
    guard.assert_clean()


@pytest.mark.skipif(not ROOT, reason="finding escaped daemons by uid needs root")
def test_fallback_kills_daemons_that_leave_the_process_group(guard):
    daemon = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(60)\n    os._exit(0)\ntime.sleep(0.3)\n"
    )
    assert _run("fallback", daemon).passed
    guard.assert_clean()


def test_run_many_keeps_order_and_bounds_workers():
    _skip_unusable(_default_isolation())
    codes = [f"x = {i}" for i in range(6)]
    checks = [[f"assert x == {i}", "assert x % 2 == 0"] for i in range(6)]
    results = run_many(codes, checks, workers=2, **FAST)
    assert [r.checks_passed for r in results] == [2, 1, 2, 1, 2, 1]
    assert [r.passed for r in results] == [True, False] * 3
    assert run_many([], workers=2) == []


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="timeout"):
        run_python("x = 1", timeout=0)
    with pytest.raises(ValueError, match="isolation"):
        run_python("x = 1", isolation="docker")
    with pytest.raises(ValueError, match="strings"):
        run_python("x = 1", [1])
    with pytest.raises(ValueError, match="workers"):
        run_many(["x = 1"], workers=0)
    with pytest.raises(ValueError, match="lists of checks"):
        run_many(["x = 1", "x = 2"], [["assert x"]])


def test_sandbox_does_not_see_our_environment(monkeypatch):
    _skip_unusable(_default_isolation())
    monkeypatch.setenv("DACA_SECRET_TOKEN", "hunter2")
    code = "import os, sys\nassert 'DACA_SECRET_TOKEN' not in os.environ\n"
    assert run_python(code, **FAST).passed


def test_run_many_runs_identical_programs_once(monkeypatch):
    calls = []

    def fake_run(code, checks=(), **limits):
        calls.append((code, tuple(checks)))
        return ExecResult(code == "good", 0, False, "fake", "", "", 0, len(checks))

    monkeypatch.setattr(sandbox, "run_python", fake_run)
    monkeypatch.setattr(sandbox, "isolation_available", lambda: "bwrap")
    results = run_many(["good", "bad", "good", "good"], [["c"], ["c"], ["c"], ["d"]], workers=2)
    assert [r.passed for r in results] == [True, False, True, True]
    assert sorted(calls) == [("bad", ("c",)), ("good", ("c",)), ("good", ("d",))]


def test_task_count_of_our_uid_includes_our_threads():
    assert sandbox._tasks_of_uid(os.getuid()) >= threading.active_count()
    assert sandbox._tasks_of_uid(4_000_000) == 0


# ---------------------------------------------------------------- fail closed
@pytest.fixture
def fresh_probe(monkeypatch):
    """Forget this process's probe results and any opt-in, for the test only."""
    monkeypatch.setattr(sandbox, "_probed", {})
    monkeypatch.setattr(sandbox, "_probe_failures", {})
    monkeypatch.setattr(sandbox, "_fallback_warned", False)
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "0")  # restored (to unset) after the test


def _without_bwrap(monkeypatch, tmp_path, fake_bwrap: str | None = None):
    """A PATH with bwrap only as ``fake_bwrap`` (a shell script), if given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if fake_bwrap is not None:
        (bin_dir / "bwrap").write_text(f"#!/bin/sh\n{fake_bwrap}\n")
        (bin_dir / "bwrap").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))


def _count_executions(monkeypatch):
    calls = []
    real = sandbox._execute
    monkeypatch.setattr(sandbox, "_execute", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def test_without_bwrap_scoring_code_stops_before_any_execution(fresh_probe, monkeypatch, tmp_path):
    from daca.tasks import get_task

    _without_bwrap(monkeypatch, tmp_path)
    executions = _count_executions(monkeypatch)
    mbpp = get_task("mbpp")
    with pytest.raises(sandbox.SandboxUnavailable) as refused:
        mbpp.score(
            ["def add(a, b):\n    return a + b\n"],
            test_list=[["assert add(1, 2) == 3"]],
            test_imports=[[]],
        )
    assert executions == []  # refused before the first run, not after a probe of model code
    message = str(refused.value)
    assert "bwrap is not installed" in message
    assert "apt-get install bubblewrap" in message
    assert "sandbox: unsafe" in message and "DACA_UNSAFE_EXEC=1" in message
    with pytest.raises(sandbox.SandboxUnavailable):
        run_python("x = 1")


def test_a_bwrap_that_cannot_run_is_refused_too(fresh_probe, monkeypatch, tmp_path):
    # Present on PATH but failing (as where user namespaces are disabled): the probe run fails.
    _without_bwrap(monkeypatch, tmp_path, fake_bwrap="echo 'bwrap: No permissions' >&2; exit 1")
    with pytest.raises(sandbox.SandboxUnavailable, match="a probe run failed"):
        isolation_available()


@pytest.mark.skipif(not ROOT, reason="the unsafe path runs as a spare uid only as root")
def test_unsafe_execution_runs_only_when_asked_for(fresh_probe, monkeypatch, tmp_path):
    _without_bwrap(monkeypatch, tmp_path)
    with pytest.raises(sandbox.SandboxUnavailable):
        isolation_available()
    sandbox.allow_unsafe_execution()  # what `sandbox: unsafe` in the config does
    assert os.environ[sandbox.UNSAFE_ENV] == "1"  # inherited by reward worker processes
    with pytest.warns(RuntimeWarning, match="MUCH weaker"):
        assert isolation_available() == "fallback"
    result = run_python("x = 1", ["assert x == 1"], **FAST)
    assert result.passed


def test_config_names_the_sandbox_setting():
    from daca.train.config import ConfigError, load_config

    assert load_config().sandbox == "bwrap"
    assert load_config(overrides=["sandbox=unsafe"]).sandbox == "unsafe"
    with pytest.raises(ConfigError, match="sandbox"):
        load_config(overrides=["sandbox=none"])


def test_run_folders_of_killed_processes_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"daca-sandbox-{dead.pid}-abc123"
    live = tmp_path / f"daca-sandbox-{os.getpid()}-def456"
    for folder in (stale, live):
        (folder / "work").mkdir(parents=True)
    other = tmp_path / "daca-sandboxed-notes"
    other.mkdir()
    assert sandbox.remove_stale_run_dirs() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])


# ---------------------------------------------------------------- values of Calls
def test_calls_return_plain_data_and_nothing_else():
    _skip_unusable(_default_isolation())
    code = (
        "import collections\nclass Anything:\n    def __eq__(self, other):\n        return True\n"
        "class Liar(int):\n    def __eq__(self, other):\n        return True\n"
    )
    plain = "[1, -2.5, -0.0, float('inf'), 1+2j, 'a\\nb', b'\\x00', (), (1,), {1: {2}}, None]"
    calls = [plain, "Anything()", "Liar(5)", "collections.Counter('aab')", "1 / 0", "iter([])"]
    result = run_python(code, [sandbox.Call(c) for c in calls], **FAST)
    expected = [1, -2.5, -0.0, float("inf"), 1 + 2j, "a\nb", b"\x00", (), (1,), {1: {2}}, None]
    # Subclasses of plain types cross as their base value: Liar's __eq__ stays behind.
    assert result.values == {0: expected, 2: 5, 3: {"a": 2, "b": 1}}
    assert type(result.values[2]) is int and result.passed_indices == {0, 2, 3}
    assert "not plain data" in result.stderr_tail and "ZeroDivisionError" in result.stderr_tail


def test_decode_value_rebuilds_without_evaluating():
    assert sandbox.decode_value("[(1, -2.0), {'a': set([1])}, frozenset([]), float('nan')]")[
        :3
    ] == [
        (1, -2.0),
        {"a": {1}},
        frozenset(),
    ]
    for text in ("__import__('os')", "float('1e3')", "open('x')", "x", "[1, *y]", "1 + 2"):
        with pytest.raises(ValueError):
            sandbox.decode_value(text)


# ---------------------------------------------------------------- the host the program sees
PROJECT_FILE = str(Path(sandbox.__file__).resolve())
DATA_FILE = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "README.md")
PEEK = """
import os, socket
def peek():
    try:
{attempt}
    except Exception:
        return 'nothing'
    return 'ok'
"""
READ = "        open({path!r}, 'rb').read(1)"
CONNECT = "        socket.socket(socket.AF_UNIX).connect({path!r})"
LIST_ROOT = "        assert {{'work', 'etc', 'root'}} & set(os.listdir('/'))"


def _peek_rewards(attempts):
    """MBPP's reward of each completion whose ``peek()`` returns 'ok' when its attempt works."""
    from daca.tasks import get_task
    from daca.tasks.rewards import score_rewards

    task = get_task("mbpp")
    codes = [PEEK.format(attempt=a) for a in attempts]
    columns = {"test_list": [["assert peek() == 'ok'"]] * len(codes)}
    columns["test_imports"] = [[]] * len(codes)
    per_func, _, errors = score_rewards(
        task.reward_funcs, task.reward_weights, [""] * len(codes), codes, columns
    )
    assert errors == 0
    return per_func[:, 0].tolist()


def test_the_program_sees_only_the_python_runtime(monkeypatch):
    """Reading the project, the data, /etc, a host unix socket or listing / scores 0 through
    the public reward path; with the host's / bound read-only (the old view) each scored 1."""
    if _default_isolation() != "bwrap":
        pytest.skip("the minimal view is bubblewrap's")
    folders = [Path(tempfile.mkdtemp(dir=d)) for d in ("/tmp", "/var/tmp")]
    listeners = []
    try:
        for folder in folders:
            folder.chmod(0o777)
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(str(folder / "host.sock"))
            os.chmod(folder / "host.sock", 0o777)
            listener.listen(8)
            listeners.append(listener)
        files = [PROJECT_FILE, "/etc/hostname", "/etc/passwd"]
        files += [DATA_FILE] if os.path.exists(DATA_FILE) else []
        attempts = [READ.format(path=p) for p in files] + [LIST_ROOT.format()]
        attempts += [CONNECT.format(path=str(f / "host.sock")) for f in folders]
        assert _peek_rewards(attempts) == [0.0] * len(attempts)
        # The old view (in this process: score_rewards runs code rewards in a worker): each
        # attempt but the socket in /tmp (a private tmpfs there too) worked.
        monkeypatch.setattr(sandbox, "_FULL_HOST_VIEW", True)
        old = [
            run_python(PEEK.format(attempt=a), [sandbox.Call("peek()")], **FAST) for a in attempts
        ]
        assert [r.values.get(0) for r in old] == ["ok"] * (len(attempts) - 2) + ["nothing", "ok"]
    finally:
        for listener in listeners:
            listener.close()
        for folder in folders:
            (folder / "host.sock").unlink(missing_ok=True)
            folder.rmdir()


def test_the_runtime_view_is_the_interpreter_and_libraries_only():
    if _default_isolation() != "bwrap":
        pytest.skip("the minimal view is bubblewrap's")
    code = (
        "import os, json, math, re, collections, heapq, itertools, fractions, decimal, random\n"
        "top = sorted(os.listdir('/'))\n"
        "sites = [p for p in __import__('sys').path if 'packages' in p]\n"
    )
    result = run_python(code, [sandbox.Call("top"), sandbox.Call("sites")], **FAST)
    assert result.passed, result.reason
    assert set(result.values[0]) <= {"bin", "dev", "lib", "lib32", "lib64", "proc", "tmp", "usr"}
    assert result.values[1] == []
    # Writable: the private scratch only, never the new root.
    assert not run_python("open('/new.txt', 'w').write('x')\n", **FAST).passed


# ---------------------------------------------------------------- limits per sandbox
CHILDREN_HOLD_MEMORY = """
import os, time
children = []
for i in range(6):
    pid = os.fork()
    if pid == 0:
        held = b"\\x01" * (200 * 1024 * 1024)
        time.sleep(1)
        os._exit(0)
    children.append(pid)
assert all(os.waitpid(child, 0)[1] == 0 for child in children)
"""
MEMFDS = """
import os
fds = []
for i in range({count}):
    fd = os.memfd_create("m%d" % i)
    data = memoryview(b"\\x01" * ({mb} * 1024 * 1024))
    while data:
        data = data[os.write(fd, data) :]
    fds.append(fd)
"""


def _needs_cgroups():
    _skip_unusable("bwrap")
    if not sandbox._cgroup_parent_folders():
        pytest.skip("no usable cgroups here (not root, or no delegation): per-process limits")


def test_memory_is_capped_for_the_sandbox_as_a_whole(guard):
    """6 children of 200 MB each passed a per-process limit of 256 MB (1.2 GB in all)."""
    _needs_cgroups()
    result = run_python(CHILDREN_HOLD_MEMORY, **{**FAST, "timeout": 20.0})
    assert not result.passed
    guard.assert_clean()


def test_memfds_count_against_the_sandbox(guard):
    _needs_cgroups()
    limits = {**FAST, "timeout": 20.0, "max_file_mb": 16, "scratch_mb": 16}
    # One memfd larger than the scratch space is refused, and so are many that together
    # exceed the sandbox's memory (450 MB under memory_mb=256).
    assert run_python(MEMFDS.format(count=1, mb=15), **limits).passed
    assert not run_python(MEMFDS.format(count=1, mb=17), **limits).passed
    assert not run_python(MEMFDS.format(count=30, mb=15), **limits).passed
    guard.assert_clean()
    # The sandbox cgroups are kept for the next runs (creating one is slow), empty.
    ours = [
        os.path.join(parent, name)
        for _, parent in sandbox._cgroup_parent_folders()
        for name in os.listdir(parent)
        if name.startswith(f"daca-sandbox-{os.getpid()}-")
    ]
    assert ours and not [f for f in ours if sandbox._tasks_in(f)]
