"""Combining a task's reward functions (TRL signature) under a time limit that stops them, with
errors that name the culprit.

Rewards run regexes, parsers and validators on text a policy wrote. One completion can make a
regex backtrack for hours inside C code that holds the GIL (no Python thread can interrupt it), or
exhaust the recursion limit of a parser. So:

- daca's own reward functions (defined in a ``daca.*`` module, or any function carrying the
  attribute ``reward_guard = "process"``) run in a persistent worker process. ``timeout``
  bounds one completion's scoring, all its task's guarded functions together: the worker
  scores the batch with each function in one call, all within ``timeout``. Past that (or when
  it dies) it is killed with its process group, and a fresh worker scores what is left example
  by example, each example in a process of its own forked from it (RESCUE_WIDTH at once), with
  what is left of ``timeout`` but at least RESCUE_SECONDS: an
  example still running then is stopped, scores 0 and is logged with its index (the functions
  after the one it was stopped in are not run on it), and the others keep their scores. One
  restart serves the whole batch and its hostile examples are stopped together, so a
  completion's scoring ends within ``timeout`` + RESCUE_SECONDS + the restart (~0.2 s, plus
  re-importing what the last worker had imported: ~0.4 s for math-verify), for up to
  RESCUE_WIDTH hostile completions in a batch (each further RESCUE_WIDTH: one more share).
  A function may carry ``reward_warmup``, a callable the worker runs once after loading it
  (imports, caches), outside any limit.
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
import contextlib
import importlib
import json
import logging
import marshal
import math
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import types

log = logging.getLogger(__name__)

# Exceptions that a completion, not a bug, provokes in a parser: always scored 0.
OUTPUT_ERRORS = (RecursionError, MemoryError, UnicodeError, OverflowError)
_START_TIMEOUT = 120.0  # seconds for a new worker to import its functions
_FLUSH_AFTER = 0.05  # seconds of scoring after which the worker sends what it has finished
RESCUE_WIDTH = 32  # examples scored at once, each in its own process, after a batch overran
RESCUE_SECONDS = 1.0  # the least time each of them gets then (see _rescue_budget)
_REPLY_MARGIN = 5.0  # seconds past its own deadlines after which a rescuing worker is killed


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


def _score_examples(func, style, batch) -> list[tuple[str, object]]:
    """One outcome per example: the whole batch in one call; example by example if it raises
    (to find the examples that make it raise)."""
    prompts, completions, columns = batch
    try:
        values = _apply(func, style, prompts, completions, columns)
        if len(values) == len(completions):
            return [("ok", float(v)) for v in values]
    except Exception:  # noqa: BLE001,S110 - found example by example below
        pass
    return [
        _outcome_of(func, style, *_example(i, prompts, completions, columns))
        for i in range(len(completions))
    ]


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


def _kill_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (even if stuck in C code)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with_errno = ctypes.CDLL(None, use_errno=True)
        with_errno.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _die_with_parent(parent: int, from_main_thread: int) -> None:
    # PR_SET_PDEATHSIG follows the parent *thread*: only the main thread's lives as long as it.
    if from_main_thread:
        _kill_with_parent()
    if os.getppid() != parent:
        os._exit(0)


def _imported_since(known: set[str]) -> list[str]:
    """Modules imported since ``known`` was taken (``known`` is brought up to date)."""
    if len(sys.modules) == len(known):
        return []
    new = [name for name in list(sys.modules) if name not in known]
    known.update(new)
    return new


def _warm(names) -> None:
    """Import the modules a killed worker had imported, so that the examples forked from this
    one do not each import them again (math-verify and sympy: ~0.4 s)."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001,S112 - a module that cannot be imported by name
            continue


def _warm_up(func) -> None:
    """A function's ``reward_warmup()`` (imports, caches), run once where it is loaded: its cost
    then does not count against the first batch's time."""
    warm_up = getattr(func, "reward_warmup", None)
    if callable(warm_up):
        with contextlib.suppress(Exception):  # the scoring itself will say what is wrong
            warm_up()


def _serve(sock_fd: int, parent: int, from_main_thread: int) -> None:
    """The worker's loop: ("load", key, pickled function) -> error or None;
    ("batch", prompts, completions, columns) -> nothing; ("warm", module names) -> None;
    ("run", keys, style) -> lists of (position, outcomes), one per function, sent as they are
    finished, each with the modules imported meanwhile; ("rescue", keys, style, todo, budget,
    late) -> {example: [(position, outcome)]} (see ``_rescue``)."""
    from multiprocessing.connection import Connection

    _die_with_parent(parent, from_main_thread)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    conn = Connection(sock_fd)
    funcs, batch, known = {}, None, set(sys.modules)
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
            if reply is None:
                _warm_up(funcs[args[0]])
            conn.send_bytes(pickle.dumps(reply))
        elif kind == "warm":
            _warm(args[0])
            known.update(sys.modules)
            conn.send_bytes(pickle.dumps(None))
        elif kind == "rescue":
            keys, style, todo, budget, late = args
            found = _rescue([funcs[k] for k in keys], style, batch, todo, budget, late)
            conn.send_bytes(pickle.dumps(found, protocol=pickle.HIGHEST_PROTOCOL))
        else:
            _run(conn, [funcs[k] for k in args[0]], args[1], batch, known)


def _run(conn, funcs, style, batch, known: set[str]) -> None:
    done, since = [], time.monotonic()
    for at, func in enumerate(funcs):
        done.append((at, _score_examples(func, style, batch)))
        # One message for quick functions (a wake-up of the parent costs ~0.1 ms); what took
        # long is sent at once, so that a later timeout does not lose it.
        if at == len(funcs) - 1 or time.monotonic() - since > _FLUSH_AFTER:
            message = (done, _imported_since(known))
            conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
            done, since = [], time.monotonic()


# ------------------------------------------------------------------ rescue: example by example
_FRAME = struct.Struct("I")  # the length of a pickled (position, outcome) on a rescue pipe


def _score_in_child(funcs, style, batch, example: int, positions, pipe: int) -> None:
    """In a forked process: ``example`` by each function at ``positions``, each outcome
    written to ``pipe`` as soon as known (what was finished counts if a later one hangs)."""
    try:
        _kill_with_parent()
        one = _example(example, *batch)
        for p in positions:
            frame = pickle.dumps((p, _outcome_of(funcs[p], style, *one)))
            data = memoryview(_FRAME.pack(len(frame)) + frame)
            while data:
                data = data[os.write(pipe, data) :]
    finally:
        os._exit(0)


def _frames(data: bytes) -> list:
    found, at = [], 0
    while at + _FRAME.size <= len(data):
        (size,) = _FRAME.unpack_from(data, at)
        if at + _FRAME.size + size > len(data):
            break
        found.append(pickle.loads(data[at + _FRAME.size : at + _FRAME.size + size]))
        at += _FRAME.size + size
    return found


class _Child:
    """A forked process scoring one example; ``deadline`` None: no limit."""

    def __init__(self, funcs, style, batch, example, positions, budget):
        self.example, self.positions, self.data = example, positions, bytearray()
        self.deadline = None if budget is None else time.monotonic() + budget
        self.pipe, write = os.pipe()
        try:
            self.pid = os.fork()
        except OSError:
            os.close(self.pipe)
            os.close(write)
            raise
        if self.pid == 0:
            os.close(self.pipe)
            _score_in_child(funcs, style, batch, example, positions, write)
        os.close(write)

    def outcomes(self, why: str) -> list:
        """(position, outcome) per position: the outcomes it wrote; ("timeout", ``why``) for
        the function it was stopped in; "unscored" for the functions after it."""
        status = os.waitpid(self.pid, 0)[1]
        os.set_blocking(self.pipe, False)
        try:  # what it wrote before it was stopped
            while chunk := os.read(self.pipe, 1 << 16):
                self.data += chunk
        except BlockingIOError:  # a process it started still holds the pipe open
            pass
        os.close(self.pipe)
        found = dict(_frames(bytes(self.data)))
        if os.WIFSIGNALED(status) and why == "died":
            why = f"its process died: signal {signal.Signals(os.WTERMSIG(status)).name}"
        elif why == "died":
            why = f"its process ended without scoring it (exit status {os.WEXITSTATUS(status)})"
        # The first function it did not finish is blamed; the later ones were never reached.
        missing = [p for p in self.positions if p not in found]
        found.update((p, ("unscored", "")) for p in missing[1:])
        if missing:
            found[missing[0]] = ("timeout", why)
        return [(p, found[p]) for p in self.positions]


def _rescue(funcs, style, batch, todo, budget: float | None, late: str) -> dict[int, list]:
    """``todo`` [(example, positions of funcs)]: each example scored by those functions in a
    process forked from this one, RESCUE_WIDTH at once, each stopped ``budget`` s after it
    started (None: never; its outcomes then ("timeout", ``late``)).
    -> {example: [(position, outcome)]}."""
    waiting, running, found = list(reversed(todo)), {}, {}
    while waiting or running:
        while waiting and len(running) < RESCUE_WIDTH:
            example, positions = waiting.pop()
            try:
                child = _Child(funcs, style, batch, example, positions, budget)
            except OSError as e:  # no process to be had: this example is not scored
                found[example] = [(p, ("timeout", f"cannot fork: {e}")) for p in positions]
                continue
            running[child.pipe] = child
        deadlines = [c.deadline for c in running.values() if c.deadline is not None]
        wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        for pipe in select.select(list(running), [], [], wait)[0]:
            chunk = os.read(pipe, 1 << 16)
            if chunk:
                running[pipe].data += chunk
            else:  # it has finished, died, or closed its pipe (then it is stopped now)
                child = running.pop(pipe)
                os.kill(child.pid, signal.SIGKILL)  # not reaped yet: the pid is still its
                found[child.example] = child.outcomes("died")
        now = time.monotonic()
        for pipe, child in list(running.items()):
            if child.deadline is not None and now >= child.deadline:
                os.kill(child.pid, signal.SIGKILL)
                del running[pipe]
                found[child.example] = child.outcomes(late)
    return found


def _rescue_budget(timeout: float | None, spent: float) -> float | None:
    """Seconds each example gets when it is scored on its own after the batch ran ``spent`` s:
    what is left of ``timeout``, and at least RESCUE_SECONDS, so that the quick examples of a
    batch that ran out of time are still scored (on a loaded machine too)."""
    if timeout is None:
        return None
    return max(timeout - spent, RESCUE_SECONDS)


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
        self._loaded: dict[int, object] = {}  # id -> function, loaded in the current worker
        self._refused: dict[int, object] = {}  # id -> function that cannot go to a worker
        self._modules: dict[str, None] = {}  # modules the workers imported, in order
        self._pending: tuple = ([], [], {})
        self._batch: bytes | None = None
        self._batch_sent = False

    # -- worker lifecycle
    def _start(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        from_main = int(threading.current_thread() is threading.main_thread())
        fd = child_sock.fileno()
        argv = [json.dumps(sys.path), *map(str, (fd, os.getpid(), from_main))]
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE, *argv],
            pass_fds=(fd,),
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

    def _try_send(self, message: bytes) -> bool:
        """Whether ``message`` reached the worker (False: it has died)."""
        try:
            self._send(message)
            return True
        except OSError:
            return False

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
        function that cannot run in the worker (the caller then runs it in a thread).
        ``stop_at_timeout`` is kept for callers; every example is scored either way."""
        with self._lock:
            if self._batch is None and not self._batch_ok():
                return [None] * len(funcs)
            results = [None if id(f) in self._refused else [] for f in funcs]
            todo = self._loadable(funcs, results)
            start = time.monotonic()
            left = self._run_batch(funcs, todo, style, results, timeout) if todo else []
            if left:
                late = f"no answer within reward_timeout={timeout} s"
                budget = _rescue_budget(timeout, time.monotonic() - start)
                self._rescue(funcs, left, style, n, results, budget, late)
            return results

    def _loadable(self, funcs, results) -> list[int]:
        """Positions of ``funcs`` loaded in the worker (the others' results become None)."""
        todo = [p for p, r in enumerate(results) if r is not None]
        for q in self._ready_for([funcs[p] for p in todo]):
            results[todo[q]] = None
        return [p for p in todo if results[p] is not None]

    def _run_batch(self, funcs, todo, style, results, budget) -> list[int]:
        """Each function at ``todo`` on the whole batch, all within ``budget`` s; the positions
        not finished then (the worker is then killed)."""
        deadline = None if budget is None else time.monotonic() + budget
        sent = self._try_send(pickle.dumps(("run", [id(funcs[p]) for p in todo], style)))
        left = dict.fromkeys(todo)
        while left:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            reply = self._receive(wait) if sent else "died"
            if not isinstance(reply, tuple):  # "timeout" or "died"
                self.close()
                break
            done, modules = reply
            self._modules.update(dict.fromkeys(modules))
            for at, outcomes in done:
                results[todo[at]] = outcomes
                del left[todo[at]]
        return list(left)

    def _rescue(self, funcs, left, style, n, results, budget, late) -> None:
        """The functions at ``left`` example by example, each example in a process of its own
        within ``budget`` s (a fresh worker, warmed with the modules the last one imported)."""
        try:
            self._ready_for([funcs[p] for p in left])
            self._send(pickle.dumps(("warm", list(self._modules))))
            warmed = self._receive(_START_TIMEOUT)
        except (_Unusable, OSError) as e:
            warmed = _describe(e)
        if warmed is not None:
            self.close()
            why = f"the reward worker did not restart ({warmed})"
            for p in left:
                results[p] = [("timeout", why)] * n
            return
        keys = [id(funcs[p]) for p in left]
        todo = [(i, list(range(len(left)))) for i in range(n)]
        reply = "died"
        if self._try_send(pickle.dumps(("rescue", keys, style, todo, budget, late))):
            waves = -(-n // RESCUE_WIDTH)
            reply = self._receive(None if budget is None else waves * budget + _REPLY_MARGIN)
        if not isinstance(reply, dict):
            self.close()
            reply = {}
        for p in left:
            results[p] = [("timeout", "the reward worker did not answer")] * n
        for i, outcomes in reply.items():
            for at, outcome in outcomes:
                results[left[at]][i] = outcome

    def _batch_ok(self) -> bool:
        try:
            self._batch_bytes()
            return True
        except _Unusable as e:
            log.info("reward functions run in threads: %s", e)
            return False


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
