"""Pieces every task shares: the reference reasoning format and answer extraction."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The d1 reference system prompt (METHOD.md §5): reasoning, then the answer, in tags.
SYSTEM_PROMPT = (
    "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"
)

_OPEN, _CLOSE = "<answer>", "</answer>"
# The format's tags and separators, as a tiny model's tokenizer reads them (one token a tag).
FORMAT_VOCABULARY = ("<reasoning>", "</reasoning>", _OPEN, _CLOSE, "\n", " ")


def answer_tag_bounds(text: str) -> tuple[int, int] | None:
    """Where the text inside the last ``<answer>…</answer>`` starts and ends, or None.

    The pairs are those of ``re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)`` (each
    opening tag with the next closing tag, left to right), found in linear time: that regex
    rescans to the end from every unclosed ``<answer>``, quadratic on a flood of them.
    """
    last, pos = None, 0
    while (start := text.find(_OPEN, pos)) >= 0:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end < 0:
            break
        last, pos = (start + len(_OPEN), end), end + len(_CLOSE)
    return last


def answer_tag_span(text: str) -> str | None:
    """The text inside the last ``<answer>…</answer>``, stripped, or None when absent."""
    bounds = answer_tag_bounds(text)
    return None if bounds is None else text[bounds[0] : bounds[1]].strip()


def answer_span(text: str) -> str:
    """The answer part of a completion: inside the last answer tags if any, else all of it.

    The embedded tiny model writes only the answer (no tags), so the whole completion is
    its answer span; chat models are held to the tags by a separate format reward.
    """
    span = answer_tag_span(text)
    return text.strip() if span is None else span


def chat_user_message(question: str) -> str:
    """The user turn for chat models: system prompt, then the question (as d1 does)."""
    return f"{SYSTEM_PROMPT}\n\n{question}"


def completion_text(completion: Any) -> str:
    """The text of one completion: a string, a message dict, or a TRL conversation (a list of
    ``{"role", "content"}`` messages, whose last message is the completion)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, list | tuple):
        return completion_text(completion[-1]) if completion else ""
    raise ValueError(f"a completion must be a string or a list of messages, got {completion!r}")


def check_lengths(completions: list, **columns: list) -> None:
    """Every column holds one entry per completion."""
    for name, column in columns.items():
        if len(column) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(column)} {name!r} entries")


GENERATED_SIZES = {"train": 2000, "test": 200}


def generated_or_file(
    split: str,
    path: str | None,
    limit: int | None,
    seed: int,
    gen_kwargs: dict[str, Any],
    *,
    read_file: Callable[[str], list[dict]],
    generate: Callable[..., list[dict]],
) -> list[dict]:
    """Rows of the file at ``path`` (``split`` then only names it), else ``limit`` (default
    2000 train / 200 test) generated rows; ``gen_kwargs`` go to the generator."""
    if split not in GENERATED_SIZES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if path is not None:
        if gen_kwargs:
            raise ValueError(f"generator options {sorted(gen_kwargs)} do not apply to a file")
        rows = read_file(path)
        return rows if limit is None else rows[:limit]
    n = GENERATED_SIZES[split] if limit is None else limit
    return generate(n, split=split, seed=seed, **gen_kwargs)
