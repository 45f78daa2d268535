"""Each native family's transformers class, config translation and checkpoint-key map
(``daca.models.native``; LLaDA-MoE's in ``daca.models.native_moe``, LLaDA 2.x's in
``daca.models.native_llada2``), keyed by the family names
of ``daca.models.families.FAMILIES``. A table of its own, so that a family's module may build on
``native``'s helpers without an import cycle."""

from __future__ import annotations

from functools import partial

from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from daca.models.native import (
    LLADA_KEYS,
    A2DLlamaForDiffusionLM,
    A2DQwen2ForDiffusionLM,
    A2DQwen3ForDiffusionLM,
    DreamForDiffusionLM,
    LLaDAForDiffusionLM,
    a2d_config,
    llama_config,
    qwen2_config,
)
from daca.models.native_llada2 import LLADA2_KEYS, LLaDA2ForDiffusionLM, llada2_config
from daca.models.native_moe import _BIAS_FROM_HUB, LLaDAMoEForDiffusionLM, llada_moe_config

NATIVE = {
    "llada": (LLaDAForDiffusionLM, llama_config, LLADA_KEYS),
    "dream": (DreamForDiffusionLM, qwen2_config, None),
    "a2d-qwen3": (A2DQwen3ForDiffusionLM, partial(a2d_config, Qwen3Config), None),
    "a2d-qwen2": (A2DQwen2ForDiffusionLM, partial(a2d_config, Qwen2Config), None),
    "a2d-llama": (A2DLlamaForDiffusionLM, partial(a2d_config, LlamaConfig), None),
    "llada-moe": (LLaDAMoEForDiffusionLM, llada_moe_config, _BIAS_FROM_HUB),
    "llada2": (LLaDA2ForDiffusionLM, llada2_config, LLADA2_KEYS),
}
