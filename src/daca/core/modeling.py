"""How the method core calls a model: ``model(input_ids, attention_mask=None)``.

The model returns either a tensor of logits [B, T, V] or an object with ``.logits``
(Hugging Face convention). Logits at position i predict the token at position i;
adapters for families that shift them (Dream) undo the shift before the core sees them.
"""

from __future__ import annotations

import torch
from torch import Tensor


def forward_logits(model, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Run one bidirectional forward and return logits [B, T, V]."""
    if attention_mask is None:
        out = model(input_ids)
    else:
        out = model(input_ids, attention_mask=attention_mask)
    logits = out if isinstance(out, Tensor) else out.logits
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"model returned logits of shape {tuple(logits.shape)} for input "
            f"{tuple(input_ids.shape)}; expected [B, T, V]"
        )
    return logits


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
