"""Pieces every task shares: the reference reasoning format and answer extraction."""

from __future__ import annotations

import re

# The d1 reference system prompt (METHOD.md §5): reasoning, then the answer, in tags.
SYSTEM_PROMPT = (
    "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"
)

# DOTALL so that multi-line reasoning and answers match (the reference regexes lack it).
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def answer_tag_span(text: str) -> str | None:
    """The text inside the last ``<answer>…</answer>``, stripped, or None when absent."""
    found = _ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


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
