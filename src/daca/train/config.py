"""Training configuration: typed dataclasses with documented fields, YAML recipes, dotted
overrides (``dps.lam=0.5``) and validation that names the bad key before any model loads."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from daca.core import options
from daca.shipped import SHIPPED, tiny_for_task
from daca.train.methods import METHODS, MethodName


def _f(default, help: str, **kw):
    """A dataclass field carrying its documentation (shown by ``daca train --help-config``)."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


REWARD_TIMEOUT = 600.0  # seconds per batch of scoring, in training and in `daca eval`


@dataclass
class GenerationConfig:
    """The sampler (METHOD.md §1)."""

    gen_length: int = _f(16, "completion length L in tokens")
    steps: int = _f(8, "denoising steps T over the whole completion")
    block_length: int = _f(16, "semi-autoregressive block length; divides gen_length")
    temperature: float = _f(0.9, "Gumbel temperature for training rollouts (evaluation uses 0)")
    cfg_scale: float = _f(0.0, "classifier-free guidance scale (0 = off)")
    remasking: Literal[options.REMASKING] = _f("low_confidence", "commit order")
    cache: Literal[options.CACHES] = _f(
        "none", "block KV cache of the rollouts, refreshed at every recorded DPS step (rollouts.md)"
    )
    refresh_every: int | None = _f(
        None, "with a cache, also refresh it at every n-th step of a block (docs/rollouts.md)"
    )
    trace_refresh: Literal[options.TRACE_REFRESHES] = _f(
        "full", "with a cache, a recorded DPS step runs a full forward, or only block + suffix"
    )
    parallel_threshold: float | None = _f(
        None, "commit every masked block position more confident than this (docs/rollouts.md)"
    )


@dataclass
class DPSConfig:
    """Denoising Progress Scores (METHOD.md §2)."""

    enabled: bool = _f(True, "modulate each token's advantage by the progress of its birth step")
    lam: float = _f(0.5, "strength λ of the multiplier 1 + λ·δ̄")
    stride: int = _f(4, "record the trace every s steps (r_j = j·s)")
    last_step: Literal[options.LAST_STEP_MODES] = _f("extrapolate", "δ of the last interval")
    norm_axis: Literal[options.NORM_AXES] = _f("per_step", "axis over which δ is z-scored")
    scope: Literal[options.DPS_SCOPES] = _f("all", "trace every masked position, or the block only")
    clamp_min: float | None = _f(None, "lower clamp of the multiplier (0 keeps advantage signs)")
    center: Literal[options.CENTERS] = _f(
        "none",
        "'sequence': shift each completion's multipliers to a mean of 1, so DPS moves credit "
        "within a completion and leaves its total advantage as it was (METHOD.md §2)",
    )
    credit: Literal[options.CREDITS] = _f(
        "progress",
        "multipliers from the progress δ̄ (DPS), or 'oracle': the control that scales by ground "
        "truth with DPS's mean and spread (trace tasks; METHOD.md §2)",
    )


@dataclass
class SMLConfig:
    """Stratified Masking Likelihood (METHOD.md §3, §4)."""

    enabled: bool = _f(False, "use the stratified likelihood")
    num_strata: int = _f(4, "K strata; each token sees (K-1)/K of the completion")
    strata: Literal[options.STRATA] = _f("random", "how strata are cut")
    eta: float = _f(0.01, "wd1 only: weight η of the SML likelihood term (METHOD.md §4)")
    anneal_steps: int = _f(
        0,
        "annealed SML: K falls from num_strata to 1 in K equal phases over this many training "
        "steps, so each token's visible context decays from (K-1)/K to none (0: K fixed; "
        "METHOD.md §3)",
    )


@dataclass
class LoRAConfig:
    """PEFT LoRA (the paper: r 128, α 64, dropout 0.05 on all attention and MLP projections)."""

    enabled: bool = _f(False, "train a LoRA adapter instead of all weights")
    r: int = _f(128, "rank")
    alpha: int = _f(64, "scaling α")
    dropout: float = _f(0.05, "adapter dropout")
    target_modules: list[str] | None = _f(None, "module names; None = the family's default")


# The ablation grid's variants: (dps.enabled, sml.enabled).
VARIANT_SWITCHES = {
    "base": (False, False),
    "dps": (True, False),
    "sml": (False, True),
    "daca": (True, True),
}


@dataclass
class TrainConfig:
    """One RL run. Field names follow the reference codes (d1, TRL) where they exist."""

    name: str | None = _f(
        None,
        "run name: outputs go to output_dir/name; null: <model>-<task>-<method>-<variant> of the "
        "run's own settings (e.g. tiny-sudoku-wd1-dps)",
    )
    output_dir: str = _f("runs", "folder holding the run folders")
    model: str = _f(
        "tiny",
        "model: 'tiny' (the shipped model of the task: 'tiny' for Sudoku, 'tiny-countdown' "
        "for Countdown, 'tiny-sudoku-trace' for sudoku-trace), a local folder, or a hub name",
    )
    task: str = _f("sudoku", "task name (daca.tasks.get_task)")
    data_file: str | None = _f(None, "training data file (else the task generates or downloads)")
    eval_file: str | None = _f(None, "held-out data file (else the task's test split)")
    method: MethodName = _f("wd1", "base method (daca.train.methods.METHODS; METHOD.md §4, §6)")
    published_settings: bool = _f(
        False,
        "take the method's published settings (its reference code's learning rate, β, μ: "
        "daca.train.methods) over the recipe's, unless given on the command line",
    )
    variant: Literal[tuple(VARIANT_SWITCHES)] | None = _f(
        None, "the ablation grid's switch: sets dps.enabled and sml.enabled together"
    )
    # The tiny default decodes in 8 steps: stride 2 gives 4 intervals (the paper's 4 is for T=128).
    dps: DPSConfig = field(default_factory=lambda: DPSConfig(stride=2))
    sml: SMLConfig = field(default_factory=SMLConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    num_generations: int = _f(6, "G: completions per prompt")
    per_device_train_batch_size: int = _f(96, "completions per process per step (multiple of G)")
    num_iterations: int = _f(
        1,
        "μ: policy updates per rollout, each with a fresh mask seed (every method; the reference "
        "codes use 12, 8 for Sudoku)",
    )
    beta: float | None = _f(
        None,
        "KL weight against the reference; None: the method's (Diffu-GRPO 0.04, coupled-GRPO "
        "0.01, else 0)",
    )
    epsilon: float = _f(0.5, "PPO clip ε")
    p_mask_prompt: float = _f(0.15, "prompt masking probability of the mean-field estimate")
    scale_rewards: Literal[options.REWARD_SCALES] = _f("none", "divide advantages by the group std")
    psi: float = _f(1.0, "wd1 weight temperature ψ")
    quadrature: str = _f("gauss-3", "GDPO ELBO quadrature")
    gdpo_reduction: Literal[options.GDPO_REDUCTIONS] = _f(
        "sequence",
        "GDPO: 'sequence' = the reference code's (⌊t·L⌋ of all L positions masked, padding "
        "included; ratio exp(ΔELBO / L); sequence mean; KL on the raw ELBO), 'token' = over the "
        "N real tokens (METHOD.md §4)",
    )
    learning_rate: float = _f(3e-5, "AdamW learning rate (the tiny default; 1e-4 collapses it)")
    weight_decay: float = _f(0.1, "AdamW weight decay")
    adam_beta1: float = _f(0.9, "AdamW β1")
    adam_beta2: float = _f(0.99, "AdamW β2")
    warmup_steps: int = _f(0, "linear warm-up steps, then constant")
    gradient_accumulation_steps: int = _f(1, "rollout batches per optimizer step")
    max_grad_norm: float = _f(0.2, "gradient-norm clip")
    max_steps: int = _f(300, "optimizer steps")
    seed: int = _f(0, "seed of data order, rollouts and masks")
    train_size: int = _f(2000, "training prompts to generate (tasks that generate data)")
    eval_every: int = _f(100, "held-out evaluation every N steps (0 = only before and after)")
    eval_size: int = _f(200, "held-out prompts")
    eval_batch_size: int = _f(100, "prompts per held-out generation batch")
    save_every: int = _f(100, "checkpoint every N steps (and at the end)")
    save_total_limit: int = _f(2, "checkpoints kept")
    log_every: int = _f(1, "metrics line every N steps")
    save_rollouts_every: int = _f(
        50, "record the first group's rollout for `daca inspect` (0: never)"
    )
    tensorboard: bool = _f(True, "write TensorBoard logs")
    wandb: bool = _f(False, "log to Weights & Biases")
    on_reward_error: Literal["raise", "zero"] = _f(
        "raise",
        "a reward function that raises (a bug; a completion that breaks a parser always scores 0)"
        ": stop the run, or score the example 0",
    )
    on_reward_timeout: Literal["zero", "raise"] = _f(
        "zero", "an example a reward function is stopped on (reward_timeout): score 0, or stop"
    )
    sandbox: Literal["bwrap", "unsafe"] = _f(
        "bwrap",
        "model-written code (MBPP, HumanEval) runs only inside bubblewrap ('bwrap'; refused "
        "without it), or also in a plain subprocess where bubblewrap fails ('unsafe': the code "
        "can then touch your files; same as DACA_UNSAFE_EXEC=1)",
    )
    reward_timeout: float | None = _f(
        REWARD_TIMEOUT,
        "seconds the reward functions together may take on one batch; a completion unfinished "
        "then is scored alone with what is left (at least 1 s), or scores 0 (null: no limit)",
    )
    max_nonfinite_steps: int = _f(
        3, "a step with a non-finite loss or gradient is skipped; this many in a row stop the run"
    )
    truncate_prompts: bool = _f(
        False, "keep the last tokens of prompts longer than the model reads (else an error)"
    )
    gradient_checkpointing: bool = _f(False, "trade compute for activation memory")
    bf16: bool = _f(False, "bf16 weights and compute (GPU)")
    load_in_4bit: bool = _f(False, "QLoRA: 4-bit NF4 base weights (bitsandbytes: GPU or CPU)")
    device: str = _f("auto", "'auto', 'cpu' or 'cuda' (accelerate decides under launch)")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and says why."""


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _check_value(key: str, tp, value):
    """Return ``value`` converted to ``tp`` or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_value(key, arg, value)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if origin is Literal:
        try:
            options.check_mode(key, value, args)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return value
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_check_value(f"{key}[{i}]", args[0], v) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")


def from_dict(cls, data: dict[str, Any], prefix: str = "", default=None):
    """``default`` (an instance of dataclass ``cls``, else ``cls()``) with the fields in nested
    ``data`` replaced, rejecting unknown keys and wrong types. A section given in part keeps
    the default's other fields."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    default = cls() if default is None else default
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in hints:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{prefix}{near[0]}'?" if near else ""
            raise ConfigError(f"unknown key {full!r}{hint}")
        tp = hints[key]
        if _is_dataclass_type(tp):
            kwargs[key] = from_dict(tp, value, f"{full}.", getattr(default, key))
        else:
            kwargs[key] = _check_value(full, tp, value)
    return dataclasses.replace(default, **kwargs)


def to_dict(cfg) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"dps.lam=0.5"`` -> (["dps", "lam"], 0.5); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value (e.g. dps.lam=0.5)")
    key, raw = text.split("=", 1)
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: cannot read value: {e}") from None
    return key.split("."), value


def merge_override(data: dict, path: list[str], value) -> None:
    node = data
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(path)}: {part!r} is not a section")
        node = child
    node[path[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """The default config, or a YAML recipe, with dotted overrides applied, validated."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of keys to values")
    parsed = [parse_override(text) for text in overrides]
    for path_, value in parsed:
        merge_override(data, path_, value)
    given = {".".join(path_) for path_, _ in parsed}
    method = data.get("method", TrainConfig.method)
    if data.get("published_settings") is True and isinstance(method, str) and method in METHODS:
        for key, value in METHODS[method].published.items():
            if key not in given:  # the command line wins over the method's published value
                data[key] = value
    _model_lengths(data)
    cfg = resolved(from_dict(TrainConfig, data))
    validate(cfg)
    return cfg


# The generation fields a model folder was trained for (its daca.json ``generation``).
_MODEL_LENGTHS = ("gen_length", "steps", "block_length")


def _model_lengths(data: dict) -> None:
    """A model folder written by daca (a shipped tiny model, ``model: tiny``, or a run's saved
    checkpoint) brings the completion length, steps and block it was trained for
    (the trace tasks': L 64 in two blocks of 32) as the run's defaults, as ``daca eval`` reads
    them; what the recipe or the command line sets wins."""
    model, task = data.get("model", "tiny"), data.get("task", "sudoku")
    if not (isinstance(model, str) and isinstance(task, str)):
        return  # a wrong type: reported with its key by from_dict
    name = tiny_for_task(model, task)
    meta_file = (SHIPPED[name] if name in SHIPPED else Path(name)) / "daca.json"
    section = data.get("generation", {})
    if not meta_file.is_file() or not isinstance(section, dict):
        return
    try:  # not models.loading.read_meta: that module imports torch, which `--help` must not
        trained = json.loads(meta_file.read_text()).get("generation", {})
    except (OSError, ValueError, AttributeError):
        return  # a bad daca.json is reported, with its path, when the model loads
    if not isinstance(trained, dict):
        return
    section = data.setdefault("generation", section)
    for key in _MODEL_LENGTHS:
        if isinstance(trained.get(key), int):
            section.setdefault(key, trained[key])


def variant_label(cfg: TrainConfig) -> str:
    """The ablation grid's name of the run's DPS/SML switches: base, dps, sml or daca."""
    switches = (cfg.dps.enabled, cfg.sml.enabled)
    return next(name for name, on in VARIANT_SWITCHES.items() if on == switches)


def default_name(cfg: TrainConfig) -> str:
    """<model>-<task>-<method>-<variant>: the model's folder or hub name up to its first dash,
    lower-cased (``GSAI-ML/LLaDA-8B-Instruct`` -> llada, the shipped models -> tiny)."""
    model = Path(str(cfg.model).rstrip("/")).name.lower().split("-")[0] or "model"
    return f"{model}-{cfg.task}-{cfg.method}-{variant_label(cfg)}"


def published_differences(cfg: TrainConfig) -> list[str]:
    """``key=value (published: v)`` for each of the method's published settings the run
    does not use (``daca train --dry-run`` prints them)."""
    return [
        f"{key}={getattr(cfg, key)} (published: {value})"
        for key, value in METHODS[cfg.method].published.items()
        if getattr(cfg, key) != value
    ]


def resolved(cfg: TrainConfig) -> TrainConfig:
    """Fill the fields left to the task, the method or the variant (``model``, ``beta``,
    DPS/SML switches, and the run's ``name`` from them)."""
    cfg = dataclasses.replace(cfg, model=tiny_for_task(cfg.model, cfg.task))
    if cfg.beta is None:
        cfg = dataclasses.replace(cfg, beta=METHODS[cfg.method].beta)
    if cfg.variant is not None:
        dps_on, sml_on = VARIANT_SWITCHES[cfg.variant]
        cfg = dataclasses.replace(
            cfg,
            dps=dataclasses.replace(cfg.dps, enabled=dps_on),
            sml=dataclasses.replace(cfg.sml, enabled=sml_on),
        )
    if cfg.name is None:
        cfg = dataclasses.replace(cfg, name=default_name(cfg))
        _need(
            _is_folder_name(cfg.name),
            f"name {cfg.name!r} (made from model, task, method and variant) is not a folder "
            "name; give name=NAME",
        )
    return cfg


def _is_folder_name(name: str) -> bool:
    return "/" not in name and name not in ("", ".", "..")


def _dotted(section: str, name: str) -> str:
    return f"{section}.{name}"


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


# The sampler's arguments (daca.core.options.check_sampler) as the config's (section, field).
SAMPLER_FIELDS = {
    **{f.name: ("generation", f.name) for f in dataclasses.fields(GenerationConfig)},
    "dps_stride": ("dps", "stride"),
    "dps_scope": ("dps", "scope"),
    "num_strata": ("sml", "num_strata"),
    "anneal_steps": ("sml", "anneal_steps"),
}


def check_sampling(
    g: GenerationConfig,
    dps: DPSConfig,
    sml: SMLConfig,
    key: typing.Callable[[str, str], str] = _dotted,
) -> None:
    """Contradictions within the sampler, DPS and SML sections: the core's rules
    (``daca.core.options``), each named with the fix; ``key(section, field)`` spells a field's
    name (``generation.gen_length`` here, the flat ``gen_length`` / ``dps_stride`` of
    ``DACAGRPOConfig``). A ConfigError."""

    def name(argument: str) -> str:
        return key(*SAMPLER_FIELDS[argument])

    try:
        options.check_sampler(
            **{f.name: getattr(g, f.name) for f in dataclasses.fields(g)},
            dps_stride=dps.stride,
            dps_scope=dps.scope,
            traced=dps.enabled,
            key=name,
        )
        options.check_num_strata(sml.num_strata, g.gen_length, key=name)
        options.check_anneal_steps(sml.anneal_steps, key=name)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def validate(cfg: TrainConfig, world_size: int = 1) -> None:
    """Contradictions between fields, each named with the fix."""
    need = _need
    check_sampling(cfg.generation, cfg.dps, cfg.sml)
    need(cfg.num_generations >= 2, f"num_generations={cfg.num_generations}: a group needs >= 2")
    need(
        cfg.per_device_train_batch_size > 0
        and cfg.per_device_train_batch_size % cfg.num_generations == 0,
        f"per_device_train_batch_size={cfg.per_device_train_batch_size} is not a multiple of "
        f"num_generations={cfg.num_generations}",
    )
    need(cfg.num_iterations >= 1, f"num_iterations must be >= 1, got {cfg.num_iterations}")
    need(cfg.beta is None or cfg.beta >= 0, f"beta must be >= 0, got {cfg.beta}")
    need(0 < cfg.epsilon < 1, f"epsilon must be in (0, 1), got {cfg.epsilon}")
    need(0 <= cfg.p_mask_prompt < 1, f"p_mask_prompt must be in [0, 1), got {cfg.p_mask_prompt}")
    need(cfg.learning_rate > 0, f"learning_rate must be positive, got {cfg.learning_rate}")
    need(cfg.max_steps >= 1, f"max_steps must be >= 1, got {cfg.max_steps}")
    need(cfg.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1")
    need(cfg.max_grad_norm > 0, f"max_grad_norm must be positive, got {cfg.max_grad_norm}")
    need(cfg.eval_size >= 1 and cfg.eval_batch_size >= 1, "eval_size and eval_batch_size >= 1")
    need(cfg.save_every >= 1 and cfg.save_total_limit >= 1, "save_every, save_total_limit >= 1")
    need(cfg.eval_every >= 0, "eval_every must be >= 0")
    need(cfg.quadrature.startswith("gauss-"), f"quadrature {cfg.quadrature!r}: use 'gauss-N'")
    need(not cfg.load_in_4bit or cfg.lora.enabled, "load_in_4bit needs lora.enabled: true")
    need(
        cfg.reward_timeout is None or cfg.reward_timeout > 0,
        f"reward_timeout must be positive (or null for no limit), got {cfg.reward_timeout}",
    )
    need(
        cfg.max_nonfinite_steps >= 1,
        f"max_nonfinite_steps must be >= 1, got {cfg.max_nonfinite_steps}",
    )
    need(world_size >= 1, "world size must be >= 1")
    need(
        cfg.dps.credit == "progress" or cfg.dps.enabled,
        "dps.credit=oracle replaces DPS's multipliers: it needs dps.enabled: true",
    )
    need(
        cfg.name is None or _is_folder_name(cfg.name),
        f"name {cfg.name!r}: a folder name",
    )


def describe(obj=None, prefix: str = "") -> list[str]:
    """One line per field: key, default and help (``daca train --help-config``)."""
    obj = TrainConfig() if obj is None else obj
    lines = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            lines += describe(value, f"{prefix}{f.name}.")
            continue
        lines.append(f"{prefix}{f.name} = {value!r}  # {f.metadata.get('help', '')}")
    return lines
