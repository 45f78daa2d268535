"""How the method core calls a model: ``model(input_ids, attention_mask=None)``.

The model returns either a tensor of logits [B, T, V] or an object with ``.logits``
(Hugging Face convention). Logits at position i predict the token at position i;
adapters for families that shift them (Dream) undo the shift before the core sees them.
Models on transformers' Llama/Qwen2 classes are also passed ``logits_to_keep`` when the core
reads only the last positions (a completion's); any other model is called as above. A
block-causal model (LLaDA 2.x, ``attention_block``) builds its mask from the padding mask
itself; given the clean completion, the likelihoods call it on prompt ++ noised ++ clean
completion with block diffusion's mask (``block_diffusion_mask``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def forward_logits(
    model,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    last: int | None = None,
    stop: int | None = None,
    context: Tensor | None = None,
) -> Tensor:
    """Run one bidirectional forward and return logits [B, T, V], or those of the positions
    T - ``last`` .. ``stop`` - 1 only (a completion's, or one block of it; ``stop`` defaults to
    T). On transformers' Llama and Qwen2 classes (LLaDA, Dream, the tiny models) the head then
    runs on those positions alone (``logits_to_keep``): with a 126k-token vocabulary it is most
    of a small model's cost, and the other rows are never read.

    ``context`` [B, last]: the clean completion whose noised version the input's last ``last``
    positions hold (the likelihoods pass it). A block-causal model (LLaDA 2.x) then scores each
    block against the clean blocks before it, as its rollout decoded it
    (``block_diffusion_mask``); every other model ignores it."""
    if context is not None and (block := attention_block_of(model)) is not None:
        return _block_diffusion_logits(model, input_ids, attention_mask, context, block, last, stop)
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    T = input_ids.shape[1]
    if last is not None and not 0 < last <= T:
        raise ValueError(f"last must be in 1..{T} (the input's length), got {last}")
    first = 0 if last is None else T - last
    stop = T if stop is None else stop
    if not first < stop <= T:
        raise ValueError(f"stop must be in {first + 1}..{T} (after T - last), got {stop}")
    base = causal_lm_backbone(model) if first > 0 or stop < T else None
    kept_from = 0  # the position of the first row the model returns
    if base is not None:  # Dream: the hidden state one earlier gives the first kept row
        kept_from = max(first - getattr(base, "logits_shift", 0), 0)
        kwargs["logits_to_keep"] = (  # an int keeps the last rows; a tensor, these positions
            T - kept_from if stop == T else torch.arange(kept_from, stop, device=input_ids.device)
        )
    out = model(input_ids, **kwargs)
    logits = out if isinstance(out, Tensor) else out.logits
    logits = logits[:, first - kept_from : stop - kept_from]
    expected = (input_ids.shape[0], stop - first)
    if logits.dim() != 3 or logits.shape[:2] != expected:
        raise ValueError(
            f"model returned logits of shape {tuple(logits.shape)} for input "
            f"{tuple(input_ids.shape)}; expected [B, {stop - first}, V] (last={last}, stop={stop})"
        )
    return logits


def _block_diffusion_logits(model, input_ids, attention_mask, context, block, last, stop):
    """``forward_logits`` of a block-causal model given the clean completion ``context``: one
    forward of [input, context] under ``block_diffusion_mask``; the input's completion rows."""
    B, N = input_ids.shape
    L = context.shape[1]
    if last != L or stop is not None or context.shape[0] != B:
        raise ValueError(
            f"context [B, L] goes with last=L (the completion's logits): got context "
            f"{tuple(context.shape)}, last={last}, stop={stop}, input {tuple(input_ids.shape)}"
        )
    positions = padded_positions(
        torch.ones_like(input_ids) if attention_mask is None else attention_mask
    )
    anchor = attention_anchor_of(model)
    mask = block_diffusion_mask(attention_mask, (B, N), L, block, input_ids.device, anchor)
    out = model(
        torch.cat([input_ids, context.to(input_ids)], 1),
        attention_mask=mask,
        position_ids=torch.cat([positions, positions[:, N - L :]], 1),
        logits_to_keep=torch.arange(N - L, N, device=input_ids.device),
    )
    return out if isinstance(out, Tensor) else out.logits


def padded_positions(attention_mask: Tensor) -> Tensor:
    """Position ids [B, T] counted from each left-padded row's first real token (padding 0):
    what the native models compute from their mask, so a padded row equals the row alone."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def causal_lm_backbone(model):
    """The transformers ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` /
    ``Glm4MoeForCausalLM`` under ``model`` (DDP's or DeepSpeed's ``.module`` and PEFT looked
    through), or None. Those classes take ``logits_to_keep`` and a KV cache; calls still go
    through ``model`` itself."""
    from transformers import (
        Glm4MoeForCausalLM,
        LlamaForCausalLM,
        Qwen2ForCausalLM,
        Qwen3ForCausalLM,
    )

    base = model
    while isinstance(getattr(base, "module", None), torch.nn.Module):
        base = base.module
    if hasattr(base, "get_base_model"):
        base = base.get_base_model()
    causal_lms = (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Glm4MoeForCausalLM)
    return base if isinstance(base, causal_lms) else None


def attention_block_of(model) -> int | None:
    """The block of a block-causal model's attention (LLaDA 2.x: ``attention_block``), or None
    for a bidirectional one."""
    base = causal_lm_backbone(model)
    return getattr(base, "attention_block", None) if base is not None else None


def attention_anchor_of(model) -> str:
    """Where a block-causal model's blocks are counted from (``ANCHORS``; "end" for any other)."""
    base = causal_lm_backbone(model)
    return getattr(base, "attention_anchor", "end") if base is not None else "end"


# How a row is cut into blocks: "end", counted back from its last token (dllm's BD3LM sampler,
# which left-pads prompts to whole blocks); "start", counted on from its first real token,
# padding after it included (LLaDA 2.x, whose own generate cuts prompt ++ completion from
# position 0: daca pads its prompts so the completion begins a block, ``start_aligned_pad``).
ANCHORS = ("end", "start")


def _blocks(
    attention_mask: Tensor | None, shape: tuple[int, int], block: int, device=None, anchor="end"
):
    """(block index [B, N] of each position, real [B, N] bool): a row cut into blocks of
    ``block`` from the ``anchor`` (``ANCHORS``; ``block_causal_mask``)."""
    B, N = shape
    if attention_mask is None:
        real = torch.ones(B, N, dtype=torch.bool, device=device)
    elif tuple(attention_mask.shape) != (B, N):
        raise ValueError(
            f"block-causal attention needs a [B, N] padding mask of the input's shape {(B, N)}, "
            f"got {tuple(attention_mask.shape)}"
        )
    else:
        real = attention_mask.bool()
    if anchor == "start":
        first = real.long().argmax(1, keepdim=True)  # each row's first real token
        index = (torch.arange(N, device=real.device) - first).clamp_min(0)
        return index // block, real
    if anchor != "end":
        raise ValueError(f"anchor must be one of {ANCHORS}, got {anchor!r}")
    index = real.long().cumsum(1) - 1  # each real token's place in its row
    offset = (-real.sum(1, keepdim=True)) % block  # so that the last token ends a block
    return (index + offset) // block, real


def start_aligned_pad(ids: list[list[int]], pad_id: int, block: int) -> tuple[Tensor, Tensor]:
    """Prompts for a block-causal model whose blocks count from its first token (LLaDA 2.x):
    each row's tokens begin a block (padding before them in whole blocks) and are followed by
    padding to the end of their last block, so the completion after them begins a block and
    the prompt is cut into blocks as the model's own ``generate`` cuts it. ids [B, W] long,
    attention mask [B, W] long (1 = real token), W a multiple of ``block``."""
    spans = [-(-len(seq) // block) * block for seq in ids]  # a row's tokens + its gap
    width = max(spans, default=0)
    out = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for b, (seq, span) in enumerate(zip(ids, spans, strict=True)):
        start = width - span
        out[b, start : start + len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        mask[b, start : start + len(seq)] = 1
    return out, mask


def check_completion_begins_block(attention_mask: Tensor | None, P: int, block: int, anchor):
    """ValueError unless each row's completion (after its P prompt positions) begins a block
    of ``anchor``'s partition: with "start", a prompt of a whole number of blocks from its
    first real token (``start_aligned_pad``); no mask: every position real."""
    if anchor != "start":
        return
    if attention_mask is None:
        first, bad = torch.zeros(1, dtype=torch.long), torch.tensor([P % block != 0])
    else:
        real = attention_mask[:, :P].bool()
        first = real.long().argmax(1)
        bad = real.any(1) & ((P - first) % block != 0)
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"row {row}'s prompt spans {P - int(first[row])} positions from its first token, "
            f"not a whole number of the model's blocks of {block}, so its completion would not "
            "begin a block: pad the prompts with daca.models.prompts.pad_prompts (or "
            "daca.core.modeling.start_aligned_pad)"
        )


def block_causal_mask(
    attention_mask: Tensor | None,
    shape: tuple[int, int],
    block: int,
    device=None,
    anchor: str = "end",
) -> Tensor:
    """[B, 1, N, N] bool of block-causal attention (LLaDA 2.x, block diffusion): query i may
    attend key j when j is a real token and j's block is not after i's. A row is split into
    blocks of ``block`` from ``anchor`` (``ANCHORS``): counted back from its last token, a
    completion of a multiple of ``block`` tokens begins a block whatever its prompt's length;
    counted on from its first token, when the prompt is padded to whole blocks
    (``start_aligned_pad``; docs/scale.md). A padding query attends to itself only, so that
    no row of the attention is empty."""
    blocks, real = _blocks(attention_mask, shape, block, device, anchor)
    allowed = (blocks[:, None, :] <= blocks[:, :, None]) & real[:, None, :]
    alone = torch.eye(shape[1], dtype=torch.bool, device=real.device) & ~real[:, :, None]
    return (allowed | alone)[:, None]


def block_diffusion_mask(
    attention_mask: Tensor | None,
    shape: tuple[int, int],
    length: int,
    block: int,
    device=None,
    anchor: str = "end",
) -> Tensor:
    """[B, 1, N + length, N + length] bool over an input of N positions followed by a clean
    copy of its last ``length`` (the completion): each block of the input's completion attends
    to the prompt, to its own block as the input has it and to the *clean* copies of the
    blocks before it; the clean copy attends block-causally to the prompt and to itself. So one
    forward scores every block as the rollout decoded it: given the prompt and the tokens it
    had committed before the block (block diffusion's training pattern)."""
    B, N = shape
    if length % block:
        raise ValueError(
            f"a completion of {length} tokens is not a whole number of blocks of {block}"
        )
    check_completion_begins_block(attention_mask, N - length, block, anchor)
    blocks, real = _blocks(attention_mask, shape, block, device, anchor)
    causal = block_causal_mask(attention_mask, shape, block, device, anchor)[:, 0]  # [B, N, N]
    completion = torch.arange(N, device=real.device) >= N - length
    clean = blocks[:, N - length :]  # the clean copy's blocks [B, length]
    same = blocks[:, :, None] == blocks[:, None, :]
    to_input = causal & (~completion[None, None, :] | (completion[None, :, None] & same))
    to_clean = completion[None, :, None] & (clean[:, None, :] < blocks[:, :, None])
    clean_to_input = (~completion & real)[:, None, :] & (blocks[:, None, :] <= clean[:, :, None])
    clean_to_clean = clean[:, None, :] <= clean[:, :, None]
    top = torch.cat([to_input, to_clean], -1)
    return torch.cat([top, torch.cat([clean_to_input, clean_to_clean], -1)], -2)[:, None]


def full_attention_mask(
    prompt_mask: Tensor | None, prompt_ids: Tensor, gen_length: int
) -> Tensor | None:
    """Attention mask over prompt ++ completion (completion always attended), or None."""
    if prompt_mask is None:
        return None
    ones = torch.ones(
        prompt_ids.shape[0], gen_length, dtype=prompt_mask.dtype, device=prompt_mask.device
    )
    return torch.cat([prompt_mask, ones], dim=1)
