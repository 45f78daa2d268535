"""The base methods, one registry entry each (METHOD.md §4, §6): everything the trainer, the
ablation grid and the memory estimate need to know about a method, so that no other module
tests a method's name. Adding a base method = its estimator and loss in the core, one entry here.

An entry's callables take the run's ``TrainConfig`` as ``cfg`` (and, for the estimator, a
``RolloutBatch`` of the trainer: ``prompt_ids``, ``prompt_mask``, ``completion_ids``,
``completion_mask``). ``cfg`` is not annotated: ``daca.train.config`` imports this registry (the
names, betas and published settings it validates and fills in), and this module imports nothing
back, not even for annotations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class BaseMethod:
    """One base method.

    estimator(model, batch, cfg, generator, mask_id) -> per-token log-probs [B, L] (the base
        ℓ that the ratio, or wd1's likelihood, reads; SML is added by the caller).
    loss(cfg, logp, *, old_logp, ref_logp, advantages, completion_mask, token_multipliers,
        sml_logp) -> (loss, metrics).
    ratio: a policy ratio: old-policy log-probs for the μ = ``num_iterations`` inner updates
        per rollout, a KL against a reference when β > 0 (wd1 has neither; it still takes μ
        updates per rollout, each with a fresh mask seed, as its reference code does).
    beta: the reference code's KL weight, used when the config leaves ``beta`` unset.
    compare_iterations: μ of ``daca compare``'s tiny runs.
    baseline: ``objectives.group_advantages``'s baseline.
    sml: how SML enters: ``"enriched"`` ratio ½(ℓ^base + ℓ^SML) for the current, old and
        reference policies, or wd1's ``"regulariser"`` −(η/G)·Σ log p^SML.
    forward_views(cfg) -> (views stacked in the estimator's forward, completion rows scored
        per token over them): the memory estimate's factors (``daca.tools.memory``).
    in_paper: one of the paper's three base methods (``daca compare``'s default grid).
    published: the settings of the method's reference code that differ between methods (μ, where
        not the task's, β, learning rate), which a recipe with ``published_settings: true`` takes
        for the method it runs (``daca.train.config.load_config``).
    """

    name: str
    estimator: Callable[..., Tensor]
    loss: Callable[..., tuple[Tensor, dict]]
    ratio: bool
    beta: float
    compare_iterations: int
    baseline: str
    sml: Literal["enriched", "regulariser"]
    forward_views: Callable[..., tuple[int, float]]
    in_paper: bool = True
    published: dict = field(default_factory=dict)


# ----------------------------------------------------------------- estimators
# Each callable imports the core (torch) when called: the configuration and `daca --help` read
# the registry's names and numbers without importing torch.
def _mean_field(model, batch, cfg, generator, mask_id: int) -> Tensor:
    """d1's ℓ^MF with the config's prompt masking (Diffu-GRPO, wd1)."""
    from daca.core import likelihood

    return likelihood.mean_field_logp(
        model,
        batch.prompt_ids,
        batch.completion_ids,
        mask_id=mask_id,
        attention_mask=batch.prompt_mask,
        p_mask_prompt=cfg.p_mask_prompt,
        generator=generator,
    )


def _elbo(model, batch, cfg, generator, mask_id: int) -> Tensor:
    """GDPO's quadrature ELBO token terms: as the reference code, ⌊t·L⌋ of all L completion
    positions masked, padding included (``gdpo_reduction="sequence"``), or max(1, ⌊t·N⌋) of
    the N real tokens only ("token")."""
    from daca.core import likelihood

    reference = cfg.gdpo_reduction == "sequence"
    return likelihood.elbo_token_terms(
        model,
        batch.prompt_ids,
        batch.completion_ids,
        mask_id=mask_id,
        attention_mask=batch.prompt_mask,
        quadrature=cfg.quadrature,
        generator=generator,
        completion_mask=None if reference else batch.completion_mask,
        at_least_one=not reference,
    )


def _coupled(model, batch, cfg, generator, mask_id: int) -> Tensor:
    """coupled-GRPO's ℓ^C with one complementary pair (DiffuCoder's λ = 1; prompt unmasked)."""
    from daca.core import likelihood

    return likelihood.coupled_logp(
        model,
        batch.prompt_ids,
        batch.completion_ids,
        mask_id=mask_id,
        attention_mask=batch.prompt_mask,
        generator=generator,
    )


# ----------------------------------------------------------------- losses
def _wd1_loss(cfg, logp, *, advantages, completion_mask, token_multipliers, **rest):
    from daca.core import objectives

    return objectives.wd1_loss(
        logp,
        advantages,
        completion_mask,
        num_generations=cfg.num_generations,
        psi=cfg.psi,
        token_multipliers=token_multipliers,
        sml_logp=rest["sml_logp"],
        eta=cfg.sml.eta if cfg.sml.enabled else 0.0,
    )


def _ratio_loss(objective, ref_key: str, cfg, logp, **kw):
    """A ratio method's loss: ``objective(logp, old, A, mask, ε, β, <ref_key>=ref, m, **extra)``
    (``extra``: ``kw["extra"]``, the method's own options)."""
    return objective(
        logp,
        kw["old_logp"],
        kw["advantages"],
        kw["completion_mask"],
        epsilon=cfg.epsilon,
        beta=cfg.beta,
        token_multipliers=kw["token_multipliers"],
        **{ref_key: kw["ref_logp"]},
        **kw.get("extra", {}),
    )


# The objectives are looked up when called (tests replace them with spies).
def _diffu_grpo_loss(cfg, logp, **kw):
    from daca.core import objectives

    return _ratio_loss(objectives.diffu_grpo_loss, "ref_logp", cfg, logp, **kw)


def _gdpo_loss(cfg, logp, **kw):
    from daca.core import objectives

    extra = {"reduction": cfg.gdpo_reduction}
    return _ratio_loss(objectives.gdpo_loss, "ref_token_terms", cfg, logp, extra=extra, **kw)


def _coupled_grpo_loss(cfg, logp, **kw):
    from daca.core import objectives

    return _ratio_loss(objectives.coupled_grpo_loss, "ref_logp", cfg, logp, **kw)


# ----------------------------------------------------------------- memory factors
def _one_view(cfg) -> tuple[int, float]:
    return 1, 1.0


def _quadrature_views(cfg) -> tuple[int, float]:
    """One view per node; node t masks t·L positions and the nodes' t sum to n / 2."""
    from daca.core import likelihood

    nodes = len(likelihood.quadrature_nodes(cfg.quadrature)[0])
    return nodes, nodes / 2


def _coupled_views(cfg) -> tuple[int, float]:
    """1 + 2λ views (λ = 1): the full mask scores every token, each pair every token once."""
    return 3, 2.0


METHODS: dict[str, BaseMethod] = {
    m.name: m
    for m in (
        BaseMethod(
            name="diffu_grpo",
            estimator=_mean_field,
            loss=_diffu_grpo_loss,
            ratio=True,
            beta=0.04,
            compare_iterations=2,
            baseline="mean",
            sml="enriched",
            forward_views=_one_view,
            published={"learning_rate": 3e-6, "beta": 0.04},
        ),
        BaseMethod(
            name="wd1",
            estimator=_mean_field,
            loss=_wd1_loss,
            ratio=False,
            beta=0.0,
            compare_iterations=1,
            baseline="mean",
            sml="regulariser",
            forward_views=_one_view,
            published={"learning_rate": 3e-6, "beta": 0.0},
        ),
        BaseMethod(
            name="gdpo",
            estimator=_elbo,
            loss=_gdpo_loss,
            ratio=True,
            beta=0.0,
            compare_iterations=2,
            baseline="mean",
            sml="enriched",
            forward_views=_quadrature_views,
            published={"learning_rate": 3e-7, "beta": 0.0},
        ),
        BaseMethod(
            name="coupled_grpo",
            estimator=_coupled,
            loss=_coupled_grpo_loss,
            ratio=True,
            beta=0.01,
            compare_iterations=2,
            baseline="leave_one_out",
            sml="enriched",
            forward_views=_coupled_views,
            in_paper=False,
            published={"learning_rate": 1e-6, "beta": 0.01, "num_iterations": 2},
        ),
    )
}
# The config's type of ``method``: its validation and error messages name exactly these.
MethodName = Literal[tuple(METHODS)]  # type: ignore[valid-type]


def get_method(name: str) -> BaseMethod:
    """The registry entry of ``name``; a KeyError names the valid methods."""
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; choose from {sorted(METHODS)}") from None


def paper_methods() -> list[str]:
    """The paper's base methods, in registry order."""
    return [name for name, m in METHODS.items() if m.in_paper]


__all__ = ["METHODS", "BaseMethod", "MethodName", "get_method", "paper_methods"]
