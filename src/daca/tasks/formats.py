"""Format rewards of the reference reasoning format (METHOD.md §5), without the reference's
defects; plus what the GSM8K, MATH-500, MBPP, HumanEval and JSON tasks share (completion text,
fenced blocks, record loading).

The d1 rewards check ``<reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>``. Differences:

- every pattern uses DOTALL, so multi-line reasoning and answers match;
- strict format tolerates trailing whitespace after ``</answer>`` (a decoded diffusion
  completion often ends right at the tag, which d1's ``\\n$`` rejects);
- soft format tolerates leading whitespace;
- xml-count: the tail penalty counts only text after ``</answer>`` (d1 charged the whole
  completion when ``\\n</answer>\\n`` was missing, and paid +0.001 when nothing followed the tag),
  and each of the four parts stays in [0, 0.125], so the reward is in [0, 0.5].

Reward functions have TRL's signature ``f(prompts, completions, **columns) -> list[float]``.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Iterable
from typing import Any

from daca.tasks.common import answer_tag_span, completion_text

FORMAT_REWARD = 0.5
# The formats are checked with str.find and short anchored regexes: the equivalent single
# regexes (d1's, with lazy ``.*?`` groups) backtrack quadratically on a flood of tags.
_STRICT_HEAD, _STRICT_MIDDLE, _STRICT_TAIL = (
    "<reasoning>\n",
    "\n</reasoning>\n<answer>\n",
    "\n</answer>",
)
_SOFT_MIDDLE_RE = re.compile(r"</reasoning>\s*<answer>")
_FENCE_LANG_RE = re.compile(r"[A-Za-z0-9_+-]*")


def is_strict_format(text: str) -> bool:
    """Whether ``text`` is reasoning then answer, tags on their own lines, in linear time: a
    full match of ``<reasoning>\\n.*?\\n</reasoning>\\n<answer>\\n.*?\\n</answer>\\s*`` (DOTALL)."""
    body = text.rstrip()  # the trailing \s*, which cannot contain the closing tag
    if not body.endswith(_STRICT_TAIL) or not body.startswith(_STRICT_HEAD):
        return False
    body = body[: -len(_STRICT_TAIL)]
    return body.find(_STRICT_MIDDLE, len(_STRICT_HEAD)) >= 0


def is_soft_format(text: str) -> bool:
    """Whether ``text`` starts like ``\\s*<reasoning>.*?</reasoning>\\s*<answer>.*?</answer>``
    (DOTALL), in linear time: the first reasoning close followed by an answer open, then a
    later answer close."""
    start = len(text) - len(text.lstrip())
    if not text.startswith("<reasoning>", start):
        return False
    middle = _SOFT_MIDDLE_RE.search(text, start + len("<reasoning>"))
    return middle is not None and text.find("</answer>", middle.end()) >= 0


def completion_texts(completions) -> list[str]:
    return [completion_text(c) for c in completions]


def strict_format_reward(prompts, completions, **columns) -> list[float]:
    """0.5 when the completion is exactly reasoning then answer, tags on their own lines."""
    texts = completion_texts(completions)
    return [FORMAT_REWARD * is_strict_format(t) for t in texts]


def soft_format_reward(prompts, completions, **columns) -> list[float]:
    """0.5 when the completion starts with a reasoning block followed by an answer block."""
    texts = completion_texts(completions)
    return [FORMAT_REWARD * is_soft_format(t) for t in texts]


def count_xml(text: str) -> float:
    """d1's xml-count: 0.125 per well-formed tag line, minus 0.001 per character after the
    answer (on the two answer tags); each part clamped to [0, 0.125]."""
    tail = text.split("\n</answer>")[-1] if "\n</answer>" in text else ""
    extra = len(tail[1:] if tail.startswith("\n") else tail)
    part, penalised = 0.125, max(0.0, 0.125 - 0.001 * extra)
    return (
        part * (text.count("<reasoning>\n") == 1)
        + part * (text.count("\n</reasoning>\n") == 1)
        + penalised * (text.count("\n<answer>\n") == 1)
        + penalised * (text.count("\n</answer>") == 1)
    )


def xmlcount_reward(prompts, completions, **columns) -> list[float]:
    """``count_xml`` of each completion, in [0, 0.5]."""
    return [count_xml(t) for t in completion_texts(completions)]


def _fences(text: str):
    """(language, body) of each fenced block, as ``re.findall`` of
    ``r"```([A-Za-z0-9_+-]*)[^\\n]*\\n(.*?)```"`` (DOTALL) finds them, in linear time (that regex
    rescans to the end from every unclosed fence)."""
    pos = 0
    while (start := text.find("```", pos)) >= 0:
        newline = text.find("\n", start + 3)
        end = text.find("```", newline + 1) if newline >= 0 else -1
        if end < 0:
            return  # no later fence can close either
        yield _FENCE_LANG_RE.match(text, start + 3, newline).group(0), text[newline + 1 : end]
        pos = end + 3


def fenced_blocks(text: str, languages: tuple[str, ...] = ()) -> list[str]:
    """Bodies of the fenced ``` blocks in ``text``, in order; with ``languages``, only blocks
    tagged with one of them (case-insensitive; an untagged block counts as any language)."""
    wanted = {lang.lower() for lang in languages}
    return [
        body for lang, body in _fences(text) if not wanted or not lang or lang.lower() in wanted
    ]


PYTHON_TAGS = ("python", "py", "python3")


def extract_code(text: str) -> str:
    """The program in a completion: the last python (or untagged) fenced block inside the
    answer tags, else the last one anywhere, else the answer tags' text, else all the text."""
    span = answer_tag_span(text)
    for where in (span, text):
        blocks = fenced_blocks(where, PYTHON_TAGS) if where else []
        if blocks:
            return blocks[-1]
    return span if span is not None else text


def answer_block_reward(languages: tuple[str, ...], name: str):
    """A reward of 0.5 when the answer tags hold a fenced block in one of ``languages``
    (d1's code reward pays this for a python block inside the answer)."""

    def reward(prompts, completions, **columns) -> list[float]:
        spans = (answer_tag_span(t) for t in completion_texts(completions))
        return [FORMAT_REWARD * bool(s and fenced_blocks(s, languages)) for s in spans]

    reward.__name__ = reward.__qualname__ = name
    return reward


def read_records(path: str | os.PathLike, required: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The objects of a JSONL file (``.gz`` too), or of a file holding one JSON list.

    Blank lines are skipped; bad JSON, a non-object or a missing ``required`` key raises
    ValueError naming the file and line (or the list index).
    """
    required = tuple(required)
    opener = gzip.open if os.fspath(path).endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except (UnicodeDecodeError, gzip.BadGzipFile) as e:
        raise ValueError(
            f"{os.fspath(path)}: not a UTF-8 text file ({e}); expected JSONL or a JSON list"
        ) from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            where = f"{os.fspath(path)}, line {e.lineno}"
            raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
        numbered = [(f"item {i}", item) for i, item in enumerate(items)]
    else:
        numbered = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    numbered.append((f"line {lineno}", json.loads(line)))
                except json.JSONDecodeError as e:
                    where = f"{os.fspath(path)}, line {lineno}"
                    raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
    rows = []
    for where, item in numbered:
        if not isinstance(item, dict):
            raise ValueError(f"{os.fspath(path)}, {where}: expected a JSON object")
        missing = [k for k in required if k not in item]
        if missing:
            raise ValueError(f"{os.fspath(path)}, {where}: missing {', '.join(missing)}")
        rows.append(item)
    return rows


class DataUnavailable(RuntimeError):
    """A task has no local file and its data could not be fetched (no ``datasets``, offline,
    ...); ``reason`` says why, the message adds the Python fix (commands name their flag)."""

    def __init__(self, reason: str):
        super().__init__(f"{reason}; pass a local file with path=...")
        self.reason = reason


def hub_rows(name: str, config: str | None, split: str) -> list[dict[str, Any]]:
    """Rows of a Hugging Face dataset via ``datasets`` (imported here: an optional dependency)."""
    try:
        import datasets
    except ImportError:
        raise DataUnavailable(
            f"loading {name} from the Hugging Face hub needs `datasets` "
            "(pip install 'daca-grpo[tasks]')"
        ) from None
    try:
        return [dict(r) for r in datasets.load_dataset(name, config, split=split)]
    except Exception as e:  # noqa: BLE001 - offline, unknown split, ...: say what to do
        raise DataUnavailable(
            f"could not load {name} ({config}, split {split!r}) from the Hugging Face hub "
            f"({type(e).__name__}: {_first_line(e)})"
        ) from e


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""
