"""Per-family knowledge for training: LoRA targets, gradient checkpointing and model shapes.

Shapes feed the memory estimate of ``daca train --dry-run`` (``daca.tools.memory``), which must work
from the config alone: a config.json (a local folder's, read as JSON with no remote code run; a
built-in copy of LLaDA-8B's and Dream-7B's for their hub names; else the local hub cache's)
builds the model on the meta device, and the shape is read off that module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# All attention and MLP projections (METHOD.md §5): LLaDA and Dream run on transformers' Llama
# and Qwen2, whose module names are the standard ones. d1 targets q, k, v only.
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS: dict[str, list[str] | str] = {"llada": PROJECTIONS, "dream": PROJECTIONS}


def lora_targets(bundle) -> list[str] | str:
    """PEFT ``target_modules`` for the bundle's family (other models: every linear layer)."""
    return LORA_TARGETS.get(bundle.family, "all-linear")


def enable_gradient_checkpointing(model) -> None:
    """Checkpoint every transformer layer with transformers' own switch (non-reentrant, which
    works with frozen inputs under LoRA)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    base.activation_checkpointing_enable({"use_reentrant": False})


# ----------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class ModelShape:
    """What memory depends on, read off the model's transformers module (``shape_of_module``).

    parameters: every parameter (a tied head counted once); linears: (in, out) of each linear
    layer inside the transformer layers, in module order: the projections that LoRA adapts and
    4-bit loading quantises. head_on_completion: the head runs on the completion's positions
    only (transformers' Llama/Qwen2 classes take ``logits_to_keep``; daca.core.modeling).
    """

    hidden: int
    layers: int
    vocab: int
    mlp: int
    parameters: int
    linears: tuple[tuple[int, int], ...]
    head_on_completion: bool = False

    @property
    def linear_parameters(self) -> int:
        """Weights of the layers' projections (their biases, if any, are not counted here)."""
        return sum(i * o for i, o in self.linears)

    @property
    def other_parameters(self) -> int:
        """Embeddings, output head, norms and biases: what 4-bit loading keeps in bf16."""
        return self.parameters - self.linear_parameters

    def lora_parameters(self, r: int) -> int:
        """A rank-r adapter on every projection of every layer: r · (in + out) each."""
        return r * sum(i + o for i, o in self.linears)


# The public config.json fields that fix the shapes of GSAI-ML/LLaDA-8B-Instruct and
# Dream-org/Dream-v0-Instruct-7B, so that a dry run downloads nothing for their hub names.
LLADA_8B_CONFIG = {
    "model_type": "llada", "d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32,
    "mlp_hidden_size": 12288, "vocab_size": 126464, "embedding_size": 126464,
    "weight_tying": False, "max_sequence_length": 4096, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05, "block_type": "llama", "layer_norm_type": "rms", "rope": True,
    "include_bias": False, "include_qkv_bias": False,
}  # fmt: skip
DREAM_7B_CONFIG = {
    "model_type": "Dream", "hidden_size": 3584, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
    "vocab_size": 152064, "tie_word_embeddings": False, "max_position_embeddings": 131072,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "hidden_act": "silu",
    "use_sliding_window": False,
}  # fmt: skip
# Keys: the last part of a hub name, lower case (a local copy is read from its config.json).
KNOWN_CONFIGS = {
    "llada-8b-instruct": LLADA_8B_CONFIG,
    "llada-8b-base": LLADA_8B_CONFIG,
    "llada-1.5": LLADA_8B_CONFIG,
    "dream-v0-instruct-7b": DREAM_7B_CONFIG,
    "dream-v0-base-7b": DREAM_7B_CONFIG,
}


def meta_module(config: dict):
    """The model of a config.json mapping, built on the meta device (no memory, no weights):
    LLaDA and Dream as daca runs them (``daca.models.native``), other model types as
    transformers' masked LM of that type. LookupError if transformers has no class for it."""
    import torch

    from daca.models.native import NATIVE

    kind = str(config.get("model_type", "")).lower()
    with torch.device("meta"):
        if kind in NATIVE:
            cls, make_config, _ = NATIVE[kind]
            return cls(make_config(config))
        from transformers import AutoConfig, AutoModelForMaskedLM

        fields = {k: v for k, v in config.items() if k != "model_type"}
        try:
            return AutoModelForMaskedLM.from_config(AutoConfig.for_model(kind, **fields))
        except (ValueError, KeyError) as e:
            raise LookupError(f"transformers has no masked LM of model_type {kind!r}") from e


def shape_of_module(model) -> ModelShape:
    """The shape of a transformers model: its parameters counted, the linear layers of its
    layer stack (its longest ModuleList) listed."""
    from torch import nn

    from daca.core.modeling import causal_lm_backbone

    stack = max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len)
    embedding = model.get_input_embeddings()
    return ModelShape(
        hidden=embedding.embedding_dim,
        layers=len(stack),
        vocab=embedding.num_embeddings,
        mlp=int(model.config.intermediate_size),
        parameters=sum(p.numel() for p in model.parameters()),
        linears=tuple(
            (m.in_features, m.out_features) for m in stack.modules() if isinstance(m, nn.Linear)
        ),
        head_on_completion=causal_lm_backbone(model) is not None,
    )


def shape_from_config(config: dict) -> ModelShape:
    """The shape of the model a config.json mapping describes, read off its meta-device module."""
    return shape_of_module(meta_module(config))


def model_shape(name_or_path: str | None) -> tuple[ModelShape, str]:
    """(shape, where its config came from) for a model name or folder, without loading weights."""
    config, source = _config_of(str(name_or_path or "tiny"))
    return shape_from_config(config), source


def _config_of(name: str) -> tuple[dict, str]:
    """A folder's config.json, else the built-in copy of a known hub name's, else the hub
    cache's; read as JSON (no remote code runs)."""
    from daca.models.loading import SHIPPED

    folder = SHIPPED.get(name, Path(name))
    if (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text()), "config.json"
    key = name.rstrip("/").rsplit("/", 1)[-1].lower()
    if key in KNOWN_CONFIGS:
        return KNOWN_CONFIGS[key], "built-in config.json"
    if name in SHIPPED:
        raise FileNotFoundError(f"the shipped model {name!r} is missing from {SHIPPED[name]}")
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
    except Exception:  # noqa: BLE001 - not a hub name, or no hub library: unknown below
        cached = None
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text()), "hub cache"
    raise LookupError(
        f"unknown model {name!r}: not a folder with config.json, not in the hub cache, and not "
        f"one of the built-in configs ({', '.join(sorted(KNOWN_CONFIGS))})"
    )
