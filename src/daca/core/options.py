"""The options of the core functions, each written once: the modes of every switch, and the rules
between the sampler's arguments. The core functions check their arguments here; the
configuration (``daca.train.config``) takes its types, its errors and ``daca compare``'s ablation
loops from the same lists and rules, naming its own keys. No torch: the configuration, and so
``daca --help``, reads this module without importing it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence

# The sampler (METHOD.md §1; the cache and its refresh: docs/rollouts.md).
REMASKING = ("low_confidence", "random")
CACHES = ("none", "prefix", "dual")
TRACE_REFRESHES = ("full", "suffix")
# DPS (METHOD.md §2): the positions a recorded step traces, δ of the last interval, the axis of
# the z-score.
DPS_SCOPES = ("all", "block")
LAST_STEP_MODES = ("extrapolate", "neutral", "raw", "mean", "measured")
NORM_AXES = ("per_step", "trajectory", "group", "none")
# Where the multipliers come from: DPS's progress, or the ground-truth control (METHOD.md §2).
CREDITS = ("progress", "oracle")
# Whether each completion's multipliers are shifted to a mean of 1 (METHOD.md §2).
CENTERS = ("none", "sequence")
# SML's cut of the completion into strata (METHOD.md §3).
STRATA = ("random", "interleaved", "contiguous")
# Group advantages (METHOD.md §4, §6): the division by the group's spread, the baseline.
REWARD_SCALES = ("none", "group")
ADVANTAGE_BASELINES = ("mean", "leave_one_out")
# GDPO's reduction of the ELBO terms (METHOD.md §4).
GDPO_REDUCTIONS = ("sequence", "token")


def _plain(name: str) -> str:
    return name


def check_mode(key: str, value, modes: Sequence) -> None:
    """A ValueError naming ``key``, the valid modes and the nearest one, unless ``value`` is one."""
    if value in modes:
        return
    near = difflib.get_close_matches(str(value), [str(m) for m in modes], n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ValueError(f"{key}: {value!r} is not one of {list(modes)}{hint}")


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_sampler(
    *,
    gen_length: int,
    steps: int,
    block_length: int,
    temperature: float,
    cfg_scale: float,
    remasking: str,
    cache: str,
    refresh_every: int | None,
    trace_refresh: str,
    parallel_threshold: float | None,
    dps_stride: int | None,
    dps_scope: str,
    traced: bool,
    key: Callable[[str], str] = _plain,
) -> None:
    """The rules between ``generate``'s arguments (METHOD.md §1-2, docs/rollouts.md), each a
    ValueError naming the fix. ``traced``: the DPS trace is recorded with ``dps_stride``.
    ``key(argument)`` spells an argument's name: ``generate``'s own by default, the
    configuration's keys (``generation.gen_length``, the TRL front-end's ``dps_stride``) there."""
    length, block, count = key("gen_length"), key("block_length"), key("steps")
    for name, value in ((length, gen_length), (block, block_length), (count, steps)):
        _need(_is_count(value), f"{name} must be >= 1, got {value}")
    _need(
        gen_length % block_length == 0,
        f"{length}={gen_length} is not a multiple of {block}={block_length}: use a {length} "
        f"divisible by {block}",
    )
    blocks = gen_length // block_length
    _need(
        steps % blocks == 0,
        f"{count}={steps} is not divisible by the number of blocks {blocks} ({length} / {block})",
    )
    _need(temperature >= 0, f"{key('temperature')} must be >= 0, got {temperature}")
    _need(cfg_scale >= 0, f"{key('cfg_scale')} must be >= 0, got {cfg_scale}")
    for name, value, modes in (
        ("remasking", remasking, REMASKING),
        ("cache", cache, CACHES),
        ("trace_refresh", trace_refresh, TRACE_REFRESHES),
        ("dps_scope", dps_scope, DPS_SCOPES),
    ):
        check_mode(key(name), value, modes)
    every = refresh_every
    _need(
        every is None or _is_count(every),
        f"{key('refresh_every')} must be >= 1 (or null), got {every!r}",
    )
    tau, threshold = parallel_threshold, key("parallel_threshold")
    _need(tau is None or 0 <= tau <= 1, f"{threshold} must lie in [0, 1] (or null), got {tau}")
    _need(
        tau is None or remasking == "low_confidence",
        f"{threshold} compares probabilities: set {key('remasking')}=low_confidence",
    )
    scope = key("dps_scope")
    _need(
        tau is None or not traced or dps_scope == "all",
        f"{threshold} needs {scope}=all: {scope}=block needs the fixed schedule (with parallel "
        "decoding the block of the next recorded step is unknown when a step is recorded)",
    )
    stride = key("dps_stride")
    _need(dps_stride is None or _is_count(dps_stride), f"{stride} must be >= 1, got {dps_stride!r}")
    _need(
        not traced or dps_stride < steps,
        f"{stride}={dps_stride} >= {count}={steps} records a single step (no interval, so δ "
        "would be 0): use a stride below the number of steps",
    )


def check_anneal_steps(anneal_steps: int, key: Callable[[str], str] = _plain) -> None:
    """Annealed SML's length in training steps (METHOD.md §3): 0 (K fixed) or more."""
    _need(anneal_steps >= 0, f"{key('anneal_steps')} must be >= 0 (0: K fixed), got {anneal_steps}")


def check_num_strata(
    num_strata: int, length: int | None = None, key: Callable[[str], str] = _plain
) -> None:
    """SML's K (METHOD.md §3): at least one stratum, and none empty over a completion of
    ``length`` positions (None: strata given, not cut here)."""
    name = key("num_strata")
    _need(num_strata >= 1, f"{name} must be >= 1, got {num_strata}")
    _need(
        length is None or num_strata <= length,
        f"{name}={num_strata} exceeds the completion length ({key('gen_length')}={length}): a "
        "stratum would be empty",
    )


__all__ = [
    "ADVANTAGE_BASELINES",
    "CACHES",
    "CENTERS",
    "CREDITS",
    "DPS_SCOPES",
    "GDPO_REDUCTIONS",
    "LAST_STEP_MODES",
    "NORM_AXES",
    "REMASKING",
    "REWARD_SCALES",
    "STRATA",
    "TRACE_REFRESHES",
    "check_mode",
    "check_anneal_steps",
    "check_num_strata",
    "check_sampler",
]
