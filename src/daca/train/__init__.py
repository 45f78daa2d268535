"""Training: the configuration, the base-method registry, the native trainer and its parts.

``from daca.train import Trainer, train, load_config`` works; the names load on first use so
that importing the configuration does not import torch models or the model loader.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Trainer": "daca.train.trainer",
    "train": "daca.train.trainer",
    "InputError": "daca.train.errors",
    "TrainingError": "daca.train.errors",
    "TrainConfig": "daca.train.config",
    "load_config": "daca.train.config",
    "ConfigError": "daca.train.config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'daca.train' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
