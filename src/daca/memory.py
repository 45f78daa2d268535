"""A rough GPU-memory estimate per device for ``daca train --dry-run``."""

from __future__ import annotations

from daca.config import TrainConfig


def estimate_text(cfg: TrainConfig) -> str:
    """Explain that the estimate needs the model's size; filled in for known families."""
    from daca.models.families import estimate_memory

    return estimate_memory(cfg)
