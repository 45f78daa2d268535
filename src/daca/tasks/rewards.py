"""Combining a task's reward functions (TRL signature) under a time limit that stops them, with
errors that name the culprit.

Rewards run regexes, parsers and validators on text a policy wrote. One completion can make a
regex backtrack for hours inside C code that holds the GIL (no Python thread can interrupt it), or
exhaust the recursion limit of a parser. So:

- daca's own reward functions (defined in a ``daca.*`` module, or any function carrying the
  attribute ``reward_guard = "process"``) run in a persistent worker process, which is killed
  with its process group when a call overruns. A function gets ``timeout`` seconds for the
  batch; past that, a fresh worker scores the batch again one example at a time, each example
  with an equal share of ``timeout`` (at least 1 s, or ``timeout`` if shorter): an example that
  overruns its share is stopped, scores 0 and is logged with its index, and the rest go on. One
  hostile example thus costs about ``timeout`` + its share (+ ~0.2 s to start a worker).
- Other functions (a user's: they may hold a model or state that must not be copied into another
  process; ``reward_guard = "thread"`` asks for this too) run in a daemon thread, whose limit is
  soft: a call that does not return is abandoned, and its batch scores 0.
- An exception that a completion provokes in a parser (RecursionError, MemoryError, UnicodeError,
  OverflowError) scores 0 for that example and is logged; any other exception is a bug of the
  reward function and follows ``on_error``. A timeout follows ``on_timeout``.

This module imports nothing heavy at import time: the worker imports it by itself.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import marshal
import math
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types

log = logging.getLogger(__name__)

# Exceptions that a completion, not a bug, provokes in a parser: always scored 0.
OUTPUT_ERRORS = (RecursionError, MemoryError, UnicodeError, OverflowError)
_START_TIMEOUT = 120.0  # seconds for a new worker to import its functions
_FLUSH_AFTER = 0.05  # seconds of scoring after which the worker sends what it has finished


class RewardError(RuntimeError):
    """A reward function raised or hung; the message names the function and the example."""


class RewardTimeout(Exception):
    """A reward function did not return within the time limit."""


def _name(func) -> str:
    return getattr(func, "__name__", type(func).__name__)


def _short(text, limit: int = 300) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else f"{shown[:limit]}... ({len(str(text))} characters)"


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[:500]}"


# ------------------------------------------------------------------ calling one function
def _apply(func, style: str, prompts, completions, columns) -> list:
    """``func`` on a batch: TRL's ``f(prompts=, completions=, **columns)`` or a task's
    ``score(completions, **columns)``."""
    if style == "score":
        return list(func(completions, **columns))
    return list(func(prompts=prompts, completions=completions, **columns))


def _outcome_of(func, style, prompts, completions, columns) -> tuple[str, object]:
    """("ok", value) | ("output", why) | ("error", why) for a batch of one example."""
    try:
        values = _apply(func, style, prompts, completions, columns)
        if len(values) != 1:
            return "error", f"returned {len(values)} values for 1 completion"
        return "ok", float(values[0])
    except OUTPUT_ERRORS as e:
        return "output", _describe(e)
    except Exception as e:  # noqa: BLE001 - reported with its example by the caller
        return "error", _describe(e)


def _example(i: int, prompts, completions, columns):
    return [prompts[i]], [completions[i]], {k: [v[i]] for k, v in columns.items()}


_PROGRESS = struct.Struct("qq")  # (function, example) in progress; example -1: the whole batch


def _mark(progress, function: int, example: int) -> None:
    if progress is not None:
        _PROGRESS.pack_into(progress, 0, function, example)


def _score_examples(
    func, style, batch, skip=None, progress=None, at: int = 0
) -> list[tuple[str, object]]:
    """One outcome per example. ``skip`` None: the whole batch in one call first (example by
    example if it raises); else example by example, ``skip`` holding outcomes already known (a
    timed-out example). ``progress`` (shared memory) receives (``at``, example in progress)."""
    prompts, completions, columns = batch
    if skip is None:
        _mark(progress, at, -1)
        try:
            values = _apply(func, style, prompts, completions, columns)
            if len(values) == len(completions):
                return [("ok", float(v)) for v in values]
        except Exception:  # noqa: BLE001,S110 - found example by example below
            pass
        skip = {}
    outcomes = []
    for i in range(len(completions)):
        if i in skip:
            outcomes.append(skip[i])
            continue
        _mark(progress, at, i)
        outcomes.append(_outcome_of(func, style, *_example(i, prompts, completions, columns)))
    return outcomes


# ------------------------------------------------------------------ the soft (thread) limit
def _within(timeout: float | None, func, *args):
    """``func(*args)``, in a daemon thread when ``timeout`` is set: RewardTimeout after
    ``timeout`` s. A hung call cannot be stopped from Python; its thread is abandoned (a daemon,
    so it does not keep the process alive)."""
    if timeout is None:
        return func(*args)
    box = {}

    def target():
        try:
            box["value"] = func(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller below
            box["error"] = e

    worker = threading.Thread(target=target, daemon=True, name=f"reward-{_name(func)}")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise RewardTimeout(f"no answer within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _in_thread(func, style, batch, timeout) -> list[tuple[str, object]]:
    """The batch in one call; example by example (each under ``timeout``) when it raises."""
    prompts, completions, columns = batch
    try:
        values = _within(timeout, _apply, func, style, prompts, completions, columns)
    except RewardTimeout:
        return [("batch_timeout", f"{timeout:g} s")] * len(completions)
    except Exception:  # noqa: BLE001 - found example by example below
        values = None
    if values is not None:
        if len(values) != len(completions):
            raise RewardError(
                f"reward function {_name(func)} returned {len(values)} values "
                f"for {len(completions)} completions"
            )
        return [("ok", float(v)) for v in values]
    outcomes = []
    for i in range(len(completions)):
        try:
            one = _within(timeout, _outcome_of, func, style, *_example(i, *batch))
        except RewardTimeout as e:
            one = ("timeout", str(e))
        outcomes.append(one)
    return outcomes


# ------------------------------------------------------------------ the hard (process) limit
def _importable(func) -> bool:
    """Whether pickle can find ``func`` by its module and qualified name."""
    obj = sys.modules.get(getattr(func, "__module__", None) or "")
    for part in getattr(func, "__qualname__", "<?>").split("."):
        obj = getattr(obj, part, None)
    return obj is func


def _rebuild_function(code, module, name, qualname, defaults, kwdefaults, cells, attrs):
    namespace = importlib.import_module(module).__dict__
    closure = tuple(types.CellType(c) for c in cells) or None
    func = types.FunctionType(marshal.loads(code), namespace, name, defaults, closure)
    func.__qualname__, func.__kwdefaults__ = qualname, kwdefaults
    func.__dict__.update(attrs)
    return func


class _FunctionPickler(pickle.Pickler):
    """Pickles a nested function (a closure a task factory made) by value: its code, its module
    (imported by name in the worker, same interpreter) and its closure's contents."""

    def reducer_override(self, obj):
        if isinstance(obj, types.FunctionType) and not _importable(obj):
            cells = tuple(c.cell_contents for c in obj.__closure__ or ())
            code = marshal.dumps(obj.__code__)
            return _rebuild_function, (
                code,
                obj.__module__,
                obj.__name__,
                obj.__qualname__,
                obj.__defaults__,
                obj.__kwdefaults__,
                cells,
                obj.__dict__,
            )
        return NotImplemented


def _dumps(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    _FunctionPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _runs_in_worker(func) -> bool:
    mode = getattr(func, "reward_guard", None)
    if mode is not None:
        return mode == "process"
    module = getattr(func, "__module__", None) or ""
    return module.startswith("daca.") and hasattr(signal, "SIGKILL")


# Run by ``python -c``. daca/__init__ imports torch for the user's convenience; the worker needs
# only the tasks, so a bare package object stands in for it (startup in ~0.1 s, not seconds).
_WORKER_CODE = """\
import importlib.util, json, sys, types
sys.path[:] = json.loads(sys.argv[1])
spec = importlib.util.find_spec("daca")
package = types.ModuleType("daca")
package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec
sys.modules["daca"] = package
from daca.tasks.rewards import _serve
_serve(*map(int, sys.argv[2:]))
"""


def _die_with_parent(parent: int, from_main_thread: int) -> None:
    """Linux: the kernel kills this worker when its parent dies (even if stuck in C code)."""
    if from_main_thread and sys.platform.startswith("linux"):
        import ctypes

        with_errno = ctypes.CDLL(None, use_errno=True)
        with_errno.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


def _serve(sock_fd: int, progress_fd: int, parent: int, from_main_thread: int) -> None:
    """The worker's loop: ("load", key, pickled function) -> error or None;
    ("batch", prompts, completions, columns) -> nothing; ("run", keys, style, skips) -> lists
    of (position, outcomes), one per function, sent as they are finished."""
    from multiprocessing.connection import Connection

    _die_with_parent(parent, from_main_thread)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    conn = Connection(sock_fd)
    progress = mmap.mmap(progress_fd, _PROGRESS.size)
    funcs, batch = {}, None
    conn.send_bytes(pickle.dumps("ready"))
    while True:
        try:
            kind, *args = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if kind == "batch":
            batch = args
        elif kind == "load":
            try:
                funcs[args[0]] = pickle.loads(args[1])
                reply = None
            except Exception as e:  # noqa: BLE001 - the parent falls back to a thread
                reply = _describe(e)
            conn.send_bytes(pickle.dumps(reply))
        else:
            keys, style, skips = args
            done, since = [], time.monotonic()
            for at, (key, skip) in enumerate(zip(keys, skips, strict=True)):
                done.append((at, _score_examples(funcs[key], style, batch, skip, progress, at)))
                # One message for quick functions (a wake-up of the parent costs ~0.1 ms);
                # what took long is sent at once, so that a later timeout does not lose it.
                if at == len(keys) - 1 or time.monotonic() - since > _FLUSH_AFTER:
                    conn.send_bytes(pickle.dumps(done, protocol=pickle.HIGHEST_PROTOCOL))
                    done, since = [], time.monotonic()


class _Unusable(Exception):
    """This function or batch cannot go to the worker (not picklable, not importable there)."""


class RewardGuard:
    """A persistent worker process that scores examples and is killed at a deadline.

    Cheap when nothing times out: the worker stays up across calls, keeps the functions it has
    loaded and their caches (compiled schemas), and receives each batch once per ``begin``.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn = None
        self._progress: mmap.mmap | None = None
        self._loaded: dict[int, object] = {}  # id -> function, loaded in the current worker
        self._refused: dict[int, object] = {}  # id -> function that cannot go to a worker
        self._pending: tuple = ([], [], {})
        self._batch: bytes | None = None
        self._batch_sent = False

    # -- worker lifecycle
    def _start(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        with tempfile.TemporaryFile() as shared:
            shared.truncate(_PROGRESS.size)
            self._progress = mmap.mmap(shared.fileno(), _PROGRESS.size)
            from_main = int(threading.current_thread() is threading.main_thread())
            fds = (child_sock.fileno(), shared.fileno())
            argv = [json.dumps(sys.path), *map(str, (*fds, os.getpid(), from_main))]
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER_CODE, *argv],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: killed with what it started
            )
        child_sock.close()
        from multiprocessing.connection import Connection

        self._conn = Connection(parent_sock.detach())
        if self._receive(_START_TIMEOUT) != "ready":
            self.close()
            raise _Unusable("the reward worker process did not start")

    def close(self) -> None:
        """Kill the worker (and its process group) now."""
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except OSError:
                self._proc.kill()
            self._proc.wait()
            self._conn.close()
        self._proc = self._conn = None
        self._loaded.clear()
        self._batch_sent = False

    def _receive(self, timeout: float | None):
        """The worker's next reply; "timeout" or "died" as strings when none comes."""
        try:
            if not self._conn.poll(timeout):
                return "timeout"
            return pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            return "died"

    def _send(self, message: bytes) -> None:
        self._conn.send_bytes(message)

    def _load(self, func) -> None:
        if id(func) in self._loaded:
            return
        try:
            payload = _dumps(("load", id(func), _dumps(func)))
        except Exception as e:  # noqa: BLE001 - any pickling failure: run it in a thread
            raise _Unusable(_describe(e)) from None
        self._send(payload)
        reply = self._receive(_START_TIMEOUT)
        if reply is not None:
            raise _Unusable(f"the worker could not load it ({reply})")
        self._loaded[id(func)] = func

    def _ready_for(self, funcs) -> list[int]:
        """Positions of ``funcs`` that could not be loaded in the worker (run them in a thread)."""
        if self._proc is None or self._proc.poll() is not None:
            self.close()
            self._start()
        refused = []
        for p, func in enumerate(funcs):
            try:
                self._load(func)
            except _Unusable as e:
                log.info("reward function %s runs in a thread: %s", _name(func), e)
                self._refused[id(func)] = func
                refused.append(p)
        if not self._batch_sent:
            self._send(self._batch_bytes())
            self._batch_sent = True
        return refused

    def _batch_bytes(self) -> bytes:
        if self._batch is None:
            prompts, completions, columns = self._pending
            try:
                self._batch = pickle.dumps(
                    ("batch", prompts, completions, dict(columns)), pickle.HIGHEST_PROTOCOL
                )
            except Exception as e:  # noqa: BLE001 - unpicklable columns: run in a thread
                raise _Unusable(f"the batch cannot be pickled ({_describe(e)})") from None
        return self._batch

    # -- scoring
    def begin(self, prompts, completions, columns) -> None:
        """The batch that the next ``score`` calls score (pickled once, when first needed)."""
        with self._lock:
            self._pending = (prompts, completions, columns)
            self._batch, self._batch_sent = None, False

    def score(self, funcs, style: str, n: int, timeout: float | None, stop_at_timeout: bool):
        """Outcomes of each of ``funcs`` on the current batch of ``n`` examples; None for a
        function that cannot run in the worker (the caller then runs it in a thread)."""
        with self._lock:
            results = [None if id(f) in self._refused else [] for f in funcs]
            if self._batch is None and not self._batch_ok():
                return [None] * len(funcs)
            modes = {p: None for p, r in enumerate(results) if r is not None}  # None: batch
            share = None if timeout is None else max(timeout / max(n, 1), min(timeout, 1.0))
            while modes:
                sent = list(modes)
                for p in self._ready_for([funcs[p] for p in sent]):
                    del modes[sent[p]]
                    results[sent[p]] = None
                sent = list(modes)
                _mark(self._progress, -2, -2)  # not started
                keys = [id(funcs[p]) for p in sent]
                self._send(pickle.dumps(("run", keys, style, [modes[p] for p in sent])))
                while modes and isinstance(reply := self._watch(timeout, share), list):
                    for at, outcomes in reply:
                        results[sent[at]] = outcomes
                        del modes[sent[at]]
                if not modes:
                    break
                at, example = _PROGRESS.unpack_from(self._progress, 0)
                why = self._death() if reply == "died" else "no answer within {:g} s"
                self.close()
                if at < 0:  # died before scoring anything: nothing to blame, nothing to retry
                    for p in modes:
                        results[p] = [("timeout", why.format(timeout))] * n
                    break
                p = sent[at]
                if modes[p] is None:  # which example? one by one, each with its share
                    modes[p] = {}
                    continue
                modes[p][example] = ("timeout", why.format(share))
                if stop_at_timeout or len(modes[p]) == n:
                    results[p] = [modes.pop(p).get(i, ("unscored", "")) for i in range(n)]
                    if stop_at_timeout:
                        break
            for p in modes:  # not reached: an earlier function's timeout stops the run
                results[p] = [("unscored", "")] * n
            return results

    def _batch_ok(self) -> bool:
        try:
            self._batch_bytes()
            return True
        except _Unusable as e:
            log.info("reward functions run in threads: %s", e)
            return False

    def _watch(self, timeout: float | None, share: float | None):
        """The next reply of a run, or "timeout" once the call in progress (a function on the
        batch, or on one example) has run longer than ``timeout`` (``share``): the worker writes
        (function, example) in progress to shared memory."""
        if timeout is None:
            return self._receive(None)
        last, since = None, time.monotonic()
        while (reply := self._receive(min(timeout, share) / 8)) == "timeout":
            now = _PROGRESS.unpack_from(self._progress, 0)
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= (timeout if now[1] < 0 else share):
                return "timeout"
        return reply

    def _death(self) -> str:
        try:
            code = self._proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None and code < 0:
            return f"the worker process died: signal {signal.Signals(-code).name}"
        return f"the worker process died: exit status {code}"


_guard: RewardGuard | None = None


def reward_guard() -> RewardGuard:
    """The process-wide guard (its worker starts on first use and is killed at exit)."""
    global _guard
    if _guard is None:
        _guard = RewardGuard()
        atexit.register(_guard.close)
    return _guard


# ------------------------------------------------------------------ combining
def _failure(func, i, status, why, batch) -> str:
    prompts, completions = batch[0], batch[1]
    name = _name(func)
    if status == "batch_timeout":
        return (
            f"reward function {name} did not return within {why} on a batch of "
            f"{len(completions)} completions (the first: {_short(completions[0])})"
        )
    if status == "timeout":
        return f"reward function {name} was stopped on example {i} ({why}; completion " + (
            f"{_short(completions[i])})"
        )
    return (
        f"reward function {name} failed on example {i} (prompt {_short(prompts[i])}, "
        f"completion {_short(completions[i])}): {why}"
    )


def _settle(func, i, outcome, batch, on_error, on_timeout) -> float | None:
    """The score of example ``i``: its value; or None when it scores 0 (logged); or RewardError
    as ``on_error`` / ``on_timeout`` say."""
    status, value = outcome
    if status == "ok" and math.isfinite(value):
        return value
    if status == "unscored":  # not reached: an earlier example raised
        return None
    if status == "ok":
        status, value = "error", f"non-finite reward {value}"
    message = _failure(func, i, status, value, batch)
    if status in ("timeout", "batch_timeout") and on_timeout == "raise":
        raise RewardError(
            f"{message}; fix the function, raise reward_timeout, or set on_reward_timeout=zero "
            "to score such examples 0"
        )
    if status == "error" and on_error == "raise":
        raise RewardError(message)
    log.warning("%s; it scores 0", message)
    return None


def _score_matrix(funcs, style, batch, *, on_error, on_timeout, timeout) -> tuple[list, int]:
    """[n][F] scores (0 for what failed) and the number of zeroed failures."""
    n = len(batch[1])
    rows, errors = [[0.0] * len(funcs) for _ in range(n)], 0
    guarded = [f for f, func in enumerate(funcs) if _runs_in_worker(func)]
    outcomes = dict.fromkeys(range(len(funcs)))
    if guarded:
        guard = reward_guard()
        guard.begin(*batch)
        got = guard.score([funcs[f] for f in guarded], style, n, timeout, on_timeout == "raise")
        outcomes.update(zip(guarded, got, strict=True))
    for f, func in enumerate(funcs):
        if outcomes[f] is None:
            outcomes[f] = _in_thread(func, style, batch, timeout)
        for i, outcome in enumerate(outcomes[f]):
            value = _settle(func, i, outcome, batch, on_error, on_timeout)
            if value is None:
                errors += outcome[0] != "unscored"
            else:
                rows[i][f] = value
    return rows, errors


def score_rewards(
    funcs,
    weights,
    prompts: list[str],
    completions: list[str],
    columns: dict,
    *,
    on_error="raise",
    on_timeout="zero",
    timeout: float | None = None,
):
    """Per-function rewards [B, F], their weighted sum [B], and the count of zeroed failures.

    ``on_error``: an exception of a reward function on an example (a bug: not one of
    OUTPUT_ERRORS, which always score 0) raises RewardError naming both (``"raise"``) or scores
    it 0 (``"zero"``); a NaN or infinite reward counts as such an error. ``timeout``: seconds a
    function may take on the batch (None: no limit); an example still running then scores 0,
    logged with its index (``on_timeout="zero"``), or raises RewardError (``"raise"``). See the
    module docstring for which functions are stopped for certain and which are abandoned.
    """
    import torch

    batch = (list(prompts), list(completions), columns)
    rows, errors = _score_matrix(
        funcs, "trl", batch, on_error=on_error, on_timeout=on_timeout, timeout=timeout
    )
    per_func = torch.tensor(rows, dtype=torch.float64).reshape(len(completions), len(funcs))
    total = per_func @ torch.tensor(weights, dtype=torch.float64)
    return per_func.float(), total.float(), errors


def score_completions(
    score, completions, columns: dict, *, on_error="raise", on_timeout="zero", timeout=None
) -> list[float]:
    """A task's evaluation metric ``score(completions, **columns)`` per completion, guarded as
    ``score_rewards`` guards reward functions (what fails scores 0 or raises RewardError)."""
    batch = ([None] * len(completions), list(completions), columns)
    rows, _ = _score_matrix(
        [score], "score", batch, on_error=on_error, on_timeout=on_timeout, timeout=timeout
    )
    return [row[0] for row in rows]
