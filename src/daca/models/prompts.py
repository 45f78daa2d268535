"""Task rows to prompt token ids, and completion ids back to text, per model family.

The tiny model reads the task's compact character prompt, left padded to its fixed width;
chat models read the task's chat prompt through the tokenizer's chat template.
"""

from __future__ import annotations

import torch
from torch import Tensor

from daca.models.loading import LoadedModel
from daca.tasks import Task


def prompt_texts(bundle: LoadedModel, task: Task, rows: list[dict]) -> list[str]:
    if bundle.family == "tiny":
        if task.compact_prompt is None:
            raise ValueError(f"the tiny model has no prompt format for task {task.name!r}")
        return [task.compact_prompt(r) for r in rows]
    tok = bundle.tokenizer
    texts = []
    for r in rows:
        message = [{"role": "user", "content": task.chat_prompt(r)}]
        if getattr(tok, "chat_template", None):
            texts.append(
                tok.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
            )
        else:
            texts.append(message[0]["content"])
    return texts


def encode_prompts(bundle: LoadedModel, texts: list[str]) -> tuple[Tensor, Tensor]:
    """Left-padded prompt ids [B, P] and attention mask [B, P]."""
    tok = bundle.tokenizer
    ids = [tok(t, add_special_tokens=bundle.family != "tiny")["input_ids"] for t in texts]
    width = max(len(i) for i in ids)
    if bundle.prompt_width is not None:
        too_long = [t for t, i in zip(texts, ids, strict=True) if len(i) > bundle.prompt_width]
        if too_long:
            raise ValueError(
                f"prompt {too_long[0]!r} has more than the model's {bundle.prompt_width} tokens"
            )
        width = bundle.prompt_width
    out = torch.full((len(ids), width), bundle.pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for b, seq in enumerate(ids):
        if seq:
            out[b, width - len(seq) :] = torch.tensor(seq)
            mask[b, width - len(seq) :] = 1
    return out, mask


def encode_targets(bundle: LoadedModel, texts: list[str], gen_length: int) -> Tensor:
    """Completion ids [B, L] for supervised targets: the text, then end-of-sequence to L."""
    tok = bundle.tokenizer
    out = torch.full((len(texts), gen_length), bundle.eos_ids[0], dtype=torch.long)
    for b, text in enumerate(texts):
        seq = tok(text, add_special_tokens=False)["input_ids"]
        if len(seq) > gen_length:
            raise ValueError(f"target {text!r} is longer than gen_length={gen_length}")
        out[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


def completion_mask(bundle: LoadedModel, completion_ids: Tensor) -> Tensor:
    """[B, L] bool: tokens up to and including the first end-of-sequence token."""
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for e in bundle.eos_ids:
        is_eos |= completion_ids == e
    before = is_eos.long().cumsum(1) - is_eos.long()  # eos tokens strictly before n
    return before == 0


def decode_completions(bundle: LoadedModel, completion_ids: Tensor) -> list[str]:
    """Text of each completion, cut at the first end-of-sequence token."""
    keep = completion_mask(bundle, completion_ids)
    texts = []
    for ids, k in zip(completion_ids.tolist(), keep.tolist(), strict=True):
        ids = [i for i, kk in zip(ids, k, strict=True) if kk and i not in bundle.eos_ids]
        texts.append(bundle.tokenizer.decode(ids, skip_special_tokens=True))
    return texts
