"""Math answers: the last ``\\boxed{}``, the last number, and equivalence by math-verify.

``math_equal(gold, pred)`` asks math-verify whether two LaTeX answers are the same
mathematical object (``\\frac12``, ``0.5``, ``\\dfrac{1}{2}`` and ``1/2`` agree).

math-verify bounds its own time with ``signal.alarm``, which works only in the main thread. So in
the main thread the check runs here with math-verify's timeouts; in any other thread it is sent
to a persistent worker process (this file, loaded on its own, so the worker does not import torch)
which runs math-verify in *its* main thread with the same timeouts, and which is killed and
restarted when it does not answer within ``timeout`` + 2 s (e.g. stuck in C code). Worker calls
from several threads are serialised.

This module imports nothing from ``daca`` so that the worker can load it by path.
"""

from __future__ import annotations

import atexit
import json
import math
import re
import select
import subprocess
import sys
import threading
from decimal import Decimal, InvalidOperation

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
# A number: optional sign (not a minus between two operands: "5-3"), thousands separators,
# decimals. Currency signs, percent signs and unit words around it are simply not matched.
_NUMBER_RE = re.compile(r"(?:(?<![\w)\]}.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<!\d)\.\d+")
_LATEX_NOISE_RE = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\:|\\ |\s|\$")
_BRACE_RE = re.compile(r"[{}]")
_TOKEN_RE = re.compile(r"[^\s$]+")


# Size caps, so that a flood costs its reader little: a box's content is looked for within
# MAX_BOXED_CHARS of its opening brace (MATH-500's longest gold answer has < 200), and
# math-verify parses only answers of at most MAX_ANSWER_CHARS (a 10 MB one took seconds); the
# last MAX_BOX_COMMANDS box commands are looked at.
MAX_BOXED_CHARS = 10_000
MAX_ANSWER_CHARS = 2_000
MAX_BOX_COMMANDS = 1_000  # box commands read from the end (a flood of bare ones: 1.4M)


def _closing_brace(text: str, start: int) -> int | None:
    """Index of the ``}`` that closes the ``{`` at ``start``, or None when it is not closed
    within MAX_BOXED_CHARS."""
    depth = 0
    for brace in _BRACE_RE.finditer(text, start, start + MAX_BOXED_CHARS):
        depth += 1 if brace.group(0) == "{" else -1
        if depth == 0:
            return brace.start()
    return None


def _last_box_commands(text: str):
    """Matches of ``\\boxed`` / ``\\fbox`` from the last one back, at most MAX_BOX_COMMANDS,
    found by reverse search (a list of every match of a 10 MB flood of boxes took 2 s). The two
    words cannot overlap, so these are the matches of ``_BOXED_RE.finditer``, reversed."""
    found = {word: text.rfind(word) for word in ("\\boxed", "\\fbox")}
    for _ in range(MAX_BOX_COMMANDS):
        word, at = max(found.items(), key=lambda item: item[1])
        if at < 0:
            return
        yield _BOXED_RE.match(text, at)
        found[word] = text.rfind(word, 0, at)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces balanced.

    ``\\boxed 5`` (no braces) gives ``5``; when the last box is not closed (within
    MAX_BOXED_CHARS), None. Linear time: only the last braced box is balanced, and a bare token is
    read only after a space.
    """
    for match in _last_box_commands(text):
        start = match.end()
        if start < len(text) and text[start] == "{":
            end = _closing_brace(text, start)
            return None if end is None else text[start + 1 : end].strip()
        if match.group(0).endswith(" "):
            token = _TOKEN_RE.match(text, start)
            if token:
                return token.group(0)
    return None


def parse_number(text: str) -> Decimal | None:
    """The number ``text`` spells (commas dropped), or None."""
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def last_number(text: str) -> Decimal | None:
    """The last number in ``text``: commas, currency and units ignored ("$1,200." -> 1200)."""
    found = _NUMBER_RE.findall(text)
    return parse_number(found[-1]) if found else None


def numbers_equal(gold: str, pred: str) -> bool:
    """Whether the last numbers of ``gold`` and ``pred`` exist and are equal (18 == 18.00)."""
    g, p = last_number(gold), last_number(pred)
    return g is not None and p is not None and g == p


def _normalize_latex(s: str) -> str:
    s = _LATEX_NOISE_RE.sub("", s)
    return s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").rstrip(".")


def _verify_here(gold: str, pred: str, seconds: int) -> bool:
    """math-verify in the current (main) thread with its alarm-based timeouts."""
    from math_verify import parse, verify

    if not gold.strip() or not pred.strip():
        return False
    if "**" in pred:  # Python's power, not LaTeX: math-verify reads "9**9**9**9" as 9
        return False
    if _normalize_latex(gold) == _normalize_latex(pred):
        return True
    try:
        g = parse(f"${gold}$", parsing_timeout=seconds)
        p = parse(f"${pred}$", parsing_timeout=seconds)
        return bool(g and p and verify(g, p, timeout_seconds=seconds))
    except Exception:  # noqa: BLE001 - a parse/verify failure (or timeout) is "not equal"
        return False


def warm_up() -> None:
    """Import math-verify and build its parsers (~0.4 s, more on a loaded machine), e.g. in a
    reward worker before it is timed."""
    _verify_here("\\frac{1}{2}", "0.5", 5)


class _Worker:
    """A child Python that answers ``[gold, pred, seconds]`` JSON lines with true/false."""

    _CODE = (
        "import importlib.util, json, sys\n"
        "spec = importlib.util.spec_from_file_location('daca_mathcheck', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n"
        "import math_verify\n"
        "print('ready', flush=True)\n"
        "for line in sys.stdin:\n"
        "    print(json.dumps(m._verify_here(*json.loads(line))), flush=True)\n"
    )

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _readline(self, timeout: float) -> str | None:
        ready = select.select([self._proc.stdout], [], [], timeout)[0]
        return self._proc.stdout.readline() if ready else None

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc.stdin.close()
            self._proc.stdout.close()
            self._proc = None

    def close(self) -> None:
        """Let the worker finish (end of its input), killing it if it does not."""
        with self._lock:
            if self._proc is not None:
                self._proc.stdin.close()
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
                self._proc.stdout.close()
                self._proc = None

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", self._CODE, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        if self._readline(120.0) != "ready\n":
            self._stop()
            raise RuntimeError("the math-verify worker process did not start")

    def check(self, gold: str, pred: str, seconds: int) -> bool:
        with self._lock:
            for _ in range(2):  # one retry when the worker had died
                if self._proc is not None and self._proc.poll() is not None:
                    self._stop()  # release its pipes, start a new one
                if self._proc is None:
                    self._start()
                try:
                    self._proc.stdin.write(json.dumps([gold, pred, seconds]) + "\n")
                    self._proc.stdin.flush()
                except OSError:  # it died since the poll
                    self._stop()
                    continue
                answer = self._readline(seconds + 2.0)
                if answer is None:  # stuck beyond math-verify's own timeout: not equal
                    self._stop()
                    return False
                if answer:
                    return json.loads(answer) is True
                self._stop()  # end of file: it died during the check
            return False


_worker = _Worker()
atexit.register(_worker.close)


def math_equal(gold: str, pred: str | None, *, timeout: float = 5.0) -> bool:
    """Whether LaTeX answers ``gold`` and ``pred`` are mathematically equivalent (math-verify).

    False when ``pred`` is None or empty, longer than MAX_ANSWER_CHARS, unparsable, or the check
    exceeds ``timeout`` seconds.
    Safe from any thread (see the module docstring).
    """
    if pred is None or len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    seconds = max(1, math.ceil(timeout))  # signal.alarm counts whole seconds
    if threading.current_thread() is threading.main_thread():
        return _verify_here(gold, pred, seconds)
    return _worker.check(gold, pred, seconds)
