"""Ground truth per token: which written units of a completion are right.

A task that reasons before it answers grades two kinds of unit (``Task.trace_steps`` and
``Task.answer_cells``): each step of the reasoning (right or wrong against the solver or the
arithmetic) and each graded cell of the answer. ``graded_spans`` lists both as character spans;
``token_labels`` gives every token the label of the unit its middle character lies in: +1 right,
-1 wrong, 0 none (tags, separators, padding). The oracle-credit control (METHOD.md §2, "Oracle
credit") and ``daca credit`` read these labels; no reward does.

A completion's text here is its tokens joined with the special ones left out
(``completion_of``), so that a character offset maps back to a token.
"""

from __future__ import annotations

from typing import Any

# Markers a tokenizer puts for a leading space (byte-level BPE, SentencePiece).
_SPACE_MARKS = ("Ġ", "▁")

Span = tuple[int, int, bool]  # (start, end, right), a character span of the completion


def _token_text(tok: str) -> str:
    for mark in _SPACE_MARKS:
        if tok.startswith(mark):
            return " " + tok[len(mark) :]
    return tok


def token_spans(tokens: list[str], special: set[str]) -> list[tuple[int, int] | None]:
    """Each token's character span in ``completion_of(tokens)`` (None for a special token)."""
    spans, at = [], 0
    for tok in tokens:
        if tok in special:
            spans.append(None)
            continue
        length = len(_token_text(tok))
        spans.append((at, at + length))
        at += length
    return spans


def completion_of(tokens: list[str], special: set[str]) -> str:
    """The completion's text: its tokens joined, special ones left out (a tokenizer's space
    marks read as spaces)."""
    return "".join(_token_text(t) for t in tokens if t not in special)


def has_graded_units(task) -> bool:
    """Whether ``task`` grades its completions unit by unit (a trace and answer cells)."""
    return task.trace_steps is not None and task.answer_cells is not None


def graded_spans(task, completion: str, row: dict[str, Any]) -> tuple[list[Span], list[Span]]:
    """(trace steps, answer cells) of ``completion`` as ``(start, end, right)`` spans."""
    if not has_graded_units(task):
        raise ValueError(f"task {task.name!r} does not grade its trace steps and answer cells")
    return task.trace_steps(completion, row), task.answer_cells(completion, row)


def token_labels(tokens: list[str], special: set[str], spans: list[Span]) -> list[int]:
    """Per token: +1 if its middle character lies in a right span, -1 in a wrong one, else 0
    (a special token: 0). Spans do not overlap."""
    labels = []
    for span in token_spans(tokens, special):
        label = 0
        if span is not None:
            mid = (span[0] + span[1] - 1) / 2
            for start, end, right in spans:
                if start <= mid < end:
                    label = 1 if right else -1
                    break
        labels.append(label)
    return labels


def record_special_tokens(record: dict) -> set[str]:
    """The tokens left out of a recorded rollout's text (``daca credit``'s records name their
    pad token; the end-of-sequence tokens of the supported tokenizers)."""
    return {record.get("pad_token", "[PAD]"), "[EOS]", "[PAD]", "<|endoftext|>"}


def special_tokens(tokenizer) -> set[str]:
    """The tokens left out of a completion's text: the tokenizer's special tokens."""
    return set(tokenizer.all_special_tokens) | {tokenizer.pad_token, tokenizer.eos_token} - {None}
