"""Forward adapters for masked LMs whose logits change under left padding.

The method core calls ``model(input_ids, attention_mask=...)`` with left-padded prompts
(``daca.core.modeling``). A masked LM that ignores the attention mask, or whose positions are
absolute, gives a padded row other logits than the row alone; ``adapt`` detects that on load
(``daca.models.loading``) and installs ``bucketed_forward`` on the model itself, with a warning.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor


class _AdaptedForward:
    """``model.forward`` replaced by ``adapter(previous_forward, *args, **kwargs)``.

    A plain attribute holding the previous (bound) forward: ``copy.deepcopy`` of the model
    rebinds it to the copy, and accelerate's mixed-precision wrapper wraps it like any callable.
    """

    def __init__(self, adapter, inner):
        self.adapter, self.inner = adapter, inner
        self.name = adapter.__name__

    def __call__(self, *args, **kwargs):
        return self.adapter(self.inner, *args, **kwargs)


def install_forward_adapter(model: torch.nn.Module, adapter) -> bool:
    """Route ``model(...)`` through ``adapter(inner_forward, ...)``; False if already there."""
    if adapter.__name__ in forward_adapters(model):
        return False
    model.forward = _AdaptedForward(adapter, model.forward)
    return True


def forward_adapters(model: torch.nn.Module) -> list[str]:
    """Names of the adapters installed on ``model``, outermost first."""
    names, fwd = [], model.forward
    while isinstance(fwd, _AdaptedForward):
        names.append(fwd.name)
        fwd = fwd.inner
    return names


def _logits(out) -> Tensor:
    return out if isinstance(out, Tensor) else out.logits


def _output(logits: Tensor):
    from transformers.modeling_outputs import MaskedLMOutput

    return MaskedLMOutput(logits=logits)


def bucketed_forward(inner, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs):
    """Left padding removed before the model sees it: input_ids, mask [B, T] -> logits [B, T, V].

    Rows with the same number of leading pad positions (``attention_mask == 0``) run as one
    batch on their real tokens only, so each row's logits are those of the row run alone;
    padded positions get logits 0. Only left padding can be removed (the core pads prompts on
    the left and never pads completions); any other mask is a ValueError.
    """
    if attention_mask is None or bool(attention_mask.bool().all()):
        return inner(input_ids, attention_mask=attention_mask, **kwargs)
    real = attention_mask.bool()
    B, T = real.shape
    pads = T - real.sum(1)
    if not torch.equal(real, torch.arange(T, device=real.device)[None] >= pads[:, None]):
        raise ValueError("bucketed_forward removes left padding only; got another attention mask")
    # ``logits_to_keep``: an int k > 0 asks for the last k positions, a tensor for ascending
    # positions; a bucket drops its p pad positions, so it is asked for its real ones, shifted.
    keep = kwargs.get("logits_to_keep")
    if isinstance(keep, Tensor):
        rows_out = len(keep)
    else:
        rows_out = min(keep, T) if isinstance(keep, int) and keep > 0 else T
    pieces, order = [], []
    for p in pads.unique().tolist():
        rows = (pads == p).nonzero().squeeze(1)
        shifted = {"logits_to_keep": keep[keep >= p] - p} if isinstance(keep, Tensor) else {}
        logits = _logits(inner(input_ids[rows, p:], **(kwargs | shifted)))
        pieces.append(F.pad(logits, (0, 0, rows_out - logits.shape[1], 0)))
        order.append(rows)
    logits = torch.cat(pieces)[torch.argsort(torch.cat(order))]
    return _output(logits)


@torch.no_grad()
def left_padding_changes_logits(
    model, token_ids: list[int], pad_id: int, *, num_pad: int = 8, tol: float = 0.05
) -> bool:
    """Whether adding ``num_pad`` left pad tokens (attention mask 0) changes the real tokens'
    logits by more than ``tol``, relative to the spread of the logits:
    ``‖a − b‖ / ‖a − mean_v(a)‖`` over the real positions but the first, whose row means nothing
    to a shifted family like Dream (bf16 rounding stays near 1e-2; a model that attends to the
    padding moves its logits by a large fraction of their spread)."""
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    padded = torch.cat([torch.full((1, num_pad), pad_id, device=device), ids], dim=1)
    mask = torch.ones_like(padded)
    mask[:, :num_pad] = 0
    was_training = model.training
    model.eval()
    try:
        a = _logits(model(ids))[:, 1:].float()
        b = _logits(model(padded, attention_mask=mask))[:, num_pad + 1 :].float()
    finally:
        model.train(was_training)
    spread = (a - a.mean(-1, keepdim=True)).norm()
    return bool((a - b).norm() > tol * spread)


def _probe_ids(bundle) -> list[int]:
    """A short prompt-like input: digits and symbols every tokenizer has, then masks."""
    ids = []
    if bundle.tokenizer is not None:
        ids = bundle.tokenizer("12 + 34 = 46, 5 * 6 = 30", add_special_tokens=False)["input_ids"]
    ids = [i for i in ids if i not in (bundle.pad_id, bundle.mask_id)][:16] or list(range(1, 9))
    return ids + [bundle.mask_id] * 4


def adapt(bundle, *, check_padding: bool = True):
    """If left padding changes the logits of ``bundle`` (a ``daca.models.loading.LoadedModel``,
    not imported: loading imports this module), install the length-bucketed forward (with a
    warning). Idempotent; returns ``bundle``."""
    if check_padding and left_padding_changes_logits(
        bundle.model, _probe_ids(bundle), bundle.pad_id
    ):
        install_forward_adapter(bundle.model, bucketed_forward)
        bundle.ignores_attention_mask = True
        warnings.warn(
            f"{bundle.path or bundle.family}: left padding changes this model's logits even "
            "with the attention mask (the model ignores attention_mask, or its positions are "
            "absolute); prompts of different lengths now run in separate batches, one forward "
            "per distinct prompt length, which is slower. Update the model's code if you can.",
            UserWarning,
            stacklevel=2,
        )
    return bundle
