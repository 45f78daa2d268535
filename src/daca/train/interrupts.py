"""Ctrl-C and SIGTERM as a request to stop at the next safe point, not a traceback.

``StopSignals`` replaces the SIGINT and SIGTERM handlers while a long job runs: the first
signal only records itself (the job checks ``requested`` between steps, saves and raises
``Interrupted``); a second one ends the process at once (what is on disk was written
atomically). Outside the main thread Python cannot install handlers: it then does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A job stopped by SIGINT or SIGTERM after saving; ``exit_code`` is the shell's 128 + signal
    number (130 for Ctrl-C, 143 for SIGTERM) and the message says how to go on."""

    def __init__(self, signum: int, message: str):
        super().__init__(signum, message)  # both in args: it crosses process pools pickled
        self.signum, self.message = signum, message

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return self.message


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignals:
    """``with StopSignals(what) as stop:`` ... ``if stop.requested: save and stop``.

    ``what`` completes the line printed at the first signal ("interrupted (SIGINT): {what}"),
    unless some open block has ``announce=False``.
    ``on_first(signum)`` and ``on_second(signum)`` run in the handler after the line (e.g. to pass
    the signal on to worker processes); after ``on_second`` the process exits with 128 + signum.
    Nested blocks (a grid of runs, each run inside it) share one request: a signal that falls
    between two runs stops the next one before its first step. The innermost ``what`` is said.
    """

    _active: list[StopSignals] = []  # the open blocks, outermost first
    _signum: int | None = None  # the first signal, shared by the open blocks
    _previous: dict = {}

    def __init__(self, what: str, *, on_first=None, on_second=None, announce: bool = True):
        self.what, self.announce = what, announce
        self.on_first, self.on_second = on_first, on_second

    @property
    def signum(self) -> int | None:
        return StopSignals._signum

    @property
    def requested(self) -> bool:
        return StopSignals._signum is not None

    def __enter__(self) -> StopSignals:
        cls = StopSignals
        if not cls._active and threading.current_thread() is threading.main_thread():
            cls._signum = None
            cls._previous = {s: signal.signal(s, cls._handle) for s in SIGNALS}
        cls._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        cls = StopSignals
        cls._active.remove(self)
        if not cls._active:
            for s, handler in cls._previous.items():
                signal.signal(s, handler)
            cls._previous = {}

    @staticmethod
    def _handle(signum: int, frame) -> None:
        cls, active = StopSignals, list(StopSignals._active)
        if cls._signum is None:
            cls._signum = signum
            if active and all(block.announce for block in active):
                _say(
                    f"interrupted ({signal_name(signum)}): {active[-1].what} "
                    f"(Ctrl-C again to quit at once)"
                )
            for block in active:
                if block.on_first is not None:
                    block.on_first(signum)
            return
        _say(f"interrupted again ({signal_name(signum)}): quitting now")
        for block in active:
            if block.on_second is not None:
                block.on_second(signum)
        os._exit(128 + signum)


def _say(line: str) -> None:
    # os.write: a handler may run while print() holds the stream's lock.
    with contextlib.suppress(OSError, ValueError):
        os.write(sys.stderr.fileno(), (line + "\n").encode())
