"""DACA-GRPO inside TRL's ``GRPOTrainer`` (METHOD.md §2-§4), for masked diffusion LMs.

``DACAGRPOTrainer`` keeps TRL's data pipeline, reward functions, group advantages, PPO-style
loss, logging and checkpointing, and swaps in the three things a masked diffusion LM needs:

- generation: the core sampler ``daca.generate`` (METHOD.md §1, with the DPS trace), never
  ``model.generate``, which would decode left to right;
- per-token log-probs: the core estimators, mean-field ℓ^MF (prompt tokens masked with
  ``p_mask_prompt``, whole completion masked) or the SML-enriched ½(ℓ^MF + ℓ^SML) (METHOD.md §4);
  the masks of inner iteration k are drawn once per rollout and shared by the current, old and
  reference policies (each row carries its own masks through TRL's shuffling and splitting);
- advantages: TRL's group advantage A times the DPS multiplier (1 + λ δ̄_{J(n)}) of each token
  (METHOD.md §2), passed to TRL's loss as a [B, L] tensor, which TRL's ``_compute_loss`` accepts.

With ``DACAGRPOConfig(method=...)`` (a base method of ``daca.train.methods.METHODS``) the
front-end computes every micro-batch as ``daca train`` does, through the same functions
(``daca.train.update``): the method's estimator (with SML), group advantages with its baseline
times the DPS multipliers, old and reference log-probs per inner iteration, its loss, and the
native trainer's seeds for the sampler and the masks; TRL keeps the data, the reward functions,
the optimizer loop, logging and checkpoints (docs/trl.md, "One method, two front-ends").

TRL internals overridden (private, hence the exact pin ``trl==1.16.0``):
``_generate_single_turn`` (the sampler), ``_generate`` (full completions and the loss mask),
``_calculate_rewards`` (keeps the rewards for ``method``), ``_prepare_inputs`` (``method``:
micro-batches in order), ``_generate_and_score_completions`` (DPS, per-iteration old/reference
log-probs), ``_get_per_token_logps_and_entropies`` (the estimators), ``_compute_loss`` (selects
the inner iteration's masks, then runs TRL's own loss unchanged, or the method's loss) and
``_save`` (``daca.json``).

Completions are kept at their full length L as the sampler produced them (the likelihood views
need every position); tokens after the first end-of-sequence token are left out of the loss
through TRL's ``tool_mask`` (TRL's mask of tokens the policy is not trained on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

try:
    import trl
    from transformers import GenerationConfig
    from trl import GRPOConfig, GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing, unwrap_model_for_generation
    from trl.trainer.utils import is_async_callable, use_adapter
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "daca.integrations.trl needs TRL: pip install 'daca-grpo[trl]' (trl==1.16.0)"
    ) from e

from daca.core.dps import step_multipliers
from daca.core.likelihood import mean_field_logp, strata_assignment, stratified_logp
from daca.core.objectives import group_advantages, sml_enriched
from daca.core.sampler import Rollout, generate
from daca.models.loading import LoadedModel, load, write_meta
from daca.models.prompts import left_pad as left_pad_lists
from daca.models.prompts import up_to_eos
from daca.train.config import (
    DPSConfig,
    GenerationConfig,
    SMLConfig,
    TrainConfig,
    check_sampling,
    from_dict,
    validate,
)
from daca.train.methods import METHODS, get_method
from daca.train.rollout import RolloutBatch, sampler_generator
from daca.train.update import mask_seed, method_loss, old_and_reference, token_logp

TRL_VERSION = "1.16.0"
if trl.__version__ != TRL_VERSION:
    raise ImportError(
        f"daca.integrations.trl overrides private methods of TRL {TRL_VERSION}; found TRL "
        f"{trl.__version__}. Install the pinned version: pip install 'daca-grpo[trl]'"
    )


def _f(default, help: str):
    return field(default=default, metadata={"help": help})


# The config sections whose fields DACAGRPOConfig carries, flat, under a prefix: the sampler's
# under their own names, DPS's and SML's as dps_* and sml_*.
SECTIONS = {
    "generation": ("", GenerationConfig),
    "dps": ("dps_", DPSConfig),
    "sml": ("sml_", SMLConfig),
}
# TrainConfig's own fields that the registry's estimators and losses read and GRPOConfig lacks,
# carried under their names.
TOP_LEVEL = ("p_mask_prompt", "psi", "quadrature")
# Fields that only ``method=`` reads (TRL's loss reads none of them).
METHOD_ONLY = ("psi", "quadrature", "sml_eta")
# TrainConfig's fields that ``DACAGRPOConfig.train_config`` takes from this config (TRL's own
# fields of the same name and meaning, and TOP_LEVEL's); the sections come from SECTIONS.
TRAIN_FIELDS = (
    "method",
    "num_generations",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_iterations",
    "beta",
    "epsilon",
    "scale_rewards",
    "seed",
    *TOP_LEVEL,
)
# TRL's options of its own loss and advantages: with ``method=`` the method's replace them, so
# a value other than TRL's default would silently not apply.
TRL_LOSS_OPTIONS = (
    "loss_type",
    "epsilon_high",
    "delta",
    "importance_sampling_level",
    "top_entropy_quantile",
    "entropy_coef",
    "use_adaptive_entropy",
    "off_policy_mask_threshold",
    "multi_objective_aggregation",
)


def _flat_name(section: str, name: str) -> str:
    return SECTIONS[section][0] + name


def _carried():
    """(flat name, source field, type) of every daca field that DACAGRPOConfig carries."""
    for prefix, source in SECTIONS.values():
        hints = typing.get_type_hints(source)
        for f in dataclasses.fields(source):
            yield prefix + f.name, f, hints[f.name]
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name in TOP_LEVEL:
            yield f.name, f, hints[f.name]


def _with_sections(cls):
    """Add every field of ``SECTIONS`` and ``TOP_LEVEL`` to ``cls`` (before ``@dataclass``): name,
    type, default and help from daca's dataclass, so that there is one source of truth for them."""
    for name, f, hint in _carried():
        cls.__annotations__[name] = hint
        setattr(cls, name, field(default=f.default, metadata=dict(f.metadata)))
    return cls


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


@dataclass
@_with_sections
class DACAGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the masked-diffusion sampler, the likelihood and DACA's switches.

    Every TRL field keeps its meaning; ``temperature`` is the sampler's Gumbel temperature
    (default 0.9, the paper's training temperature) and ``max_completion_length`` is set to
    ``gen_length``. The sampler's fields (``gen_length``, ``steps``, ``block_length``,
    ``temperature``, ``cfg_scale``, ``remasking``, ``cache``, ``parallel_threshold``), DPS's
    (``dps_enabled``, ``dps_lam``, ``dps_stride``, ...) and SML's (``sml_enabled``,
    ``sml_num_strata``, ``sml_strata``) are those of ``daca.train.config``'s ``GenerationConfig``,
    ``DPSConfig`` and ``SMLConfig`` (defaults, help and validation), flattened, and so are
    ``p_mask_prompt``, ``psi`` and ``quadrature`` of ``TrainConfig``. Unset ``mask_id`` /
    ``prompt_width`` are read from the model loaded by ``daca.models.load`` (when the trainer is
    given a name or path) or the tokenizer. ``method`` (a name of
    ``daca.train.methods.METHODS``) computes each micro-batch as ``daca train`` does, with
    ``train_config()``'s values; None keeps TRL's loss on the mean-field log-probs.
    """

    mask_id: int | None = _f(None, "mask token id (None: the loaded model's or the tokenizer's)")
    prompt_width: int | None = _f(
        None, "left pad every prompt to exactly this width (models with absolute positions)"
    )
    method: str | None = _f(
        None,
        "a base method of daca.train.methods.METHODS: its estimator, advantages and loss, as "
        "`daca train` computes them (docs/trl.md); None: TRL's loss on mean-field log-probs",
    )

    def section(self, name: str):
        """The ``daca.train.config`` dataclass of section ``name`` ("generation", "dps", "sml")
        with this config's values, type-checked (a ConfigError names the flat field)."""
        prefix, source = SECTIONS[name]
        values = {f.name: getattr(self, prefix + f.name) for f in dataclasses.fields(source)}
        return from_dict(source, values, prefix)

    def train_config(self) -> TrainConfig:
        """The ``daca train`` config that ``method`` computes with: ``TRAIN_FIELDS`` and the
        sections from this config, the rest ``TrainConfig``'s defaults (read by nothing here),
        type-checked and validated as ``daca train`` validates it (a ConfigError, a ValueError,
        names the field)."""
        if self.method is None:
            raise ValueError("train_config() needs a method (DACAGRPOConfig.method)")
        cfg = from_dict(TrainConfig, {name: getattr(self, name) for name in TRAIN_FIELDS})
        cfg = dataclasses.replace(cfg, **{name: self.section(name) for name in SECTIONS})
        validate(cfg)
        return cfg

    def _check_method(self) -> None:
        """``method``'s name, the TRL options it would leave unread, and ``train_config()``;
        without it, the fields only a method reads left at their defaults."""
        if self.method is None:
            ours = {name: f.default for name, f, _ in _carried()}
            unread = [n for n in METHOD_ONLY if getattr(self, n) != ours[n]]
            if unread:
                raise ValueError(f"{unread} are read only with method= (TRL's loss reads none)")
            return
        try:
            get_method(self.method)
        except KeyError as e:
            raise ValueError(f"{e.args[0]} (or None for TRL's loss)") from None
        trl = _defaults(GRPOConfig)
        replaced = [n for n in TRL_LOSS_OPTIONS if getattr(self, n) != trl[n]]
        if replaced:
            raise ValueError(
                f"{replaced} configure TRL's loss or advantages, which method={self.method!r} "
                "replaces by its own: leave them at TRL's defaults (docs/trl.md)"
            )
        if not METHODS[self.method].ratio and self.beta != 0:
            raise ValueError(
                f"method={self.method!r} has no policy ratio, hence no KL against a reference: "
                f"set beta=0 (got {self.beta})"
            )
        self.train_config()

    def __post_init__(self):
        super().__post_init__()
        check_sampling(*(self.section(n) for n in SECTIONS), key=_flat_name)
        if not 0.0 <= self.p_mask_prompt <= 1.0:
            raise ValueError(f"p_mask_prompt must lie in [0, 1], got {self.p_mask_prompt}")
        if self.steps_per_generation != self.gradient_accumulation_steps:
            # DPS z-scores over one generation batch: it must be the optimizer step's (METHOD §2).
            raise ValueError(
                f"steps_per_generation={self.steps_per_generation} must equal "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}: DPS normalises "
                "over the trajectories of one optimizer step, TRL's generation batch"
            )
        unsupported = {
            "use_vllm": self.use_vllm,
            "use_transformers_continuous_batching": self.use_transformers_continuous_batching,
            "mask_truncated_completions": self.mask_truncated_completions,
            "pad_to_multiple_of": self.pad_to_multiple_of is not None,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"DACAGRPOConfig: {bad} do not apply to the masked-diffusion sampler")
        self._check_method()
        self.max_completion_length = self.gen_length


def mask_views(
    prompt_mask: Tensor,
    gen_length: int,
    iterations: int,
    *,
    p_mask_prompt: float,
    num_strata: int | None = None,
    strata: str = "random",
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The masks of every inner iteration, drawn once per rollout (METHOD.md §3, §4).

    prompt_mask [B, P] (1 = real token) -> prompt_hide [B, mu, P] bool (a real prompt token is
    masked with probability ``p_mask_prompt``, as in ``mean_field_logp``) and, with
    ``num_strata``, strata [B, mu, L] long (``strata_assignment``). Row-major, so that TRL's
    shuffling and splitting of the batch keep each row's masks with it.
    Generator: one ``torch.rand(B, mu, P)``, then what ``strata_assignment`` draws for B*mu rows.
    """
    B, P = prompt_mask.shape
    draw = torch.rand(B, iterations, P, generator=generator, device=prompt_mask.device)
    hide = (draw < p_mask_prompt) & prompt_mask.bool()[:, None]
    if num_strata is None:
        return hide, None
    k_of = strata_assignment(
        B * iterations, gen_length, num_strata, strata, generator=generator, device=hide.device
    )
    return hide, k_of.view(B, iterations, gen_length)


def left_pad(
    ids: list[list[int]] | Tensor, mask: Tensor | None, width: int, pad_id: int
) -> tuple[Tensor, Tensor]:
    """Prompts left padded to exactly ``width``: ids [B, width] long, mask [B, width] long.

    ``ids``: lists of real tokens (mask None; ``daca.models.prompts.left_pad``), or TRL's
    left-padded [B, P] tensor with its mask, re-padded: columns beyond ``width`` may be dropped
    only if they hold padding.
    """
    if isinstance(ids, list):
        if any(len(row) > width for row in ids):
            raise ValueError(f"a prompt has more than prompt_width={width} tokens")
        return left_pad_lists(ids, width, pad_id)
    extra = ids.shape[1] - width
    if extra >= 0:
        if bool(mask[:, :extra].any()):
            raise ValueError(f"a prompt has more than prompt_width={width} tokens")
        return ids[:, extra:], mask[:, extra:]
    pad = ids.new_full((ids.shape[0], -extra), pad_id)
    return torch.cat([pad, ids], 1), torch.cat([mask.new_zeros(pad.shape), mask], 1)


class _EntropyTap:
    """Calls the model and keeps the entropy [B, L] of its last L positions' logits.

    TRL logs the policy entropy (and may use it for masks or bonuses); reading it off the
    mean-field forward costs no extra pass.
    """

    def __init__(self, model, length: int):
        self.model, self.length, self.entropy = model, length, None

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        logits = out if isinstance(out, Tensor) else out.logits
        with torch.no_grad():
            logp = logits[:, -self.length :].float().log_softmax(-1)
            self.entropy = -(logp.exp() * logp).sum(-1)
        return out


def with_prompt_column(reward_func):
    """``reward_func`` also given the dataset's ``prompt`` column as ``prompt=``.

    TRL passes every column to reward functions but ``prompt``, which comes only as ``prompts``;
    daca's tasks read their columns by name (HumanEval's reward needs ``prompt``).
    """
    if isinstance(reward_func, torch.nn.Module):
        return reward_func
    if is_async_callable(reward_func):

        @functools.wraps(reward_func)
        async def call_async(*args, prompts, **kwargs):
            kwargs.setdefault("prompt", prompts)
            return await reward_func(*args, prompts=prompts, **kwargs)

        return call_async

    @functools.wraps(reward_func)
    def call(*args, prompts, **kwargs):
        kwargs.setdefault("prompt", prompts)
        return reward_func(*args, prompts=prompts, **kwargs)

    return call


@contextlib.contextmanager
def _reference_through_daca():
    """TRL builds the reference policy (``beta > 0`` without PEFT) by loading the policy's path
    again through transformers' Auto classes, which know neither LLaDA's nor Dream's config;
    while the trainer is built, that loader is ``daca.models.load`` (TRL is pinned exactly)."""
    from trl.trainer import grpo_trainer

    original = grpo_trainer.create_model_from_path

    def create_model_from_path(model_id: str, **kwargs):
        if not model_id:
            raise ValueError(
                "beta > 0 without PEFT needs a reference policy, which TRL loads from the "
                "policy's folder; this model was not loaded from one: pass a name or folder, "
                "a daca.models.load result, use PEFT, or set beta=0"
            )
        dtype = kwargs.get("dtype")
        dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
        return load(
            model_id,
            dtype=dtype if isinstance(dtype, torch.dtype) else None,
            quantization_config=kwargs.get("quantization_config"),
        ).model

    grpo_trainer.create_model_from_path = create_model_from_path
    try:
        yield
    finally:
        grpo_trainer.create_model_from_path = original


@contextlib.contextmanager
def _rows_in_order():
    """TRL's generation batch split into micro-batches without shuffling its rows first, as
    ``daca train`` splits its step (with ``method``: each micro-batch's masks are drawn over its
    rows in order, and its rows are those the native micro-batch holds)."""
    from trl.trainer import grpo_trainer

    original = grpo_trainer.shuffle_sequence_dict
    grpo_trainer.shuffle_sequence_dict = lambda batch: batch
    try:
        yield
    finally:
        grpo_trainer.shuffle_sequence_dict = original


class _MethodSteps:
    """What ``DACAGRPOConfig.method`` changes in ``DACAGRPOTrainer`` (a mixin before
    ``GRPOTrainer``): each micro-batch computed as ``daca train`` computes it, through the same
    functions of ``daca.train.update`` (docs/trl.md, "One method, two front-ends")."""

    def _micro_batches(self, n: int) -> list[tuple[int, slice]]:
        """(index, rows) of each micro-batch of a generation batch of ``n`` rows, in order:
        ``per_device_train_batch_size`` rows each in training; in evaluation one, of index -1,
        so that its seeds never repeat a training rollout's."""
        if not self.model.training:
            return [(-1, slice(0, n))]
        size = self.args.per_device_train_batch_size
        return [(m, slice(start, start + size)) for m, start in enumerate(range(0, n, size))]

    def _rollout_step(self) -> int:
        """``daca train``'s step of the running rollout: TRL counts optimizer steps, μ of them
        (``num_iterations``) per rollout."""
        return self.state.global_step // self.num_iterations

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards [every process's rows, reward functions], kept for ``method``."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_per_func = rewards
        return rewards

    def _prepare_inputs(self, generation_batch):
        """TRL's; with ``method``, the micro-batches are the generation batch's rows in order."""
        if self.daca_method is None:
            return super()._prepare_inputs(generation_batch)
        with _rows_in_order():
            return super()._prepare_inputs(generation_batch)

    def _score_for_method(self, inputs):
        """TRL's rollout and rewards, then what ``daca train``'s step computes before its updates
        (``Trainer.train_step``): group advantages with the method's baseline, DPS multipliers
        over the step's micro-batches, and per micro-batch the old and reference log-probs with
        the native mask seeds (``daca.train.update``)."""
        cfg, method = self.daca_cfg, self.daca_method
        self._trl_logp_off = True
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._trl_logp_off = False
        for key in ("old_per_token_logps", "ref_per_token_logps"):
            output.pop(key, None)
        training = self.model.training
        n, rank = len(inputs), self.accelerator.process_index
        # The weighted sum in float64, as daca.tasks.rewards.score_rewards adds it up.
        per_func = self._rewards_per_func.double()
        rewards = (per_func * self.reward_weights.to(per_func)).nansum(1).float()
        G = self.num_generations if training else self.num_generations_eval
        advantages = group_advantages(rewards, G, scale=cfg.scale_rewards, baseline=method.baseline)
        mine = slice(rank * n, (rank + 1) * n)
        output["advantages"], output["daca_rewards"] = advantages[mine], rewards[mine]
        if cfg.dps.enabled:
            mode = "train" if training else "eval"
            output["daca_multipliers"] = torch.cat(self._dps_step(self.last_rollouts, mode))
        mu = self.num_iterations if training and method.ratio else 1
        step, old, ref = self._rollout_step(), [], []
        for m, rows in self._micro_batches(n):
            batch = self._rollout_batch(output, rows)
            seeds = [mask_seed(cfg.seed, step, m, it, rank) for it in range(mu)]
            with disable_gradient_checkpointing(
                self.model, self.args.gradient_checkpointing_kwargs
            ):
                old_and_reference(
                    method, cfg, self.model, self._reference, batch, seeds, self.mask_id
                )
            old.append(batch.old_logp)
            ref.append(batch.ref_logp)
        for key, per_batch in (("daca_old_logp", old), ("daca_ref_logp", ref)):
            if per_batch[0]:  # [B, mu, L]: each row's log-probs travel with it through TRL
                output[key] = torch.cat([torch.stack(logps, 1) for logps in per_batch])
        return output

    def _rollout_batch(self, inputs, rows: slice = slice(None)) -> RolloutBatch:
        """Rows of TRL's batch as the native trainer's micro-batch: the prompts left padded as
        ``daca train`` pads them (to ``prompt_width``, else to these rows' longest), the loss
        mask (tokens up to the first end of sequence) as ``completion_mask``, and the advantages,
        DPS multipliers and per-iteration old and reference log-probs of ``_score_for_method``."""
        prompt_ids, prompt_mask = inputs["prompt_ids"][rows], inputs["prompt_mask"][rows]
        width = self.prompt_width or int(prompt_mask.sum(1).max())
        pad = self._tokenizer.pad_token_id
        prompt_ids, prompt_mask = left_pad(prompt_ids, prompt_mask, width, pad)
        loss_mask = inputs["completion_mask"][rows].bool()
        if "tool_mask" in inputs:
            loss_mask &= inputs["tool_mask"][rows].bool()
        multipliers = inputs.get("daca_multipliers")
        batch = RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=inputs["completion_ids"][rows],
            completion_mask=loss_mask,
            rewards=inputs["daca_rewards"][rows],
            advantages=inputs["advantages"][rows],
            multipliers=None if multipliers is None else multipliers[rows],
        )
        for key in ("old_logp", "ref_logp"):
            if f"daca_{key}" in inputs:
                setattr(batch, key, list(inputs[f"daca_{key}"][rows].unbind(1)))
        return batch

    def _method_loss(self, model, inputs):
        """The micro-batch's loss as ``daca train`` computes it (``daca.train.update``): the
        method's log-probs (with SML) under the native masks of (step, micro-batch, inner
        iteration), then its loss; the loss's metrics go to TRL's log."""
        cfg, method, training = self.daca_cfg, self.daca_method, self.model.training
        micro = self._step % self.args.steps_per_generation if training else -1
        it = self._iteration()
        rank = self.accelerator.process_index
        seed = mask_seed(cfg.seed, self._rollout_step(), micro, it, rank)
        batch = self._rollout_batch(inputs)
        logp, sml = token_logp(method, model, batch, cfg, seed, self.mask_id)
        loss, metrics = method_loss(method, cfg, batch, logp, sml, it)
        mode = "train" if training else "eval"
        for name, value in metrics.items():
            self._metrics[mode][name].append(float(value))
        # TRL's losses come scaled for gradient accumulation (HF's own scaling is off for GRPO).
        return loss / self.current_gradient_accumulation_steps if training else loss


class DACAGRPOTrainer(_MethodSteps, GRPOTrainer):
    """TRL's ``GRPOTrainer`` for masked diffusion LMs with DACA (see the module docstring).

    ``model``: a ``daca.models.load`` result, or a name or path for it ("tiny" is the shipped
    model), which also supplies the tokenizer, mask id, end-of-sequence ids and prompt width;
    or a masked LM module (then pass ``processing_class``). ``args`` must be a
    ``DACAGRPOConfig``. Tools, environments and ``rollout_func`` (TRL features for
    autoregressive models) are refused. ``args.method``: see ``DACAGRPOConfig``.
    """

    def __init__(self, model, reward_funcs=None, args: DACAGRPOConfig | None = None, **kwargs):
        if args is None:
            args = DACAGRPOConfig(output_dir="daca-grpo")
        if not isinstance(args, DACAGRPOConfig):
            raise TypeError(f"args must be a DACAGRPOConfig, got {type(args).__name__}")
        for name in ("tools", "rollout_func", "environment_factory"):
            if kwargs.get(name):
                raise ValueError(f"DACAGRPOTrainer does not support {name}")
        mask_id, prompt_width, self._daca_bundle = args.mask_id, args.prompt_width, None
        if isinstance(model, str):
            model = load(model)
        if isinstance(model, LoadedModel):
            bundle, model = model, model.model
            kwargs.setdefault("processing_class", bundle.tokenizer)
            mask_id = bundle.mask_id if mask_id is None else mask_id
            prompt_width = bundle.prompt_width if prompt_width is None else prompt_width
            eos_ids = list(bundle.eos_ids)
            bundle.prompt_width = prompt_width  # saved checkpoints load back with this width
            self._daca_bundle = bundle
        else:
            tok = kwargs.get("processing_class")
            eos_ids = [] if tok is None or tok.eos_token_id is None else [tok.eos_token_id]
        if getattr(model, "generation_config", None) is None:
            # TRL reads pad and end-of-sequence ids there; masked LMs have no generation config.
            model.generation_config = GenerationConfig(eos_token_id=eos_ids or None)
        with _reference_through_daca():
            super().__init__(model, reward_funcs, args, **kwargs)
        self.reward_funcs = [with_prompt_column(f) for f in self.reward_funcs]
        self.mask_id = self._tokenizer.mask_token_id if mask_id is None else mask_id
        if self.mask_id is None:
            raise ValueError("no mask token id: set DACAGRPOConfig.mask_id")
        self.prompt_width = prompt_width
        device, rank = self.accelerator.device, self.accelerator.process_index
        self._sample_gen = torch.Generator(device=device).manual_seed(args.seed * 7919 + rank)
        self._view_gen = torch.Generator(device=device).manual_seed(args.seed * 7919 + rank + 1)
        self._views: tuple[Tensor, Tensor | None] | None = None  # masks of the running forward
        self._rollout_views: tuple[Tensor, Tensor | None] | None = None
        # With method=: the registry entry and the daca train config it computes with.
        self.daca_method = None if args.method is None else METHODS[args.method]
        self.daca_cfg = None if args.method is None else args.train_config()
        self._trl_logp_off = False  # TRL's old/reference forwards skipped (method=)
        self._rewards_per_func: Tensor | None = None  # every process's, of the latest rollout
        # The latest daca.Rollouts of this process (for inspection): one per micro-batch with
        # method=, else one; last_rollout is the last of them.
        self.last_rollouts: list[Rollout] = []
        self.last_rollout = None

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """TRL's save (a native family's ``save_pretrained`` writes its hub layout), plus the
        ``daca.json`` that ``daca.models.load`` reads (prompt format and width, LoRA base)."""
        super()._save(output_dir, state_dict)
        if self._daca_bundle is not None and self.args.should_save:
            folder = Path(output_dir if output_dir is not None else self.args.output_dir)
            write_meta(self._daca_bundle, folder, self.accelerator.unwrap_model(self.model))

    # ----------------------------------------------------------------- generation
    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        """One completion per prompt from ``daca.generate``: without ``method``, the whole batch
        at once, then the rollout's masks; with it, per micro-batch with the native trainer's
        generator seeds (``RolloutSteps._make_rollout``)."""
        if images is not None or multimodal_fields:
            raise ValueError("DACAGRPOTrainer supports text prompts only")
        args = self.args
        if self.daca_method is None:
            self._seed_generators()
            chunks = [(prompt_ids, self._sample_gen)]
        else:
            device, rank = self.accelerator.device, self.accelerator.process_index
            step = self._rollout_step()
            chunks = [
                (prompt_ids[rows], sampler_generator(device, args.seed, step, m, rank))
                for m, rows in self._micro_batches(len(prompt_ids))
            ]
        sampled = [self._sample(ids, generator) for ids, generator in chunks]
        self.last_rollouts = [rollout for rollout, _ in sampled]
        self.last_rollout = self.last_rollouts[-1]
        if self.daca_method is None:
            iterations = self.num_iterations if self.model.training else 1
            self._rollout_views = mask_views(
                sampled[0][1],
                args.gen_length,
                iterations,
                p_mask_prompt=args.p_mask_prompt,
                num_strata=args.sml_num_strata if args.sml_enabled else None,
                strata=args.sml_strata,
                generator=self._view_gen,
            )
            self._set_views(0)
        # TRL's convention for decoding and length metrics: cut after the first end of sequence.
        completion = torch.cat([rollout.completion_ids for rollout in self.last_rollouts])
        keep = up_to_eos(completion, self.eos_token_ids)
        completion_ids = [c[k].tolist() for c, k in zip(completion.cpu(), keep.cpu(), strict=True)]
        return completion_ids, None

    def _sample(self, prompt_ids: list[list[int]], generator) -> tuple[Rollout, Tensor]:
        """``daca.generate`` on the prompts, left padded to ``prompt_width`` (else to the longest):
        the rollout and the prompts' attention mask."""
        args = self.args
        width = self.prompt_width or max(len(p) for p in prompt_ids)
        ids, att = left_pad(prompt_ids, None, width, self._tokenizer.pad_token_id)
        ids, att = ids.to(self.accelerator.device), att.to(self.accelerator.device)
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            torch.no_grad(),
        ):
            was_training = unwrapped.training
            unwrapped.eval()
            try:
                rollout = generate(
                    unwrapped,
                    ids,
                    att,
                    mask_id=self.mask_id,
                    # The sampler's fields are named as generate's keywords, as daca train's.
                    **dataclasses.asdict(args.section("generation")),
                    generator=generator,
                    dps_stride=args.dps_stride if args.dps_enabled else None,
                    dps_scope=args.dps_scope,
                )
            finally:
                unwrapped.train(was_training)
        return rollout, att

    def _seed_generators(self) -> None:
        """Seed the sampler's and the masks' generators from the step, not carried along: a run
        resumed from a checkpoint draws the rollouts the uninterrupted run drew."""
        parts = (self.args.seed, self.state.global_step, self.model.training)
        rank = self.accelerator.process_index
        for k, gen in enumerate((self._sample_gen, self._view_gen)):
            # A tuple of ints hashes the same in every process and run (no hash randomisation).
            gen.manual_seed(hash((*parts, rank, k)) & (2**63 - 1))

    def _generate(self, prompts):
        """TRL's ``_generate``, then the full completions with the loss mask as ``tool_mask``."""
        out = list(super()._generate(prompts))
        cut = out[1]
        full = torch.cat([rollout.completion_ids for rollout in self.last_rollouts]).tolist()
        out[1] = full
        out[2] = [[1] * len(c) + [0] * (len(f) - len(c)) for c, f in zip(cut, full, strict=True)]
        return tuple(out)

    def _generate_and_score_completions(self, inputs):
        """TRL's rollout and scoring, then DPS and the other inner iterations' log-probs."""
        if self.daca_method is not None:
            return self._score_for_method(inputs)
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        if self.args.dps_enabled:
            multipliers = self._dps_multipliers(self.last_rollout, mode)
            output["advantages"] = output["advantages"][:, None] * multipliers
        hide, strata = self._rollout_views
        output["daca_prompt_hide"] = hide
        if strata is not None:
            output["daca_strata"] = strata
        # Old and reference log-probs: TRL computed iteration 0's; add the others' (own masks).
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], 1)
        att = torch.cat([output["prompt_mask"], output["completion_mask"]], 1)
        L, size = output["completion_ids"].shape[1], self.args.per_device_train_batch_size
        for key, context in (
            ("old_per_token_logps", self._policy),
            ("ref_per_token_logps", self._reference),
        ):
            if key not in output:
                continue
            per_iteration = [output.pop(key)]
            for k in range(1, hide.shape[1]):
                self._set_views(k)
                with (
                    torch.no_grad(),
                    disable_gradient_checkpointing(
                        self.model, self.args.gradient_checkpointing_kwargs
                    ),
                    context() as model,
                ):
                    logp, _, _ = self._get_per_token_logps_and_entropies(model, ids, att, L, size)
                per_iteration.append(logp)
            output[f"daca_{key}"] = torch.stack(per_iteration, 1)  # [B, mu, L]
        self._views = None
        return output

    def _dps_multipliers(self, rollout, mode: str) -> Tensor:
        """(1 + lam * delta_{J(n)}) [B, L] of the generation batch (``dps.step_multipliers``, as
        in ``daca train``): delta z-scored over every process's rows of it, which with
        ``steps_per_generation = gradient_accumulation_steps`` are the optimizer step's."""
        return self._dps_step([rollout], mode)[0]

    def _dps_step(self, rollouts: list[Rollout], mode: str) -> list[Tensor]:
        """The multipliers of each rollout of the optimizer step, z-scored over all of them
        (``daca train``'s ``_dps_step``); the ``dps/*`` metrics go to TRL's log."""
        a = self.args
        multipliers, _, metrics = step_multipliers(
            rollouts,
            lam=a.dps_lam,
            last_step=a.dps_last_step,
            norm_axis=a.dps_norm_axis,
            clamp_min=a.dps_clamp_min,
            gather=self.accelerator.gather if self.accelerator.num_processes > 1 else None,
            rank=self.accelerator.process_index,
        )
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)
        return multipliers

    # ----------------------------------------------------------------- likelihood
    @contextlib.contextmanager
    def _policy(self):
        yield self.model

    @contextlib.contextmanager
    def _reference(self):
        """TRL's reference: its frozen copy, or the adapter-free (or "ref" adapter) PEFT model."""
        if self.ref_model is not None:
            yield self.ref_model
            return
        model = self.accelerator.unwrap_model(self.model)
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            yield self.model

    def _set_views(self, k: int) -> None:
        hide, strata = self._rollout_views
        self._views = (hide[:, k], None if strata is None else strata[:, k])

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """ℓ^MF or ½(ℓ^MF + ℓ^SML) [B, L] with the current views' masks (METHOD.md §3, §4).

        Same inputs as TRL's (prompt ++ completion, left-padded prompt); the completion is
        always attended (the attention mask's completion part is ignored). Entropies are those
        of the mean-field view's distributions; no auxiliary loss.
        """
        if any(v is not None for v in multimodal.values()):
            raise ValueError("DACAGRPOTrainer supports text inputs only")
        if self._trl_logp_off:  # method=: TRL's old and reference log-probs, never read
            return (
                input_ids.new_zeros((len(input_ids), logits_to_keep), dtype=torch.float),
                None,
                None,
            )
        if self._views is None:
            raise RuntimeError("no likelihood masks are set for this forward")
        hide, strata = self._views
        if hide.shape[0] != input_ids.shape[0]:
            raise RuntimeError(f"masks for {hide.shape[0]} rows, inputs of {input_ids.shape[0]}")
        L = logits_to_keep
        prompt_ids, prompt_mask = input_ids[:, :-L], attention_mask[:, :-L]
        if self.prompt_width is not None:
            pad = self._tokenizer.pad_token_id
            prompt_ids, prompt_mask = left_pad(prompt_ids, prompt_mask, self.prompt_width, pad)
        completion_ids = input_ids[:, -L:]
        size = batch_size or input_ids.shape[0]
        logps, entropies = [], []
        for s in range(0, input_ids.shape[0], size):
            rows = slice(s, s + size)
            p_ids, p_mask, c_ids = prompt_ids[rows], prompt_mask[rows], completion_ids[rows]
            tap = _EntropyTap(model, L) if compute_entropy else None
            with self.accelerator.autocast():
                logp = mean_field_logp(
                    tap or model,
                    p_ids,
                    c_ids,
                    mask_id=self.mask_id,
                    attention_mask=p_mask,
                    prompt_hide=hide[rows],
                )
                if strata is not None:
                    sml = stratified_logp(
                        model,
                        p_ids,
                        c_ids,
                        mask_id=self.mask_id,
                        num_strata=self.args.sml_num_strata,
                        strata=strata[rows],
                        attention_mask=p_mask,
                    )
                    logp = sml_enriched(logp, sml)
            logps.append(logp)
            if tap is not None:
                entropies.append(tap.entropy)
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    # ----------------------------------------------------------------- loss
    def _iteration(self) -> int:
        """The inner iteration (0 .. mu-1) of the running micro-batch, from TRL's step counter."""
        if not self.model.training:
            return 0
        spg = self.args.steps_per_generation
        return (self._step % (spg * self.num_iterations)) // spg

    def _compute_loss(self, model, inputs):
        """TRL's loss, with iteration k's masks for the current, old and reference log-probs
        (with ``method``, the method's loss: ``_method_loss``)."""
        if self.daca_method is not None:
            return self._method_loss(model, inputs)
        k = self._iteration() if inputs["daca_prompt_hide"].shape[1] > 1 else 0
        strata = inputs.get("daca_strata")
        self._views = (inputs["daca_prompt_hide"][:, k], None if strata is None else strata[:, k])
        inputs = dict(inputs)
        for key in ("old_per_token_logps", "ref_per_token_logps"):
            if f"daca_{key}" in inputs:
                inputs[key] = inputs[f"daca_{key}"][:, k]
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._views = None


__all__ = [
    "DACAGRPOConfig",
    "DACAGRPOTrainer",
    "left_pad",
    "mask_views",
]
