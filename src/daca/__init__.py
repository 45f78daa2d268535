"""daca: DACA-GRPO for masked diffusion language models.

The method core is a set of pure functions on tensors (see METHOD.md in the docs):

>>> from daca import generate, Rollout      # sampler with the denoising trace
>>> from daca import dps                    # Denoising Progress Scores
>>> from daca import likelihood             # mean-field, SML, GDPO ELBO
>>> from daca import objectives             # group advantages and the base losses

The names load on first use: ``import daca`` (and so ``daca --help``) does not import torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
_EXPORTS = {
    "Rollout": "daca.core.sampler",
    "generate": "daca.core.sampler",
    "dps": "daca.core",
    "likelihood": "daca.core",
    "objectives": "daca.core",
}
__all__ = ["Rollout", "generate", "dps", "likelihood", "objectives", "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'daca' has no attribute {name!r}")
    module = _EXPORTS[name]
    if module == "daca.core":  # a submodule of the core
        return importlib.import_module(f"daca.core.{name}")
    return getattr(importlib.import_module(module), name)
