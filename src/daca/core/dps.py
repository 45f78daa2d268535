"""Denoising Progress Scores (METHOD.md §2): per-token advantage multipliers from the trace.

The sampler's trace (``daca.core.sampler.Rollout``) holds, for recorded steps r_j
(j = 0..m, R = m+1):

- ``recorded_steps`` [R] long: the r_j, increasing (r_j = j*s for the regular stride);
- ``progress_logp`` [B, R, L] float: l[j, n] = log p(x*_n | x_{r_j}), meaningless where the mask
  is False;
- ``progress_mask`` [B, R, L] bool: n in M_{r_j} (still masked at r_j, recorded under the scope);
- ``birth_step`` [B, L] long: the step that committed each position;
- for ``last_step="measured"``: ``last_logp`` / ``last_mask`` [B, L] (the state x_{T-1}).

Three pure functions turn it into multipliers (1 + lam * norm_delta_{J(n)}):
``progress_deltas`` -> ``normalize`` -> ``token_multipliers``; ``rollout_multipliers`` chains them
for one rollout, ``step_multipliers`` for the rollouts of an optimizer step over all processes
(what both training front-ends call).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from daca.core.options import LAST_STEP_MODES, NORM_AXES, check_mode


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over the last dim where ``mask``; 0 where the set is empty (no NaN)."""
    total = torch.where(mask, values, torch.zeros_like(values)).sum(-1)
    return total / mask.sum(-1).clamp_min(1).to(values.dtype)


def progress_deltas(
    progress_logp: Tensor,
    progress_mask: Tensor,
    last_step: str = "extrapolate",
    *,
    last_logp: Tensor | None = None,
    last_mask: Tensor | None = None,
    recorded_steps: Tensor | None = None,
    num_steps: int | Tensor | None = None,
) -> Tensor:
    """Progress of every recorded interval, delta [B, R] float32 (METHOD.md §2, "Progress").

    For j < m: delta_j = S(j+1, j+1) - S(j, j+1), computed as the mean over the positions recorded
    at both j and j+1 of (l[j+1, n] - l[j, n]). Under scope "all" that set is M_{r_{j+1}} (M only
    shrinks), which is the paper's definition; under scope "block" it is the set on which both
    snapshots have evidence (the sampler records, at r_j, the block of r_{j+1} too, so the set
    is not empty when the interval crosses blocks). An empty set gives delta_j = 0 (no
    evidence), never NaN.

    The last interval j = m has no later recorded state; ``last_step`` chooses delta_m:
    ``extrapolate`` delta_{m-1} (0 when R = 1); ``neutral`` 0; ``raw`` S(m, m), the mean of l[m]
    over progress_mask[:, m]; ``mean`` the mean of the sequence's delta_0..delta_{m-1} (0 when
    R = 1); ``measured`` the exact difference against x_{T-1}: mean over last_mask &
    progress_mask[:, m] of (last_logp - l[m]), needing ``last_logp``, ``last_mask``,
    ``recorded_steps`` and ``num_steps`` (T); it falls back to ``extrapolate`` when r_m = T-1.

    Rows of different lengths (parallel decoding, docs/rollouts.md): row b took T_b steps
    (``num_steps`` [B], ``Rollout.steps_taken``) and reached the recorded steps r_j < T_b, so its
    last interval is m_b = ceil(T_b / s) - 1; at a (b, j) it never reached ``progress_mask`` is
    empty and ``progress_logp`` NaN everywhere (the marker read when ``num_steps`` is an int).
    Each row gets the rule above at its own m_b, and delta is NaN for j > m_b: that row has no
    such interval (it is not a delta of 0), and ``normalize`` leaves it out.
    """
    if progress_logp.dim() != 3 or progress_mask.shape != progress_logp.shape:
        raise ValueError(
            f"progress_logp {tuple(progress_logp.shape)} and progress_mask "
            f"{tuple(progress_mask.shape)} must both be [B, R, L]"
        )
    if progress_logp.shape[1] == 0:
        raise ValueError("the trace has no recorded step (R = 0)")
    check_mode("last_step", last_step, LAST_STEP_MODES)
    trace = _Trace.read(progress_logp, progress_mask, recorded_steps, num_steps)
    logp, mask = trace.logp, trace.mask
    inner = _masked_mean(logp[:, 1:] - logp[:, :-1], mask[:, :-1] & mask[:, 1:])  # [B, R-1]
    last = LAST_INTERVAL[last_step](
        trace,
        inner,
        last_logp=last_logp,
        last_mask=last_mask,
        recorded_steps=recorded_steps,
        num_steps=num_steps,
    )
    # A row's intervals after its last one do not exist (NaN; parallel decoding only).
    deltas = torch.cat([inner, inner.new_full((trace.batch, 1), math.nan)], dim=1)
    deltas = torch.where(trace.reached, deltas, math.nan)
    deltas[trace.rows, trace.last_j] = last
    return deltas


@dataclass
class _Trace:
    """A trace as ``progress_deltas`` reads it: l [B, R, L] float32 and the mask [B, R, L], both
    cleared where a row never reached r_j; ``reached`` [B, R]; each row's last interval m_b."""

    logp: Tensor
    mask: Tensor
    reached: Tensor
    last_j: Tensor  # [B] long, m_b

    @property
    def batch(self) -> int:
        return self.logp.shape[0]

    @property
    def rows(self) -> Tensor:
        return torch.arange(self.batch, device=self.logp.device)

    @property
    def ragged(self) -> bool:
        """Rows of different lengths (parallel decoding): some row misses a recorded step."""
        return not bool(self.reached.all())

    @classmethod
    def read(cls, progress_logp, progress_mask, recorded_steps, num_steps) -> _Trace:
        mask, logp = progress_mask.bool(), progress_logp.float()
        if isinstance(num_steps, Tensor) and recorded_steps is not None:
            steps = recorded_steps.to(logp.device)
            reached = steps[None, :] < num_steps.to(logp.device)[:, None]  # [B, R]
        else:  # the sampler's marker of a step never reached: nothing masked, every l[j, n] NaN
            reached = mask.any(-1) | ~logp.isnan().all(-1)
        if not bool(reached[:, 0].all()):
            raise ValueError("every row must reach the first recorded step")
        if not bool((reached[:, 1:] <= reached[:, :-1]).all()):
            raise ValueError("a row reaches a recorded step after missing an earlier one")
        if not bool(reached.all()):
            logp = torch.where(reached[..., None], logp, 0.0)
            mask = mask & reached[..., None]
        return cls(logp, mask, reached, reached.sum(1) - 1)


# δ of each row's last interval m_b, one rule per ``last_step`` mode (METHOD.md §2, "Progress"):
# rule(trace, inner deltas [B, R-1], **the measured rule's inputs) -> [B].
def _extrapolate(trace: _Trace, inner: Tensor, **_) -> Tensor:
    """δ_{m-1}; 0 when the row has a single interval."""
    if inner.shape[1] == 0:
        return trace.logp.new_zeros(trace.batch)
    previous = inner[trace.rows, (trace.last_j - 1).clamp_min(0)]
    return torch.where(trace.last_j > 0, previous, 0.0)


def _neutral(trace: _Trace, inner: Tensor, **_) -> Tensor:
    """0."""
    return trace.logp.new_zeros(trace.batch)


def _raw(trace: _Trace, inner: Tensor, **_) -> Tensor:
    """S(m, m): the mean of l[m] over the positions recorded at r_m."""
    rows, m = trace.rows, trace.last_j
    return _masked_mean(trace.logp[rows, m], trace.mask[rows, m])


def _mean(trace: _Trace, inner: Tensor, **_) -> Tensor:
    """The mean of the row's δ_0 .. δ_{m-1}; 0 when the row has a single interval."""
    if inner.shape[1] == 0:
        return trace.logp.new_zeros(trace.batch)
    if not trace.ragged:
        return inner.mean(1)
    before = torch.arange(inner.shape[1], device=inner.device)[None, :] < trace.last_j[:, None]
    return _masked_mean(inner, before)


def _measured(trace: _Trace, inner: Tensor, *, last_logp, last_mask, recorded_steps, num_steps):
    """The mean over last_mask & M_{r_m} of log p(x*_n | x_{T-1}) - l[m, n]; extrapolated when
    r_m = T - 1 (x_{T-1} is the last recorded state itself: no later evidence)."""
    if last_logp is None or last_mask is None or recorded_steps is None or num_steps is None:
        raise ValueError(
            "last_step='measured' needs last_logp, last_mask, recorded_steps and num_steps"
        )
    rows, m, logp = trace.rows, trace.last_j, trace.logp
    if last_logp.shape != logp[:, -1].shape or last_mask.shape != last_logp.shape:
        raise ValueError(
            f"last_logp {tuple(last_logp.shape)} and last_mask {tuple(last_mask.shape)} "
            f"must both be [B, L] = {tuple(logp[:, -1].shape)}"
        )
    last_recorded = recorded_steps.to(logp.device)[m]  # r_{m_b}
    final = torch.as_tensor(num_steps, device=logp.device) - 1  # T_b - 1
    if bool((last_recorded > final).any()):
        raise ValueError(
            f"recorded step {int(last_recorded.max())} is beyond the last step "
            f"{int(torch.as_tensor(final).min())}"
        )
    measured = _masked_mean(
        last_logp.float() - logp[rows, m], last_mask.bool() & trace.mask[rows, m]
    )
    return torch.where(last_recorded == final, _extrapolate(trace, inner), measured)


LAST_INTERVAL = {
    "extrapolate": _extrapolate,
    "neutral": _neutral,
    "raw": _raw,
    "mean": _mean,
    "measured": _measured,
}


def normalize(
    deltas: Tensor, axis: str = "per_step", eps: float = 1e-6, valid: Tensor | None = None
) -> Tensor:
    """Standardised deltas (d - mu) / (sigma + eps), [B, R] (METHOD.md §2, "Normalisation").

    ``per_step``: mu, sigma per interval j over the batch's trajectories (dim 0);
    ``trajectory``: per trajectory over its intervals (dim 1); ``group``: one mu, sigma over all
    deltas; ``none``: unchanged. sigma is the population standard deviation (divides by the count).
    A set of equal deltas (sigma = 0) normalises to exactly 0, never NaN.

    Only ``valid`` entries (default: the non-NaN ones) enter the statistics, and the others stay
    NaN: a row that finished before interval j (parallel decoding, ``progress_deltas``) is left
    out of interval j's mean and spread, not counted as a delta of 0.

    With several processes, gather the global [B, R] deltas, call this, and keep the local rows:
    the statistics are those of the global batch (METHOD.md §2 [decision]).
    """
    if deltas.dim() != 2:
        raise ValueError(f"deltas must be [B, R], got {tuple(deltas.shape)}")
    check_mode("axis", axis, NORM_AXES)
    valid = ~deltas.isnan() if valid is None else valid.bool() & ~deltas.isnan()
    if axis == "none":
        return torch.where(valid, deltas, math.nan)
    dims = {"per_step": (0,), "trajectory": (1,), "group": (0, 1)}[axis]
    if bool(valid.all()):
        mu = deltas.mean(dims, keepdim=True)
        sigma = deltas.std(dims, correction=0, keepdim=True)
        # Equal values have no spread; without this the rounding of mu would leak through 1/eps.
        constant = deltas.amax(dims, keepdim=True) == deltas.amin(dims, keepdim=True)
    else:
        count = valid.sum(dims, keepdim=True).clamp_min(1)
        present = torch.where(valid, deltas, 0.0)
        mu = present.sum(dims, keepdim=True) / count
        spread = torch.where(valid, (deltas - mu) ** 2, 0.0).sum(dims, keepdim=True)
        sigma = (spread / count).sqrt()
        high = torch.where(valid, deltas, -math.inf).amax(dims, keepdim=True)
        low = torch.where(valid, deltas, math.inf).amin(dims, keepdim=True)
        constant = high == low
    centred = deltas - mu
    out = torch.where(constant, torch.zeros_like(centred), centred / (sigma + eps))
    return torch.where(valid, out, math.nan)


def token_multipliers(
    norm_deltas: Tensor,
    birth_step: Tensor,
    recorded_steps: Tensor,
    lam: float,
    clamp_min: float | None = None,
) -> Tensor:
    """Per-token advantage multiplier 1 + lam * norm_deltas[b, J(n)], [B, L] (METHOD.md §2).

    Token n inherits the interval of its birth, J(n) = max{j : r_j <= birth(n)} (so births after
    r_m map to m; irregular recorded steps work too). ``clamp_min`` (e.g. 0, so that no token's
    advantage flips sign) bounds the multiplier below; off by default. lam = 0 gives exactly 1.
    """
    if (
        norm_deltas.dim() != 2
        or birth_step.dim() != 2
        or norm_deltas.shape[0] != birth_step.shape[0]
    ):
        raise ValueError(
            f"norm_deltas {tuple(norm_deltas.shape)} must be [B, R] and birth_step "
            f"{tuple(birth_step.shape)} [B, L] with the same B"
        )
    if recorded_steps.dim() != 1 or recorded_steps.numel() != norm_deltas.shape[1]:
        raise ValueError(
            f"recorded_steps {tuple(recorded_steps.shape)} must be [R], R = {norm_deltas.shape[1]}"
        )
    steps = recorded_steps.to(device=birth_step.device, dtype=torch.long).contiguous()
    births = birth_step.long().contiguous()
    if births.numel() > 0 and bool((births < steps[0]).any()):
        raise ValueError(f"a birth step precedes the first recorded step {int(steps[0])}")
    interval = torch.searchsorted(steps, births, right=True) - 1  # J(n), [B, L]
    inherited = norm_deltas.float().gather(1, interval)
    multipliers = 1.0 + lam * inherited
    if clamp_min is not None:
        multipliers = multipliers.clamp_min(clamp_min)
    return multipliers


def step_multipliers(
    rollouts: list,
    *,
    lam: float,
    last_step: str = "extrapolate",
    norm_axis: str = "per_step",
    clamp_min: float | None = None,
    eps: float = 1e-6,
    gather: Callable[[Tensor], Tensor] | None = None,
    rank: int = 0,
) -> tuple[list[Tensor], list[Tensor], dict[str, float]]:
    """DPS of one optimizer step, shared by ``daca train`` and the TRL front-end (METHOD.md §2).

    ``rollouts``: this process's ``Rollout``-likes of the step (every micro-batch of gradient
    accumulation), each recorded with the same ``dps_stride`` and step budget. The deltas of all
    of them, and of every process (``gather``: a Tensor of this process's rows -> the rows of
    all processes in rank order, each process giving as many; None = one process), are
    z-scored together, so the statistics are those of the optimizer step's trajectories
    **[decision]**; ``rank`` says where this process's rows lie in the gathered tensor.
    Each row's interval count comes from its ``steps_taken`` (rows may take different numbers
    of steps; the intervals a row has not reached are NaN and left out of every statistic).

    Returns, per rollout, the multipliers [B, L] and the normalised deltas [B, R], and the
    step's metrics, each over all processes' rows: ``dps/delta_mean``, ``dps/delta_std``
    (population) of the deltas, ``dps/multiplier_min``, ``_max``, ``_std`` (population) of the
    multipliers of every completion position. ``gather`` is called twice (deltas, multipliers),
    on every process alike.
    """
    if not rollouts:
        raise ValueError("no rollout to compute DPS multipliers from")
    steps = rollouts[0].recorded_steps
    if any(getattr(r, "progress_logp", None) is None for r in rollouts):
        raise ValueError("a rollout carries no DPS trace; generate it with dps_stride=s")
    if any(not torch.equal(r.recorded_steps.cpu(), steps.cpu()) for r in rollouts):
        raise ValueError("the rollouts of one step must share their recorded steps")
    gather = gather or (lambda t: t)
    deltas = [rollout_deltas(r, last_step) for r in rollouts]
    local = torch.cat(deltas)
    everything = gather(local.contiguous())
    start = rank * local.shape[0]
    normed = normalize(everything, norm_axis, eps)[start : start + local.shape[0]]
    sizes = [d.shape[0] for d in deltas]
    normed_each = list(normed.split(sizes))
    multipliers = [
        token_multipliers(n, r.birth_step, r.recorded_steps, lam, clamp_min)
        for n, r in zip(normed_each, rollouts, strict=True)
    ]
    every = gather(torch.cat([m.flatten() for m in multipliers]).contiguous())
    metrics = {
        "dps/delta_mean": _nan_mean(everything),
        "dps/delta_std": _nan_std(everything),
        "dps/multiplier_min": _nan_extreme(every, torch.amin),
        "dps/multiplier_max": _nan_extreme(every, torch.amax),
        "dps/multiplier_std": _nan_std(every),
    }
    return multipliers, normed_each, metrics


def _nan_mean(x: Tensor) -> float:
    return x.double().nanmean().item()


def _nan_std(x: Tensor) -> float:
    """Population standard deviation of the non-NaN entries (0 for fewer than two)."""
    values = x.double()[~x.isnan()]
    return values.std(correction=0).item() if values.numel() > 1 else 0.0


def _nan_extreme(x: Tensor, extreme) -> float:
    values = x[~x.isnan()]
    return extreme(values).item() if values.numel() else math.nan


def _steps_of(rollout):
    """T_b per row when the rollout has them (``steps_taken``), else the budget T."""
    taken = getattr(rollout, "steps_taken", None)
    return taken if taken is not None else getattr(rollout, "num_steps", None)


def rollout_deltas(rollout, last_step: str) -> Tensor:
    """``progress_deltas`` [B, m+1] of a ``Rollout``'s recorded trace (its own last-step rows,
    recorded steps and per-row step counts)."""
    return progress_deltas(
        rollout.progress_logp,
        rollout.progress_mask,
        last_step,
        last_logp=getattr(rollout, "last_logp", None),
        last_mask=getattr(rollout, "last_mask", None),
        recorded_steps=rollout.recorded_steps,
        num_steps=_steps_of(rollout),
    )


def rollout_multipliers(
    rollout,
    *,
    lam: float,
    last_step: str = "extrapolate",
    norm_axis: str = "per_step",
    clamp_min: float | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """``token_multipliers`` of a ``Rollout``-like object recorded with ``dps_stride`` [B, L].

    Reads ``progress_logp``, ``progress_mask``, ``recorded_steps``, ``birth_step`` and, for
    ``last_step="measured"``, ``last_logp``, ``last_mask``, ``steps_taken`` (else
    ``num_steps``). For the rollouts of a training step over several processes use
    ``step_multipliers``.
    """
    if getattr(rollout, "progress_logp", None) is None:
        raise ValueError("the rollout carries no DPS trace; generate it with dps_stride=s")
    norm = normalize(rollout_deltas(rollout, last_step), norm_axis, eps)
    return token_multipliers(norm, rollout.birth_step, rollout.recorded_steps, lam, clamp_min)


def center_per_sequence(multipliers: Tensor, valid: Tensor) -> Tensor:
    """Each row's multipliers shifted so that their mean over ``valid`` is 1 (METHOD.md §2,
    ``center = "sequence"``): m_n - mean_valid(m) + 1, [B, L]; positions that are not valid
    are left as they are. A shift, not a division: a row's mean may be near 0 or negative."""
    if valid.shape != multipliers.shape:
        raise ValueError(
            f"valid {tuple(valid.shape)} must be the multipliers' {tuple(multipliers.shape)}"
        )
    valid = valid.bool()
    mean = _masked_mean(multipliers.float(), valid)  # [B]
    shifted = multipliers - mean[:, None].to(multipliers.dtype) + 1.0
    return torch.where(valid, shifted, multipliers)


def oracle_multipliers(
    labels: Tensor,
    advantages: Tensor,
    reference: Tensor,
    valid: Tensor,
    *,
    gather: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The oracle-credit control (METHOD.md §2, "Oracle credit"): multipliers [B, L] from the
    ground truth, with the mean and spread of ``reference`` (DPS's multipliers of the same step).

    ``labels`` [B, L]: +1 a token of a right unit (trace step, answer cell), -1 of a wrong one,
    0 none; ``advantages`` [B]; ``valid`` [B, L] the positions that count (the completion mask).
    A token's score is o_n = label_n * sign(A): +1 where its correctness agrees with its
    completion's outcome (a right step of a rewarded completion, a wrong one of a penalised
    one), so its advantage is scaled up; -1 where it disagrees. The multiplier is
    mu + sigma * (o_n - mean o) / std o, mu and sigma the population mean and spread of
    ``reference`` over the valid positions of every process (``gather``: this process's
    Tensor -> all processes' concatenated, as ``step_multipliers``); all scores equal: mu.
    Positions that are not valid get mu.

    Returns the multipliers and ``dps/oracle_corr``, the correlation of ``reference`` with o
    over the valid positions (how far DPS's own multiplier agrees with the oracle's ranking).
    """
    if labels.shape != reference.shape or valid.shape != reference.shape:
        raise ValueError(
            f"labels {tuple(labels.shape)}, reference {tuple(reference.shape)} and valid "
            f"{tuple(valid.shape)} must share their [B, L] shape"
        )
    if advantages.shape != reference.shape[:1]:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] = {reference.shape[0]}")
    valid = valid.bool()
    score = (labels.double() * advantages.double().sign()[:, None]).where(valid, 0.0)
    ref = reference.double().where(valid, 0.0)
    # Sums of this process's rows; their global totals give the step's statistics.
    sums = torch.stack(
        [valid.sum().double(), ref.sum(), (ref * ref).sum(), score.sum(),
         (score * score).sum(), (ref * score).sum()]
    )  # fmt: skip
    n, s_ref, s_ref2, s_o, s_o2, s_cross = (gather or (lambda t: t))(sums).reshape(-1, 6).sum(0)
    n = n.clamp_min(1)
    mu, mu_o = s_ref / n, s_o / n
    var, var_o = (s_ref2 / n - mu * mu).clamp_min(0), (s_o2 / n - mu_o * mu_o).clamp_min(0)
    sigma, sigma_o = var.sqrt(), var_o.sqrt()
    out = mu + sigma * (score - mu_o) / sigma_o if sigma_o > 0 else mu.expand_as(score)
    out = out.where(valid, mu).to(reference.dtype)
    corr = (s_cross / n - mu * mu_o) / (sigma * sigma_o) if sigma > 0 and sigma_o > 0 else 0.0
    return out, {"dps/oracle_corr": float(corr)}
