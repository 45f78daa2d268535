"""The update half of a training step: per-token log-probs through the method's estimator (with
SML), old-policy and reference log-probs, the loss, and the μ inner iterations of optimizer
updates over the step's micro-batches (METHOD.md §4).

The plain functions (``token_logp``, ``method_loss``, ``micro_batch_loss``,
``old_and_reference``) are what a step computes, with the masks of
``daca.train.seeds.mask_seed``; ``daca train`` (``UpdateSteps``) and the TRL front-end
(``daca.integrations.trl``) both call them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from torch import Tensor

from daca.core import likelihood, objectives
from daca.train.config import TrainConfig
from daca.train.methods import BaseMethod
from daca.train.rollout import RolloutBatch
from daca.train.seeds import estimator_generator, strata_generator


def sml_num_strata(cfg: TrainConfig, step: int) -> int:
    """SML's K for a rollout of training step ``step``: ``sml.num_strata``, or with
    ``sml.anneal_steps`` its annealed value (``daca.core.likelihood.annealed_num_strata``).
    Old, current and reference log-probs of one rollout read the same step, hence the same K."""
    return likelihood.annealed_num_strata(cfg.sml.num_strata, cfg.sml.anneal_steps, step)


def token_logp(
    method: BaseMethod, model, batch: RolloutBatch, cfg: TrainConfig, seed: int, mask_id: int
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs [B, L] for the ratio (or wd1's likelihood) and the SML regulariser's
    (None unless ``method.sml`` is "regulariser" with η > 0), with the masks of ``seed``
    (``daca.train.seeds.mask_seed``); SML enriches the ratio's as ½(ℓ + ℓ^SML) (METHOD.md §4),
    with the K of the batch's step (``sml_num_strata``)."""
    device = batch.prompt_ids.device
    base = method.estimator(model, batch, cfg, estimator_generator(device, seed), mask_id)
    regulariser = method.sml == "regulariser"
    if not cfg.sml.enabled or (regulariser and cfg.sml.eta == 0):
        return base, None  # a regulariser of weight 0 would discard the K forwards
    sml = likelihood.stratified_logp(
        model,
        batch.prompt_ids,
        batch.completion_ids,
        mask_id=mask_id,
        attention_mask=batch.prompt_mask,
        num_strata=sml_num_strata(cfg, batch.step),
        strata=cfg.sml.strata,
        generator=strata_generator(device, seed),
    )
    if regulariser:
        return base, sml
    return objectives.sml_enriched(base, sml), None


def method_loss(
    method: BaseMethod,
    cfg: TrainConfig,
    batch: RolloutBatch,
    logp: Tensor,
    sml: Tensor | None,
    it: int,
) -> tuple[Tensor, dict]:
    """The method's loss of one micro-batch at inner iteration ``it``: its old-policy log-probs
    (at iteration 0, or for a method without a ratio, the current ones, detached: no update has
    been made yet), its reference log-probs (none: β = 0), its advantages and DPS multipliers."""
    return method.loss(
        cfg,
        logp,
        old_logp=batch.old_logp[it - 1] if it > 0 and batch.old_logp else logp.detach(),
        ref_logp=batch.ref_logp[it] if batch.ref_logp else None,
        advantages=batch.advantages,
        completion_mask=batch.completion_mask,
        token_multipliers=batch.multipliers,
        sml_logp=sml,
    )


def micro_batch_loss(
    method: BaseMethod, cfg: TrainConfig, model, batch: RolloutBatch, it: int, seed: int, mask_id
) -> tuple[Tensor, dict, Tensor]:
    """One micro-batch's loss at inner iteration ``it`` under the masks of ``seed``: the
    method's log-probs (``token_logp``), then its loss (``method_loss``). Returns (loss, the
    loss's metrics, the log-probs)."""
    logp, sml = token_logp(method, model, batch, cfg, seed, mask_id)
    loss, metrics = method_loss(method, cfg, batch, logp, sml, it)
    if cfg.sml.enabled and cfg.sml.anneal_steps:
        metrics = {**metrics, "sml/num_strata": float(sml_num_strata(cfg, batch.step))}
    return loss, metrics, logp


@torch.no_grad()
def old_and_reference(
    method: BaseMethod,
    cfg: TrainConfig,
    model,
    reference: Callable[[], contextlib.AbstractContextManager],
    batches: list[RolloutBatch],
    seeds: list[list[int]],
    mask_id: int,
) -> None:
    """``old_logp`` and ``ref_logp`` of each of the step's micro-batches, once per rollout: the
    old policy's (``model`` before its updates) for each inner iteration after the first, with
    its mask seed (``seeds[micro-batch][1:]``), and the reference's (``reference()`` yields it)
    for every iteration when β > 0. A method without a ratio has neither.

    Iteration 0 needs no old forward: no update has been made before it, so the old policy's
    log-probs under its masks are the update's own, detached (``method_loss``): the same
    numbers without dropout (bit for bit on the tiny CPU models), one likelihood evaluation
    (K + 1 forwards with SML) fewer per rollout (METHOD.md §4)."""
    if not method.ratio:
        return
    for batch, batch_seeds in zip(batches, seeds, strict=True):
        batch.old_logp = [
            token_logp(method, model, batch, cfg, s, mask_id)[0] for s in batch_seeds[1:]
        ]
        if cfg.beta > 0:
            with reference() as ref:
                batch.ref_logp = [
                    token_logp(method, ref, batch, cfg, s, mask_id)[0] for s in batch_seeds
                ]


class UpdateSteps:
    """The update half of ``Trainer`` (a mixin: it reads the trainer's ``cfg``, ``method``,
    ``acc``, ``model``, ``optimizer``, ``scheduler``, ``bundle`` and ``ref_model``)."""

    @contextlib.contextmanager
    def _reference(self):
        """The reference policy: the adapter-disabled base under LoRA, else a frozen copy."""
        if self.ref_model is not None:
            yield self.ref_model
        else:
            with self.acc.unwrap_model(self.model).disable_adapter():
                yield self.model

    def _diagnose(self, batch: RolloutBatch) -> str:
        """Why a micro-batch's loss is not finite, with what to try."""
        params = self.acc.unwrap_model(self.model).parameters()
        if not all(torch.isfinite(p).all() for p in params):
            return (
                "the model's weights hold NaN or inf (go back to an earlier checkpoint and "
                "lower learning_rate or max_grad_norm)"
            )
        if not bool(self._logp_finite):
            return (
                "non-finite log-probabilities: the model's logits hold NaN or inf (with bf16, "
                "try fp32; lower learning_rate)"
            )
        if batch.multipliers is not None and not torch.isfinite(batch.multipliers).all():
            return "non-finite DPS multipliers (the rollout's logits held NaN or inf)"
        if not torch.isfinite(batch.advantages).all():
            return "non-finite advantages (check the reward functions)"
        return (
            "a non-finite loss from finite log-probabilities and advantages (check psi, "
            "epsilon and beta)"
        )

    def _loss(self, batch: RolloutBatch, it: int, seed: int) -> tuple[Tensor, dict]:
        cfg, mask_id = self.cfg, self.bundle.mask_id
        loss, metrics, logp = micro_batch_loss(
            self.method, cfg, self.model, batch, it, seed, mask_id
        )
        self._logp_finite = torch.isfinite(logp).all()  # read only to diagnose a bad loss
        return loss, metrics

    def _old_and_reference(self, batches: list[RolloutBatch], seeds: list[list[int]]) -> None:
        """Old and reference log-probs once per rollout, with the μ iterations' mask seeds."""
        mask_id = self.bundle.mask_id
        old_and_reference(
            self.method, self.cfg, self.model, self._reference, batches, seeds, mask_id
        )

    def _inner_iterations(self, batches: list[RolloutBatch], seeds: list[list[int]], mu: int):
        """μ optimizer updates on the step's rollouts, each accumulating gradients over the
        micro-batches; a non-finite update is skipped on every rank alike.
        Returns (per micro-batch metrics, the last gradient norm, whether any was skipped)."""
        cfg = self.cfg
        update_stats: list[dict] = []
        skipped = False
        for it in range(mu):
            cause = ""
            for m, batch in enumerate(batches):
                # accumulate() divides the loss by gas and syncs gradients on the last micro-batch.
                # Every rank runs every backward, even of a NaN loss: DDP's all-reduce needs all.
                with self.acc.accumulate(self.model):
                    loss, metrics = self._loss(batch, it, seeds[m][it])
                    self.acc.backward(loss)
                metrics = {k: float(v) for k, v in metrics.items()}
                metrics["loss"] = loss.item()
                update_stats.append(metrics)
                if not cause and not math.isfinite(metrics["loss"]):
                    cause = self._diagnose(batch)
            grad_norm = self.acc.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            if not cause and grad_norm is not None and not math.isfinite(float(grad_norm)):
                cause = "non-finite gradients (lower learning_rate; with bf16, try fp32)"
            # A non-finite update would poison the weights and AdamW's moments: skip it, on
            # every rank alike (the loss is local; the gradient norm is already global).
            if self._anywhere(bool(cause)):
                skipped = True
                self._nonfinite_cause = cause or "a non-finite loss on another process"
            else:
                self.optimizer.step()
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return update_stats, grad_norm, skipped
