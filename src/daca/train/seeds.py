"""Every seed of a run, derived from (seed, step, micro-batch, rank, ...): the data order, the
LoRA adapter's initial weights, the sampler's generator and the likelihood masks' generators.

Both front-ends draw from these (``daca train`` and ``daca.integrations.trl``), so a step on the
same inputs draws the same numbers in both; and since nothing is carried from step to step, a run
resumed from a checkpoint draws what the uninterrupted run drew.
"""

from __future__ import annotations

import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (FNV-1a over 48-bit parts: stable across runs and processes)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def seeded_generator(device, *parts: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(derive_seed(*parts))


def data_order_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s permutation of the training prompts."""
    return derive_seed(seed, epoch)


def adapter_seed(seed: int) -> int:
    """The seed of a new LoRA adapter's initial weights."""
    return derive_seed(seed, 3)


def sampler_generator(device, seed: int, step: int, micro: int, rank: int) -> torch.Generator:
    """The sampler's generator of micro-batch ``micro`` of step ``step`` on process ``rank``
    (the TRL front-end's evaluation: micro-batch -1)."""
    return seeded_generator(device, seed, step, micro, rank, 7)


def mask_seed(seed: int, step: int, micro: int, it: int, rank: int) -> int:
    """The masks' seed of inner iteration ``it`` of micro-batch ``micro`` of step ``step`` on
    process ``rank``: one per iteration, shared by the current, old and reference log-probs."""
    return derive_seed(seed, step, micro, it, rank, 11)


def step_mask_seeds(seed: int, step: int, micros, mu: int, rank: int) -> list[list[int]]:
    """``mask_seed`` of every micro-batch ``micros`` of step ``step`` and each of its μ inner
    iterations: [micro-batch][iteration]."""
    return [[mask_seed(seed, step, m, it, rank) for it in range(mu)] for m in micros]


def estimator_generator(device, mask_seed: int) -> torch.Generator:
    """The generator of the method's estimator (its prompt masks, ELBO or coupled masks) under
    the masks' seed ``mask_seed``."""
    return seeded_generator(device, mask_seed, 1)


def strata_generator(device, mask_seed: int) -> torch.Generator:
    """The generator of SML's strata under the masks' seed ``mask_seed``."""
    return seeded_generator(device, mask_seed, 2)
