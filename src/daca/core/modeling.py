"""How the method core calls a model: ``model(input_ids, attention_mask=None)``.

The model returns either a tensor of logits [B, T, V] or an object with ``.logits``
(Hugging Face convention). Logits at position i predict the token at position i;
adapters for families that shift them (Dream) undo the shift before the core sees them.
Models on transformers' Llama/Qwen2 classes are also passed ``logits_to_keep`` when the core
reads only the last positions (a completion's); any other model is called as above.
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
) -> Tensor:
    """Run one bidirectional forward and return logits [B, T, V], or those of the positions
    T - ``last`` .. ``stop`` - 1 only (a completion's, or one block of it; ``stop`` defaults to
    T). On transformers' Llama and Qwen2 classes (LLaDA, Dream, the tiny models) the head then
    runs on those positions alone (``logits_to_keep``): with a 126k-token vocabulary it is most
    of a small model's cost, and the other rows are never read."""
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


def causal_lm_backbone(model):
    """The transformers ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``
    under ``model`` (DDP's or DeepSpeed's ``.module`` and PEFT looked through), or None. Those
    classes take ``logits_to_keep`` and a KV cache; calls still go through ``model`` itself."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    base = model
    while isinstance(getattr(base, "module", None), torch.nn.Module):
        base = base.module
    if hasattr(base, "get_base_model"):
        base = base.get_base_model()
    causal_lms = (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)
    return base if isinstance(base, causal_lms) else None


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
