"""Group advantages and the four base losses, with the DACA hooks (METHOD.md §4, §6).

Batch layout: B = num_prompts * G rows with the groups contiguous (rows g*G .. g*G+G-1 share a
prompt). Per-token tensors are [B, L]; ``completion_mask`` [B, L] (bool or float, None = all
ones) marks the tokens that count. ``token_multipliers`` [B, L] are DPS's (1 + lam * norm_delta)
(``daca.core.dps``); None, or multipliers of exactly 1, give the base loss bit for bit.

Each loss returns ``(loss, metrics)``: a scalar tensor to backpropagate and a dict of Python
floats to log. Advantages, old/reference log-probs and multipliers are treated as constants.
"""

from __future__ import annotations

import torch
from torch import Tensor

from daca.core.options import ADVANTAGE_BASELINES, GDPO_REDUCTIONS, REWARD_SCALES, check_mode


def _token_mask(completion_mask: Tensor | None, like: Tensor) -> Tensor:
    if completion_mask is None:
        return torch.ones_like(like)
    if completion_mask.shape != like.shape:
        raise ValueError(
            f"completion_mask {tuple(completion_mask.shape)} must match {tuple(like.shape)}"
        )
    return completion_mask.to(like.dtype)


def _check_tokens(name: str, x: Tensor | None, like: Tensor) -> None:
    if x is not None and x.shape != like.shape:
        raise ValueError(f"{name} {tuple(x.shape)} must match the log-probs {tuple(like.shape)}")


def _check_advantages(advantages: Tensor, like: Tensor) -> None:
    if advantages.shape != like.shape[:1]:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} must be [B] = [{like.shape[0]}] (one per row)"
        )


def _token_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Sum over the masked tokens of the batch / their count (0 when there are none)."""
    return (x * mask).sum() / mask.sum().clamp_min(1)


def _token_advantages(advantages: Tensor, token_multipliers: Tensor | None) -> Tensor:
    """A_n = A * m_n [B, L] (or A [B, 1] broadcast): DPS makes the coefficient per token."""
    adv = advantages.detach()[:, None]
    return adv if token_multipliers is None else adv * token_multipliers.detach()


def _k3(log_ratio: Tensor) -> Tensor:
    """k3 estimator of KL(pi_theta || pi_ref) with log_ratio = log pi_ref - log pi_theta."""
    return torch.exp(log_ratio) - log_ratio - 1


def _clipped_surrogate(ratio: Tensor, adv: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """PPO token loss -min(rho A, clip(rho, 1-eps, 1+eps) A) and where the clip is active.

    Clip activity follows TRL: rho < 1-eps with A < 0, or rho > 1+eps with A > 0 (the cases in
    which the clipped term is the one selected and carries no gradient).
    """
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * adv
    active = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + epsilon) & (adv > 0))
    return -torch.min(unclipped, clipped), active


def group_advantages(
    rewards: Tensor,
    num_generations: int,
    scale: str = "none",
    eps: float = 1e-4,
    baseline: str = "mean",
) -> Tensor:
    """A_g = r_g - b_g [B] (METHOD.md §4, "Common"; §6).

    ``baseline="mean"``: b_g = mean of the group (d1, wd1, GDPO). ``"leave_one_out"``: b_g = mean
    of the group's OTHER rewards, (Σ_j r_j - r_g) / (G - 1) = r_g - G/(G-1)·(r_g - mean), as
    DiffuCoder's coupled-GRPO computes it (``leave_one_out = True`` in its trainer); needs G ≥ 2.
    ``scale="group"`` also divides by the group's std + eps, with the UNBIASED std (divides by
    G-1), as TRL's ``scale_rewards="group"`` does; a group of one has std 0. The reference codes
    do not divide, hence the default ``"none"``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got {tuple(rewards.shape)}")
    if num_generations < 1 or rewards.shape[0] % num_generations != 0:
        raise ValueError(
            f"batch of {rewards.shape[0]} rewards is not a whole number of groups of "
            f"{num_generations}"
        )
    check_mode("scale", scale, REWARD_SCALES)
    check_mode("baseline", baseline, ADVANTAGE_BASELINES)
    if baseline == "leave_one_out" and num_generations < 2:
        raise ValueError("the leave-one-out baseline needs num_generations >= 2")
    grouped = rewards.view(-1, num_generations)
    centred = grouped - grouped.mean(1, keepdim=True)
    dof = max(num_generations - 1, 1)
    adv = centred
    if baseline == "leave_one_out":
        others = (grouped.sum(1, keepdim=True) - grouped) / dof
        adv = grouped - others
    if scale == "group":
        std = (centred.square().sum(1, keepdim=True) / dof).sqrt()
        adv = adv / (std + eps)
    return adv.reshape(-1)


def diffu_grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    completion_mask: Tensor | None = None,
    *,
    epsilon: float = 0.5,
    beta: float = 0.0,
    ref_logp: Tensor | None = None,
    token_multipliers: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Diffu-GRPO (d1) loss (METHOD.md §4), a scalar averaged over the batch's completion tokens.

    Per token: rho_n = exp(logp_n - old_logp_n), A_n = A * m_n (m = ``token_multipliers``, or 1),
    loss_n = -min(rho_n A_n, clip(rho_n, 1-eps, 1+eps) A_n) + beta * KL_n with the k3 estimator
    KL_n = exp(ref_n - logp_n) - (ref_n - logp_n) - 1 (``ref_logp`` required when beta > 0).
    All log-probs [B, L] (for +SML pass ``sml_enriched`` ones), advantages [B].

    metrics: clip_fraction (tokens where the clip is active, TRL's definition: rho outside the band
    on the side where the advantage sign makes it bind), ratio_mean, ratio_max, advantage_mean
    (token mean of A_n), and kl (when ``ref_logp`` is given), multiplier_mean (with multipliers).
    """
    _check_advantages(advantages, logp)
    for name, x in (
        ("old_logp", old_logp),
        ("ref_logp", ref_logp),
        ("token_multipliers", token_multipliers),
    ):
        _check_tokens(name, x, logp)
    if beta != 0 and ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp for the KL term")
    mask = _token_mask(completion_mask, logp)
    adv = _token_advantages(advantages, token_multipliers)
    ratio = torch.exp(logp - old_logp.detach())
    per_token, clip_active = _clipped_surrogate(ratio, adv, epsilon)
    kl = None if ref_logp is None else _k3(ref_logp.detach() - logp)
    if beta != 0:
        per_token = per_token + beta * kl
    loss = _token_mean(per_token, mask)

    with torch.no_grad():
        real = mask > 0
        metrics = {
            "clip_fraction": _token_mean(clip_active.expand_as(mask).to(mask.dtype), mask).item(),
            "ratio_mean": _token_mean(ratio, mask).item(),
            "ratio_max": ratio[real].max().item() if real.any() else 1.0,
            "advantage_mean": _token_mean(adv.expand_as(mask), mask).item(),
        }
        if kl is not None:
            metrics["kl"] = _token_mean(kl, mask).item()
        if token_multipliers is not None:
            metrics["multiplier_mean"] = _token_mean(token_multipliers, mask).item()
    return loss, metrics


def wd1_loss(
    logp: Tensor,
    advantages: Tensor,
    completion_mask: Tensor | None = None,
    *,
    num_generations: int,
    psi: float = 1.0,
    token_multipliers: Tensor | None = None,
    sml_logp: Tensor | None = None,
    eta: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """wd1 loss (METHOD.md §4): ratio-free weighted likelihood, plus DPS and the SML term.

    Within each group w+_g = softmax_g(psi A_g), w-_g = softmax_g(-psi A_g) (constants), and
    L_group = -sum_g sum_n (w+_g - w-_g) m_{g,n} l_{g,n} over the completion tokens (m = DPS
    multipliers, or 1; l = ``logp`` [B, L], the mean-field log-probs). With SML (eta != 0):
    L_group -= (eta / G) * sum_g log p^SML(o_g), log p^SML(o_g) = sum_n ``sml_logp``_{g,n}.

    Reduction: the MEAN over prompts of the per-group sums. This is what wd1's reference code
    optimises: it takes the softmax over a per-device batch of exactly one group
    (per_device_train_batch_size = num_generations = 6), sums over the group and over tokens
    (no length normalisation), and DDP / gradient accumulation average over groups.

    metrics: logp_mean (per-token), weight_pos_max (largest w+), and multiplier_mean, sml_logp_mean
    (per sequence) when those inputs are given.
    """
    _check_advantages(advantages, logp)
    _check_tokens("token_multipliers", token_multipliers, logp)
    _check_tokens("sml_logp", sml_logp, logp)
    if num_generations < 1 or logp.shape[0] % num_generations != 0:
        raise ValueError(
            f"batch of {logp.shape[0]} rows is not a whole number of groups of {num_generations}"
        )
    if eta != 0 and sml_logp is None:
        raise ValueError("eta != 0 needs sml_logp for the SML term")
    mask = _token_mask(completion_mask, logp)
    grouped = advantages.detach().reshape(-1, num_generations)
    w_pos = torch.softmax(psi * grouped, dim=1)
    w_neg = torch.softmax(-psi * grouped, dim=1)
    coef = _token_advantages((w_pos - w_neg).reshape(-1), token_multipliers)  # [B, 1] or [B, L]
    weighted = (coef * logp * mask).sum(-1)  # [B]
    loss = -weighted.view(-1, num_generations).sum(1).mean()
    sml_seq = None if sml_logp is None else (sml_logp * mask).sum(-1)  # log p^SML(o_g), [B]
    if eta != 0:
        sml_group = sml_seq.view(-1, num_generations).sum(1)
        loss = loss - (eta / num_generations) * sml_group.mean()

    with torch.no_grad():
        metrics = {
            "logp_mean": _token_mean(logp, mask).item(),
            "weight_pos_max": w_pos.max().item(),
        }
        if token_multipliers is not None:
            metrics["multiplier_mean"] = _token_mean(token_multipliers, mask).item()
        if sml_seq is not None:
            metrics["sml_logp_mean"] = sml_seq.mean().item()
    return loss, metrics


def gdpo_loss(
    token_terms: Tensor,
    old_token_terms: Tensor,
    advantages: Tensor,
    completion_mask: Tensor | None = None,
    *,
    epsilon: float = 0.5,
    beta: float = 0.0,
    ref_token_terms: Tensor | None = None,
    token_multipliers: Tensor | None = None,
    reduction: str = "token",
) -> tuple[Tensor, dict[str, float]]:
    """GDPO loss with a sequence-level ratio (METHOD.md §4).

    ``reduction="sequence"`` is the reference code's (``gdpo_trainer.compute_loss``): the ELBO
    sums ``token_terms`` over all L positions, padding included, rho = exp((ELBO - ELBO_old) / L)
    with L the padded completion length, the KL is beta * k3(ELBO_ref - ELBO) on the raw ELBO
    difference, and the loss is the mean over sequences of -min(rho A, clip(rho) A) + beta·KL
    (with multipliers, each sequence's surrogate is the mean of -min(rho A_n, clip(rho) A_n)
    over its completion tokens). ``reduction="token"`` (daca's earlier choice):

    ELBO = sum over the masked tokens of ``token_terms`` [B, L] (``likelihood.elbo_token_terms``),
    N = the sequence's number of completion tokens, rho = exp((ELBO - ELBO_old) / N) [B].
    rho is broadcast to the tokens: loss_n = -min(rho A_n, clip(rho, 1-eps, 1+eps) A_n) with
    A_n = A * m_n, averaged over the batch's completion tokens, so without multipliers each
    sequence's -min(rho A, clip(rho) A) counts once per token. Optional sequence-level KL,
    beta * k3((ELBO_ref - ELBO) / N), added to every token of the sequence (default beta = 0).

    metrics: as ``diffu_grpo_loss``; ratio_mean, ratio_max and kl are over sequences,
    clip_fraction and advantage_mean over completion tokens.
    """
    _check_advantages(advantages, token_terms)
    for name, x in (
        ("old_token_terms", old_token_terms),
        ("ref_token_terms", ref_token_terms),
        ("token_multipliers", token_multipliers),
    ):
        _check_tokens(name, x, token_terms)
    if beta != 0 and ref_token_terms is None:
        raise ValueError("beta != 0 needs ref_token_terms for the KL term")
    check_mode("reduction", reduction, GDPO_REDUCTIONS)
    if reduction == "sequence":
        return _gdpo_sequence_loss(
            token_terms,
            old_token_terms,
            advantages,
            _token_mask(completion_mask, token_terms),
            epsilon=epsilon,
            beta=beta,
            ref_token_terms=ref_token_terms,
            token_multipliers=token_multipliers,
        )
    mask = _token_mask(completion_mask, token_terms)
    num_tokens = mask.sum(-1).clamp_min(1)  # N
    elbo = (token_terms * mask).sum(-1)
    elbo_old = (old_token_terms.detach() * mask).sum(-1)
    ratio = torch.exp((elbo - elbo_old) / num_tokens)  # [B]
    adv = _token_advantages(advantages, token_multipliers)
    per_token, clip_active = _clipped_surrogate(ratio[:, None], adv, epsilon)
    kl = None
    if ref_token_terms is not None:
        elbo_ref = (ref_token_terms.detach() * mask).sum(-1)
        kl = _k3((elbo_ref - elbo) / num_tokens)  # [B]
    if beta != 0:
        per_token = per_token + beta * kl[:, None]
    loss = _token_mean(per_token.expand_as(mask), mask)

    with torch.no_grad():
        real = mask.sum(-1) > 0
        metrics = {
            "clip_fraction": _token_mean(clip_active.expand_as(mask).to(mask.dtype), mask).item(),
            "ratio_mean": ratio[real].mean().item() if real.any() else 1.0,
            "ratio_max": ratio[real].max().item() if real.any() else 1.0,
            "advantage_mean": _token_mean(adv.expand_as(mask), mask).item(),
        }
        if kl is not None:
            metrics["kl"] = kl[real].mean().item() if real.any() else 0.0
        if token_multipliers is not None:
            metrics["multiplier_mean"] = _token_mean(token_multipliers, mask).item()
    return loss, metrics


def _gdpo_sequence_loss(
    token_terms: Tensor,
    old_token_terms: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float,
    beta: float,
    ref_token_terms: Tensor | None,
    token_multipliers: Tensor | None,
) -> tuple[Tensor, dict[str, float]]:
    """``gdpo_loss(reduction="sequence")``: the reference code's reduction (METHOD.md §4)."""
    length = token_terms.shape[-1]  # L, padding included
    elbo = token_terms.sum(-1)
    ratio = torch.exp((elbo - old_token_terms.detach().sum(-1)) / length)  # [B]
    adv = _token_advantages(advantages, token_multipliers)
    per_token, clip_active = _clipped_surrogate(ratio[:, None], adv, epsilon)
    if token_multipliers is None:
        per_seq = per_token[:, 0]  # one surrogate per sequence, as the reference
    else:
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp_min(1)
    kl = None
    if ref_token_terms is not None:
        kl = _k3(ref_token_terms.detach().sum(-1) - elbo)  # [B], the raw ELBO difference
    if beta != 0:
        per_seq = per_seq + beta * kl
    loss = per_seq.mean()

    with torch.no_grad():
        metrics = {
            "clip_fraction": _token_mean(clip_active.expand_as(mask).to(mask.dtype), mask).item(),
            "ratio_mean": ratio.mean().item(),
            "ratio_max": ratio.max().item(),
            "advantage_mean": _token_mean(adv.expand_as(mask), mask).item(),
        }
        if kl is not None:
            metrics["kl"] = kl.mean().item()
        if token_multipliers is not None:
            metrics["multiplier_mean"] = _token_mean(token_multipliers, mask).item()
    return loss, metrics


def coupled_grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    completion_mask: Tensor | None = None,
    *,
    epsilon: float = 0.5,
    beta: float = 0.01,
    ref_logp: Tensor | None = None,
    token_multipliers: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """coupled-GRPO (DiffuCoder, arXiv 2506.20639 §4; METHOD.md §6) loss, averaged over the
    batch's completion tokens.

    The GRPO objective with per-token ratios rho_n = exp(l^C_n - l^C_old,n) of the coupled
    estimate (``likelihood.coupled_logp``, the same mask pairs for current, old and reference):
    loss_n = -min(rho_n A_n, clip(rho_n, 1-eps, 1+eps) A_n) + beta * KL_n, k3 KL against the
    reference, A_n = A * m_n (m = DPS ``token_multipliers``, or 1), summed over the completion
    tokens of the batch and divided by their count: DiffuCoder's ``compute_loss``
    (``src/open_r1/coupled_grpo.py``) term for term. Its published setting
    (``recipes/config_coupled_code.yaml``): eps = 0.5, beta = 0.01 (hence ``ref_logp`` is
    required by default), mu = 2 inner iterations, G = 10, leave-one-out advantages
    (``group_advantages(baseline="leave_one_out")``) without std scaling.

    +SML: pass ``sml_enriched(l^C, l^SML)`` for the three policies, as for Diffu-GRPO.
    metrics: as ``diffu_grpo_loss``.
    """
    return diffu_grpo_loss(
        logp,
        old_logp,
        advantages,
        completion_mask,
        epsilon=epsilon,
        beta=beta,
        ref_logp=ref_logp,
        token_multipliers=token_multipliers,
    )


def sml_enriched(base_logp: Tensor, sml_logp: Tensor) -> Tensor:
    """Enriched per-token log-prob 0.5 * (l^base + l^SML) [B, L] (METHOD.md §4, +SML ratio methods).

    Use it for the current, old and reference policies alike (same strata seed for all three).
    """
    if base_logp.shape != sml_logp.shape:
        raise ValueError(
            f"base_logp {tuple(base_logp.shape)} and sml_logp {tuple(sml_logp.shape)} differ"
        )
    return 0.5 * (base_logp + sml_logp)
