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

TRL internals overridden (private, hence the exact pin ``trl==1.16.0``):
``_generate_single_turn`` (the sampler), ``_generate`` (full completions and the loss mask),
``_generate_and_score_completions`` (DPS, per-iteration old/reference log-probs),
``_get_per_token_logps_and_entropies`` (the estimators), ``_compute_loss`` (selects the
inner iteration's masks, then runs TRL's own loss unchanged) and ``_save`` (``daca.json``).

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
from daca.core.objectives import sml_enriched
from daca.core.sampler import generate
from daca.models.loading import LoadedModel, load, write_meta
from daca.models.prompts import left_pad as left_pad_lists
from daca.models.prompts import up_to_eos
from daca.train.config import DPSConfig, GenerationConfig, SMLConfig, check_sampling, from_dict

TRL_VERSION = "1.16.0"
if trl.__version__ != TRL_VERSION:
    raise ImportError(
        f"daca.integrations.trl overrides private methods of TRL {TRL_VERSION}; found TRL "
        f"{trl.__version__}. Install the pinned version: pip install 'daca-grpo[trl]'"
    )


def _f(default, help: str):
    return field(default=default, metadata={"help": help})


# The config sections whose fields DACAGRPOConfig carries, flat, under a prefix: the sampler's
# under their own names, DPS's and SML's as dps_* and sml_* (SML's wd1-only eta: no wd1 here).
SECTIONS = {
    "generation": ("", GenerationConfig),
    "dps": ("dps_", DPSConfig),
    "sml": ("sml_", SMLConfig),
}
_LEFT_OUT = {("sml", "eta")}


def _flat_name(section: str, name: str) -> str:
    return SECTIONS[section][0] + name


def _with_sections(cls):
    """Add every field of ``SECTIONS`` to ``cls`` (before ``@dataclass``): name, type, default and
    help from the section's dataclass, so that there is one source of truth for them."""
    for section, (prefix, source) in SECTIONS.items():
        hints = typing.get_type_hints(source)
        for f in dataclasses.fields(source):
            if (section, f.name) in _LEFT_OUT:
                continue
            cls.__annotations__[prefix + f.name] = hints[f.name]
            setattr(cls, prefix + f.name, field(default=f.default, metadata=dict(f.metadata)))
    return cls


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
    ``DPSConfig`` and ``SMLConfig`` (defaults, help and validation), flattened. Unset
    ``mask_id`` / ``prompt_width`` are read from the model loaded by ``daca.models.load`` (when
    the trainer is given a name or path) or the tokenizer.
    """

    mask_id: int | None = _f(None, "mask token id (None: the loaded model's or the tokenizer's)")
    prompt_width: int | None = _f(
        None, "left pad every prompt to exactly this width (models with absolute positions)"
    )
    p_mask_prompt: float = _f(0.15, "prompt masking probability of the mean-field estimate")

    def section(self, name: str):
        """The ``daca.train.config`` dataclass of section ``name`` ("generation", "dps", "sml")
        with this config's values, type-checked (a ConfigError names the flat field)."""
        prefix, source = SECTIONS[name]
        values = {
            f.name: getattr(self, prefix + f.name)
            for f in dataclasses.fields(source)
            if (name, f.name) not in _LEFT_OUT
        }
        return from_dict(source, values, prefix)

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


class DACAGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` for masked diffusion LMs with DACA (see the module docstring).

    ``model``: a ``daca.models.load`` result, or a name or path for it ("tiny" is the shipped
    model), which also supplies the tokenizer, mask id, end-of-sequence ids and prompt width;
    or a masked LM module (then pass ``processing_class``). ``args`` must be a
    ``DACAGRPOConfig``. Tools, environments and ``rollout_func`` (TRL features for
    autoregressive models) are refused.
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
        self.last_rollout = None  # the latest daca.Rollout of this process (for inspection)

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
        """One completion per prompt from ``daca.generate``; draws the rollout's masks."""
        if images is not None or multimodal_fields:
            raise ValueError("DACAGRPOTrainer supports text prompts only")
        args = self.args
        self._seed_generators()
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
                    gen_length=args.gen_length,
                    steps=args.steps,
                    block_length=args.block_length,
                    temperature=args.temperature,
                    cfg_scale=args.cfg_scale,
                    remasking=args.remasking,
                    generator=self._sample_gen,
                    dps_stride=args.dps_stride if args.dps_enabled else None,
                    dps_scope=args.dps_scope,
                    cache=args.cache,
                    parallel_threshold=args.parallel_threshold,
                )
            finally:
                unwrapped.train(was_training)
        self.last_rollout = rollout
        iterations = self.num_iterations if self.model.training else 1
        self._rollout_views = mask_views(
            att,
            args.gen_length,
            iterations,
            p_mask_prompt=args.p_mask_prompt,
            num_strata=args.sml_num_strata if args.sml_enabled else None,
            strata=args.sml_strata,
            generator=self._view_gen,
        )
        self._set_views(0)
        # TRL's convention for decoding and length metrics: cut after the first end of sequence.
        completion = rollout.completion_ids
        keep = up_to_eos(completion, self.eos_token_ids)
        completion_ids = [c[k].tolist() for c, k in zip(completion.cpu(), keep.cpu(), strict=True)]
        return completion_ids, None

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
        full = self.last_rollout.completion_ids.tolist()
        out[1] = full
        out[2] = [[1] * len(c) + [0] * (len(f) - len(c)) for c, f in zip(cut, full, strict=True)]
        return tuple(out)

    def _generate_and_score_completions(self, inputs):
        """TRL's rollout and scoring, then DPS and the other inner iterations' log-probs."""
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
        a = self.args
        (mult,), _, metrics = step_multipliers(
            [rollout],
            lam=a.dps_lam,
            last_step=a.dps_last_step,
            norm_axis=a.dps_norm_axis,
            clamp_min=a.dps_clamp_min,
            gather=self.accelerator.gather if self.accelerator.num_processes > 1 else None,
            rank=self.accelerator.process_index,
        )
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)
        return mult

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
        """TRL's loss, with iteration k's masks for the current, old and reference log-probs."""
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
