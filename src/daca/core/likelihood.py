"""Per-token log-likelihoods of a completion under a masked diffusion LM (METHOD.md §3, §4).

Four estimators of log p_θ(o | q), each split per completion token so that the objectives can
form per-token ratios:

- ``mean_field_logp``: d1's one-step estimate ℓ^MF (METHOD.md §4): whole completion masked.
- ``stratified_logp``: the Stratified Masking Likelihood ℓ^SML (METHOD.md §3): K views, each
  masking one stratum of the completion, so every token sees the other (K-1)/K of it.
- ``elbo_token_terms``: GDPO's semi-deterministic Monte Carlo ELBO (METHOD.md §4).
- ``coupled_logp``: coupled-GRPO's estimate ℓ^C (DiffuCoder, METHOD.md §6): the full mask plus
  complementary mask pairs, so every token is scored exactly once per pair.

Each draws its masks from ``generator`` or takes them given (``prompt_hide=``, ``strata=``,
``masks=``): both front-ends (``daca train`` and TRL) call the same functions.

All four build "views" of ``prompt ++ completion`` in which some completion positions hold the
mask token, run the model on them and read ``log_softmax(logits)[o_n]`` at the masked positions
only. They are differentiable (used for training). Every random draw comes from the
``generator`` passed in, on the device of the inputs: the same seed gives the same masks, which is
how current, old and reference policies are compared like with like.

Shapes: ``prompt_ids`` [B, P] (left padded, ``attention_mask`` [B, P] with 1 = real token, or
None), ``completion_ids`` [B, L]; the completion is always attended.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from daca.core.modeling import attention_block_of, forward_logits, full_attention_mask
from daca.core.options import STRATA, check_mode, check_num_strata


def _check_inputs(prompt_ids: Tensor, completion_ids: Tensor, attention_mask: Tensor | None):
    if prompt_ids.dim() != 2 or completion_ids.dim() != 2:
        raise ValueError(
            f"prompt_ids and completion_ids must be [B, P] and [B, L], got "
            f"{tuple(prompt_ids.shape)} and {tuple(completion_ids.shape)}"
        )
    if prompt_ids.shape[0] != completion_ids.shape[0]:
        raise ValueError(
            f"batch sizes differ: prompt_ids has {prompt_ids.shape[0]} rows, "
            f"completion_ids {completion_ids.shape[0]}"
        )
    if completion_ids.shape[1] < 1:
        raise ValueError("completion_ids must have at least one position")
    if attention_mask is not None and attention_mask.shape != prompt_ids.shape:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} must match prompt_ids "
            f"{tuple(prompt_ids.shape)}"
        )


def _views_logp(
    model,
    prompt_ids: Tensor,
    completion_ids: Tensor,
    masks: Tensor,
    *,
    mask_id: int,
    attention_mask: Tensor | None,
    views_per_forward: int | None = None,
) -> Tensor:
    """log p(o_n | view) at the masked positions of each view, 0 elsewhere: [V, B, L].

    ``masks`` [V, B, L] (bool): view v is ``prompt ++ completion`` with the positions where
    ``masks[v]`` is True replaced by ``mask_id``. Views run ``views_per_forward`` at a time
    (all in one batch when None); the result does not depend on it.
    """
    n_views, B, L = masks.shape
    P = prompt_ids.shape[1]
    chunk = n_views if views_per_forward is None else views_per_forward
    if chunk < 1:
        raise ValueError(f"views_per_forward must be >= 1 or None, got {views_per_forward}")
    attn = full_attention_mask(attention_mask, prompt_ids, L)
    block_causal = attention_block_of(model) is not None
    out = []
    for start in range(0, n_views, chunk):
        m = masks[start : start + chunk]  # [c, B, L]
        c = m.shape[0]
        comp = torch.where(m, mask_id, completion_ids)
        ids = torch.cat([prompt_ids.expand(c, B, P), comp], dim=2).reshape(c * B, P + L)
        am = None if attn is None else attn.repeat(c, 1)
        # The clean completion as context: a block-causal model (LLaDA 2.x) scores each block
        # given the blocks before it, as the rollout decoded it (daca.core.modeling).
        context = completion_ids.repeat(c, 1) if block_causal else None
        logits = forward_logits(model, ids, am, last=L, context=context).unflatten(0, (c, B))
        # Normalise only the rows we read (1/K of them for SML), in at least float32.
        rows = logits[m]
        rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
        targets = completion_ids.expand(c, B, L)[m].unsqueeze(-1)
        lp = rows.log_softmax(-1).gather(-1, targets).squeeze(-1)
        out.append(lp.new_zeros(c, B, L).masked_scatter(m, lp))
    return torch.cat(out)


def mean_field_logp(
    model,
    prompt_ids: Tensor,
    completion_ids: Tensor,
    *,
    mask_id: int,
    p_mask_prompt: float = 0.0,
    generator: torch.Generator | None = None,
    attention_mask: Tensor | None = None,
    prompt_hide: Tensor | None = None,
) -> Tensor:
    """d1's one-step mean-field estimate ℓ^MF_n = log p(o_n | q̃, all completion masked) (METHOD §4).

    Each real prompt token is replaced by ``mask_id`` independently with probability
    ``p_mask_prompt`` (padding, ``attention_mask == 0``, is never masked); the whole completion is
    masked; one forward. Returns [B, L].

    ``prompt_hide`` (bool [B, P], True = replaced by ``mask_id``) gives the prompt masks instead
    of drawing them (then ``p_mask_prompt`` must be 0); padding is spared there too.

    Generator: when ``p_mask_prompt > 0``, exactly one draw ``torch.rand(B, P)`` (float32); a
    prompt token is masked where its draw is < ``p_mask_prompt``. Nothing is drawn otherwise.
    """
    _check_inputs(prompt_ids, completion_ids, attention_mask)
    if not 0.0 <= p_mask_prompt <= 1.0:
        raise ValueError(f"p_mask_prompt must lie in [0, 1], got {p_mask_prompt}")
    if prompt_hide is not None:
        if p_mask_prompt > 0:
            raise ValueError("give either prompt_hide or p_mask_prompt > 0, not both")
        if prompt_hide.shape != prompt_ids.shape or prompt_hide.dtype != torch.bool:
            raise ValueError(
                f"prompt_hide must be bool {tuple(prompt_ids.shape)}, got {prompt_hide.dtype} "
                f"{tuple(prompt_hide.shape)}"
            )
        hide = prompt_hide
    elif p_mask_prompt > 0:
        draw = torch.rand(prompt_ids.shape, generator=generator, device=prompt_ids.device)
        hide = draw < p_mask_prompt
    else:
        hide = None
    if hide is not None:
        if attention_mask is not None:
            hide = hide & attention_mask.bool()
        prompt_ids = prompt_ids.masked_fill(hide, mask_id)
    B, L = completion_ids.shape
    masks = torch.ones(1, B, L, dtype=torch.bool, device=completion_ids.device)
    return _views_logp(
        model, prompt_ids, completion_ids, masks, mask_id=mask_id, attention_mask=attention_mask
    )[0]


def strata_assignment(
    batch_size: int,
    length: int,
    num_strata: int,
    strata: str = "random",
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Stratum index k(n) of every completion position: long [B, L], values in 0..K-1 (METHOD §3).

    Strata are disjoint and of equal size ±1. ``random``: per row, a random permutation of the
    positions cut into K consecutive parts (position at rank r goes to stratum ⌊r·K/L⌋);
    ``interleaved``: n mod K; ``contiguous``: ⌊n·K/L⌋ (K consecutive chunks).

    Generator: ``random`` draws exactly one ``torch.rand(B, L, dtype=float64)`` (the permutation
    is its argsort), whatever K; the other two draw nothing.
    """
    check_mode("strata", strata, STRATA)
    check_num_strata(num_strata, length)
    pos = torch.arange(length, device=device)
    if strata == "interleaved":
        return (pos % num_strata).expand(batch_size, length).clone()
    chunks = (pos * num_strata // length).expand(batch_size, length)
    if strata == "contiguous":
        return chunks.clone()
    draw = torch.rand(batch_size, length, dtype=torch.float64, generator=generator, device=device)
    order = draw.argsort(dim=1)  # order[b, r] = position of rank r
    return torch.empty_like(chunks).scatter_(1, order, chunks)


def _given_strata(strata: Tensor, shape: torch.Size, num_strata: int) -> Tensor:
    if strata.shape != shape or strata.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"strata must be an integer assignment {tuple(shape)}, got {strata.dtype} "
            f"{tuple(strata.shape)}"
        )
    if strata.numel() and (strata.min() < 0 or strata.max() >= num_strata):
        raise ValueError(f"strata values must lie in 0..{num_strata - 1} (num_strata)")
    return strata


def stratified_logp(
    model,
    prompt_ids: Tensor,
    completion_ids: Tensor,
    *,
    mask_id: int,
    num_strata: int = 4,
    strata: str | Tensor = "random",
    generator: torch.Generator | None = None,
    attention_mask: Tensor | None = None,
    views_per_forward: int | None = None,
) -> Tensor:
    """Stratified Masking Likelihood ℓ^SML_n = log p(o_n | o_{\\S_k(n)}, q) (METHOD §3): [B, L].

    The completion positions are split into ``num_strata`` = K strata (``strata_assignment``);
    view k keeps the prompt and every completion token outside S_k and masks exactly S_k.
    ``ℓ.sum(-1)`` is log p^SML(o | q). The K views are stacked into one batch of K·B rows, or run
    ``views_per_forward`` views at a time to bound memory (same result). K = 1 is the mean-field
    estimate with ``p_mask_prompt=0`` (same code path, bit-identical).

    ``strata``: a scheme name (``STRATA``), or a given assignment, long [B, L] with values in
    0..K-1 (e.g. from ``strata_assignment``); a given assignment draws nothing.

    Generator: exactly what ``strata_assignment`` draws (one ``torch.rand(B, L, float64)`` for
    ``random``, nothing otherwise).
    """
    _check_inputs(prompt_ids, completion_ids, attention_mask)
    B, L = completion_ids.shape
    if isinstance(strata, Tensor):
        check_num_strata(num_strata)
        k_of = _given_strata(strata, completion_ids.shape, num_strata)
    else:
        k_of = strata_assignment(
            B, L, num_strata, strata, generator=generator, device=completion_ids.device
        )
    ks = torch.arange(num_strata, device=completion_ids.device)
    masks = k_of.unsqueeze(0) == ks[:, None, None]  # [K, B, L], each position in one view
    views = _views_logp(
        model,
        prompt_ids,
        completion_ids,
        masks,
        mask_id=mask_id,
        attention_mask=attention_mask,
        views_per_forward=views_per_forward,
    )
    return views.sum(0)


def annealed_num_strata(num_strata: int, anneal_steps: int, step: int) -> int:
    """Annealed SML's K at training step ``step`` (0-based; METHOD.md §3, "Annealed SML"):
    ``anneal_steps`` = T split into K equal phases of K, K-1, ..., 1 strata, so each token's
    visible context falls from (K-1)/K toward the mean field's none; 1 from step T on.
    K_t = max(1, K - floor(K·t / T)); T = 0 keeps K at every step."""
    if num_strata < 1 or anneal_steps < 0 or step < 0:
        raise ValueError(
            f"need num_strata >= 1, anneal_steps >= 0 and step >= 0, got {num_strata}, "
            f"{anneal_steps}, {step}"
        )
    if anneal_steps == 0:
        return num_strata
    return max(1, num_strata - (num_strata * step) // anneal_steps)


def quadrature_nodes(quadrature: str = "gauss-3") -> tuple[Tensor, Tensor]:
    """Gauss–Legendre nodes t ∈ (0, 1) and weights (summing to 1), float64 [Q] each (METHOD §4).

    ``"gauss-N"``: ``numpy.polynomial.legendre.leggauss(N)`` mapped from [-1, 1] to [0, 1]
    (t = (x + 1)/2, w = w_x/2); gauss-3 gives t ≈ 0.113, 0.5, 0.887 with weights 5/18, 8/18, 5/18.
    """
    name, _, n = quadrature.partition("-")
    if name != "gauss" or not n.isdigit() or int(n) < 1:
        raise ValueError(f"unknown quadrature {quadrature!r}; expected 'gauss-N' with N >= 1")
    x, w = np.polynomial.legendre.leggauss(int(n))
    return torch.from_numpy((x + 1) / 2), torch.from_numpy(w / 2)


def elbo_masks(
    batch_size: int,
    length: int,
    nodes: Tensor,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    completion_mask: Tensor | None = None,
    at_least_one: bool = True,
) -> Tensor:
    """Masks of the ELBO's noised inputs x_t: bool [Q, B, L] (METHOD §4, GDPO).

    At node t_q row b masks exactly m_qb = max(1, ⌊t_q·N_b⌋) of its N_b real completion positions
    (``completion_mask`` [B, L], True = real token; None = all L), chosen uniformly at random
    among them; at least one, so that no node contributes nothing on short completions, and
    none in a row without real tokens. Padding after EOS is never masked: the ELBO is a bound
    on the N real tokens, and the GDPO loss divides it by N. ``at_least_one=False`` with
    ``completion_mask=None`` is the reference code's ⌊t_q·L⌋ of all L positions, padding
    included (none at all when t_q·L < 1).

    Generator: exactly one draw ``torch.rand(Q, B, L, dtype=float64)``, whatever the mask; the
    masked positions of (q, b) are the m_qb real positions with the smallest draws.
    """
    if completion_mask is None:
        real = torch.ones(batch_size, length, dtype=torch.bool, device=device)
    elif completion_mask.shape != (batch_size, length):
        raise ValueError(
            f"completion_mask {tuple(completion_mask.shape)} must be [B, L] = "
            f"[{batch_size}, {length}]"
        )
    else:
        real = completion_mask.to(device=device, dtype=torch.bool)
    num_real = real.sum(-1)  # N_b
    counts = torch.floor(nodes.double().to(real.device)[:, None] * num_real).long()  # [Q, B]
    counts = torch.minimum(counts.clamp_min(1 if at_least_one else 0), num_real)
    draw = torch.rand(
        len(nodes), batch_size, length, dtype=torch.float64, generator=generator, device=device
    )
    order = draw.masked_fill(~real, 2.0).argsort(dim=-1)  # real positions first (draws < 1)
    ranks_masked = torch.arange(length, device=device) < counts[:, :, None]
    return torch.empty_like(order, dtype=torch.bool).scatter_(-1, order, ranks_masked)


def elbo_token_terms_from_masks(
    model,
    prompt_ids: Tensor,
    completion_ids: Tensor,
    masks: Tensor,
    nodes: Tensor,
    weights: Tensor,
    *,
    mask_id: int,
    attention_mask: Tensor | None = None,
) -> Tensor:
    """ELBO token terms for given masks: Σ_q (w_q / t_q) · 1[n masked at q] · log p(o_n | x_{t_q}).

    ``masks`` bool [Q, B, L] (True = masked in x_{t_q}); ``nodes``, ``weights`` [Q]. All Q views
    run in one batched forward. Returns [B, L]; its sum over L is the ELBO (METHOD §4).
    """
    _check_inputs(prompt_ids, completion_ids, attention_mask)
    if masks.dim() != 3 or masks.shape[1:] != completion_ids.shape or masks.dtype != torch.bool:
        raise ValueError(
            f"masks must be bool [Q, B, L] with [B, L] = {tuple(completion_ids.shape)}, got "
            f"{masks.dtype} {tuple(masks.shape)}"
        )
    if nodes.shape != (masks.shape[0],) or weights.shape != nodes.shape:
        raise ValueError("nodes and weights must be [Q] with Q = masks.shape[0]")
    views = _views_logp(
        model, prompt_ids, completion_ids, masks, mask_id=mask_id, attention_mask=attention_mask
    )
    coef = (weights.double() / nodes.double()).to(views.device, views.dtype)
    return (coef[:, None, None] * views).sum(0)


def elbo_token_terms(
    model,
    prompt_ids: Tensor,
    completion_ids: Tensor,
    *,
    mask_id: int,
    quadrature: str = "gauss-3",
    generator: torch.Generator | None = None,
    attention_mask: Tensor | None = None,
    completion_mask: Tensor | None = None,
    masks: Tensor | None = None,
    at_least_one: bool = True,
) -> Tensor:
    """GDPO's semi-deterministic Monte Carlo ELBO, split per completion token: [B, L] (METHOD §4).

    ELBO = Σ_q w_q Σ_{n masked at t_q} log p(o_n | x_{t_q}) / t_q with Gauss–Legendre nodes
    (``quadrature_nodes``) and exactly max(1, ⌊t_q·N⌋) random completion positions masked at node
    t_q among the N real ones (``elbo_masks``; ``completion_mask`` [B, L] marks them, None = all
    L; prompt never masked). The sum over L is the ELBO; each token's entry collects its terms
    over the nodes where it is masked. One batched forward of Q·B rows.

    ``masks`` (bool [Q, B, L], e.g. from ``elbo_masks``) gives the masks instead of drawing them;
    ``at_least_one``: as ``elbo_masks``.

    Generator: exactly what ``elbo_masks`` draws (one ``torch.rand(Q, B, L, float64)``).
    """
    _check_inputs(prompt_ids, completion_ids, attention_mask)
    nodes, weights = quadrature_nodes(quadrature)
    B, L = completion_ids.shape
    if masks is None:
        masks = elbo_masks(
            B,
            L,
            nodes,
            generator=generator,
            device=completion_ids.device,
            completion_mask=completion_mask,
            at_least_one=at_least_one,
        )
    return elbo_token_terms_from_masks(
        model,
        prompt_ids,
        completion_ids,
        masks,
        nodes,
        weights,
        mask_id=mask_id,
        attention_mask=attention_mask,
    )


COUPLED_T_RANGE = (0.2, 0.8)


def coupled_masks(
    batch_size: int,
    length: int,
    *,
    num_pairs: int = 1,
    t_range: tuple[float, float] = COUPLED_T_RANGE,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """coupled-GRPO's complementary mask pairs (DiffuCoder, METHOD §6): masks bool [λ, B, L] and
    mask ratios t float64 [λ].

    Pair i has one mask ratio t_i ~ Uniform(t_range) for the whole batch (DiffuCoder's
    ``forward_process``: ``random.uniform(0.2, 0.8)`` once per forward); its first view masks
    the completion positions whose uniform draw is < t_i (each with probability t_i), its second
    view masks exactly the others, ``~masks[i]``: M_t ∨ M_t̂ = 1, M_t ∧ M_t̂ = 0 (App. A.3, Eq. 12),
    so every position is masked in exactly one view of each pair.

    Generator: exactly one ``torch.rand(λ, float64)`` (the ratios), then one
    ``torch.rand(λ, B, L, float64)`` (the masks).
    """
    lo, hi = t_range
    if not 0.0 < lo <= hi < 1.0:
        raise ValueError(f"t_range must satisfy 0 < lo <= hi < 1, got {t_range}")
    if num_pairs < 1:
        raise ValueError(f"num_pairs must be >= 1, got {num_pairs}")
    u = torch.rand(num_pairs, dtype=torch.float64, generator=generator, device=device)
    ratios = lo + (hi - lo) * u
    draw = torch.rand(
        num_pairs, batch_size, length, dtype=torch.float64, generator=generator, device=device
    )
    return draw < ratios[:, None, None], ratios


def coupled_logp(
    model,
    prompt_ids: Tensor,
    completion_ids: Tensor,
    *,
    mask_id: int,
    num_pairs: int = 1,
    t_range: tuple[float, float] = COUPLED_T_RANGE,
    generator: torch.Generator | None = None,
    attention_mask: Tensor | None = None,
    masks: Tensor | None = None,
    ratios: Tensor | None = None,
    views_per_forward: int | None = None,
) -> Tensor:
    """coupled-GRPO's per-token estimate ℓ^C_n (DiffuCoder §4, App. A.3 Eq. 13; METHOD §6): [B, L].

    With the full mask (x_T: whole completion masked, ℓ^MF_n) and λ complementary pairs
    (M_{t_i}, ¬M_{t_i}) from ``coupled_masks``:

        ℓ^C_n = 1/(λ+1) · ( ℓ^MF_n + Σ_i [ 1[n ∈ M_{t_i}] · log p(o_n | x_{M_{t_i}}) / t_i
                                        + 1[n ∉ M_{t_i}] · log p(o_n | x_{¬M_{t_i}}) / (1 − t_i) ] )

    each partial-mask term weighted by 1/(mask ratio), the ELBO's weight (for λ = 1 this is
    DiffuCoder's ``selective_log_softmax``: (p0 + where(mask, p1/t, p2/(1-t))) / 2). Every token
    is scored exactly once per pair; the prompt is never masked (the reference's
    ``p_mask_prompt: 0.0``). 1 + 2λ views, stacked in one batch or run ``views_per_forward`` at a
    time (same result).

    ``masks`` bool [λ, B, L] and ``ratios`` [λ] give the pairs instead of drawing them (both or
    neither). Generator: exactly what ``coupled_masks`` draws.
    """
    _check_inputs(prompt_ids, completion_ids, attention_mask)
    B, L = completion_ids.shape
    device = completion_ids.device
    if (masks is None) != (ratios is None):
        raise ValueError("give both masks and ratios, or neither")
    if masks is None:
        masks, ratios = coupled_masks(
            B, L, num_pairs=num_pairs, t_range=t_range, generator=generator, device=device
        )
    elif masks.dim() != 3 or masks.shape[1:] != completion_ids.shape or masks.dtype != torch.bool:
        raise ValueError(
            f"masks must be bool [λ, B, L] with [B, L] = {tuple(completion_ids.shape)}, got "
            f"{masks.dtype} {tuple(masks.shape)}"
        )
    elif ratios.shape != (masks.shape[0],) or not ((ratios > 0) & (ratios < 1)).all():
        raise ValueError("ratios must be [λ] with λ = masks.shape[0], each in (0, 1)")
    full = torch.ones(1, B, L, dtype=torch.bool, device=device)
    pairs = torch.stack([masks, ~masks], dim=1).flatten(0, 1)  # [2λ, B, L]: M_1, ¬M_1, M_2, ...
    views = _views_logp(
        model,
        prompt_ids,
        completion_ids,
        torch.cat([full, pairs]),
        mask_id=mask_id,
        attention_mask=attention_mask,
        views_per_forward=views_per_forward,
    )
    t = ratios.to(device=device, dtype=torch.float64)
    coef = torch.stack([1 / t, 1 / (1 - t)], dim=1).flatten().to(views.dtype)  # [2λ]
    # Outside its view's mask an entry is 0, so each pair adds exactly one term per token.
    pair_terms = (coef[:, None, None] * views[1:]).sum(0)
    return (views[0] + pair_terms) / (masks.shape[0] + 1)


__all__ = [
    "COUPLED_T_RANGE",
    "STRATA",
    "annealed_num_strata",
    "coupled_logp",
    "coupled_masks",
    "elbo_masks",
    "elbo_token_terms",
    "elbo_token_terms_from_masks",
    "mean_field_logp",
    "quadrature_nodes",
    "strata_assignment",
    "stratified_logp",
]
