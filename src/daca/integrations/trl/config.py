"""``DACAGRPOConfig``: TRL's ``GRPOConfig`` plus the base method and the sections of
``daca.train.config`` (the sampler, DPS, SML) flattened, with ``daca train``'s defaults, help and
validation, and ``train_config()``, the ``daca train`` config the TRL front-end computes with."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from trl import GRPOConfig

from daca.train.config import (
    DPSConfig,
    GenerationConfig,
    SMLConfig,
    TrainConfig,
    check_sampling,
    from_dict,
    validate,
)
from daca.train.methods import METHODS


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
# TrainConfig's fields that ``DACAGRPOConfig.train_config`` takes from this config (TRL's own
# fields of the same name and meaning, and TOP_LEVEL's); the sections come from SECTIONS.
TRAIN_FIELDS = (
    *("method", "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps"),
    *("num_iterations", "beta", "epsilon", "scale_rewards", "seed", *TOP_LEVEL),
)
# TRL's options of its own loss and advantages: the method's replace them, so a value other
# than TRL's default would silently not apply.
TRL_LOSS_OPTIONS = (
    *("loss_type", "epsilon_high", "delta", "importance_sampling_level", "top_entropy_quantile"),
    *("entropy_coef", "use_adaptive_entropy", "off_policy_mask_threshold"),
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
    """``GRPOConfig`` plus the base method, the masked-diffusion sampler and DACA's switches.

    ``method`` (required): a name of ``daca.train.methods.METHODS``, computed as ``daca train``
    computes it with ``train_config()``'s values. TRL's fields keep their meaning
    (``temperature`` is the sampler's Gumbel temperature, default 0.9; ``max_completion_length``
    is set to ``gen_length``). The sections of ``daca.train.config`` (``SECTIONS``: the
    sampler's fields by name, ``dps_*``, ``sml_*``) and ``TOP_LEVEL``'s fields come flattened,
    with their defaults, help and validation (docs/trl.md, "DACA fields"). Unset ``mask_id`` /
    ``prompt_width`` are read from the model ``daca.models.load`` loaded, or the tokenizer.
    """

    mask_id: int | None = _f(None, "mask token id (None: the loaded model's or the tokenizer's)")
    prompt_width: int | None = _f(
        None, "left pad every prompt to exactly this width (models with absolute positions)"
    )
    method: str | None = _f(
        None,
        "a base method of daca.train.methods.METHODS (required): its estimator, advantages and "
        "loss, as `daca train` computes them (docs/trl.md)",
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
        cfg = from_dict(TrainConfig, {name: getattr(self, name) for name in TRAIN_FIELDS})
        cfg = dataclasses.replace(cfg, **{name: self.section(name) for name in SECTIONS})
        validate(cfg)
        return cfg

    def _check_method(self) -> None:
        """``method``: given, a registered name (``train_config()``), and no TRL option left
        unread for it."""
        if self.method is None:
            raise ValueError(
                f"DACAGRPOConfig needs method=, one of {sorted(METHODS)}: TRL's own loss "
                "(method=None) is retired; docs/trl.md, 'Migrating from method=None', names the "
                "method and settings that replace it"
            )
        self.train_config()  # the method's name first: a ConfigError names the nearest
        trl_defaults = _defaults(GRPOConfig)
        replaced = [n for n in TRL_LOSS_OPTIONS if getattr(self, n) != trl_defaults[n]]
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

    def __post_init__(self):
        super().__post_init__()
        check_sampling(*(self.section(n) for n in SECTIONS), key=_flat_name)
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
        if self.dps_credit != "progress":
            # The control needs each completion's task row (its solution) beside its tokens.
            raise ValueError(
                f"dps_credit={self.dps_credit!r} is a control of `daca train` (docs/results.md); "
                "the TRL front-end trains with DPS's own credit: leave dps_credit='progress'"
            )
        self._check_method()
        self.max_completion_length = self.gen_length
