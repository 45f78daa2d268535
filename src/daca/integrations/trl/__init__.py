"""DACA-GRPO inside TRL's ``GRPOTrainer`` (METHOD.md §2-§4), for masked diffusion LMs.

``DACAGRPOTrainer`` keeps TRL's data pipeline, reward functions, optimizer loop, logging and
checkpoints, and computes every micro-batch as ``daca train`` computes it, through the same
functions (docs/trl.md, "One step, two front-ends"): the rollout of ``daca.train.rollout``
(the core sampler, never ``model.generate``, which would decode left to right; DPS over the
optimizer step's rollouts), the seeds of ``daca.train.seeds``, and the base method's log-probs
and loss of ``daca.train.update`` (``DACAGRPOConfig.method``, a name of
``daca.train.methods.METHODS``). The step's micro-batches are daca's, completions at their full
length L with the loss mask up to the first end-of-sequence token; TRL decodes, rewards and
measures them cut there.

It overrides private TRL methods, hence the exact pin ``trl==1.16.0`` (docs/trl.md, "TRL
internals overridden"), checked here before either module loads: ``config``
(``DACAGRPOConfig``) and ``trainer`` (``DACAGRPOTrainer``).
"""

from __future__ import annotations

try:
    import trl
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "daca.integrations.trl needs TRL: pip install 'daca-grpo[trl]' (trl==1.16.0)"
    ) from e

TRL_VERSION = "1.16.0"
if trl.__version__ != TRL_VERSION:
    raise ImportError(
        f"daca.integrations.trl overrides private methods of TRL {TRL_VERSION}; found TRL "
        f"{trl.__version__}. Install the pinned version: pip install 'daca-grpo[trl]'"
    )

from daca.integrations.trl.config import (  # noqa: E402
    SECTIONS,
    TOP_LEVEL,
    TRAIN_FIELDS,
    TRL_LOSS_OPTIONS,
    DACAGRPOConfig,
)
from daca.integrations.trl.trainer import DACAGRPOTrainer, left_pad, with_prompt_column  # noqa: E402

__all__ = [
    "SECTIONS",
    "TOP_LEVEL",
    "TRAIN_FIELDS",
    "TRL_LOSS_OPTIONS",
    "DACAGRPOConfig",
    "DACAGRPOTrainer",
    "left_pad",
    "with_prompt_column",
]
