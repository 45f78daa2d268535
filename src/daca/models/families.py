"""Per-family knowledge for training: LoRA targets, gradient checkpointing and model shapes.

Shapes feed the memory estimate of ``daca train --dry-run`` (``daca.memory``), which must work
from the config alone: a local folder's ``config.json`` is read as JSON (no remote code runs),
hub names of known families come from a built-in table, other hub names from the local hub
cache when it holds their config.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

# All attention and MLP projections (METHOD.md §5), by family. LLaDA's output head is also
# called ``ff_out`` (model.transformer.ff_out), so its targets are a regex over the blocks
# (PEFT matches a string target with re.fullmatch on the module name). d1 targets q, k, v only.
LORA_TARGETS: dict[str, list[str] | str] = {
    "llada": r".*\.blocks\.\d+\.(q_proj|k_proj|v_proj|attn_out|ff_proj|up_proj|ff_out)",
    "dream": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "tiny": ["query", "key", "value", "dense"],
}


def lora_targets(bundle) -> list[str] | str:
    """PEFT ``target_modules`` for the bundle's family (other models: every linear layer)."""
    return LORA_TARGETS.get(bundle.family, "all-linear")


def enable_gradient_checkpointing(model) -> None:
    """Checkpoint every transformer layer (non-reentrant), for LLaDA's remote code too.

    LLaDA (an OLMo derivative) has its own switch, ``set_activation_checkpointing``, on the inner
    ``LLaDAModel``; copies whose ``_set_gradient_checkpointing`` hook was written for
    transformers 4 reject the ``every_n_layers`` argument transformers 5 passes, and older
    copies declare no support at all. Other models use transformers' own method.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    inner = getattr(base, "model", None)
    if hasattr(inner, "set_activation_checkpointing"):
        inner.set_activation_checkpointing("whole_layer")  # LLaDA's StrEnum compares as str
        return
    # transformers 5 renamed the method; the old name warns that it is deprecated.
    enable = getattr(base, "activation_checkpointing_enable", None)
    enable = enable or base.gradient_checkpointing_enable
    try:
        enable({"use_reentrant": False})
    except TypeError as e:
        if "every_n_layers" not in str(e):
            raise
        from torch.utils.checkpoint import checkpoint

        base._set_gradient_checkpointing(
            enable=True,
            gradient_checkpointing_func=functools.partial(checkpoint, use_reentrant=False),
        )


# ----------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class ModelShape:
    """What memory depends on: sizes of a transformer with per-layer attention and MLP.

    gated: the MLP has three matrices (SwiGLU: gate, up, down; LLaDA ff_proj, up_proj, ff_out)
    rather than two (BERT). tied: the output head shares the input embedding.
    """

    hidden: int
    layers: int
    vocab: int
    mlp: int
    heads: int
    kv_heads: int
    gated: bool = True
    tied: bool = False

    def layer_linears(self) -> list[tuple[int, int]]:
        """(in, out) of each projection of one layer: q, k, v, o, then the MLP."""
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        mlp = [(h, self.mlp)] * (2 if self.gated else 1) + [(self.mlp, h)]
        return [(h, h), (h, kv), (h, kv), (h, h), *mlp]

    @property
    def linear_parameters(self) -> int:
        return self.layers * sum(i * o for i, o in self.layer_linears())

    @property
    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def parameters(self) -> int:
        """Linear and embedding weights (norms and biases are negligible)."""
        return self.linear_parameters + self.embedding_parameters

    def lora_parameters(self, r: int) -> int:
        """A rank-r adapter on every projection of every layer: r · (in + out) each."""
        return self.layers * r * sum(i + o for i, o in self.layer_linears())


LLADA_8B = ModelShape(hidden=4096, layers=32, vocab=126464, mlp=12288, heads=32, kv_heads=32)
DREAM_7B = ModelShape(hidden=3584, layers=28, vocab=152064, mlp=18944, heads=28, kv_heads=4)
# Keys: the last part of a hub name, lower case (a local copy is read from its config.json).
KNOWN_SHAPES = {
    "llada-8b-instruct": LLADA_8B,
    "llada-8b-base": LLADA_8B,
    "llada-1.5": LLADA_8B,
    "dream-v0-instruct-7b": DREAM_7B,
    "dream-v0-base-7b": DREAM_7B,
}
_UNGATED = {"bert", "roberta", "xlm-roberta", "distilbert", "electra", "camembert"}


def shape_from_config(c: dict) -> ModelShape:
    """A shape from a config.json mapping (HF names, or LLaDA's OLMo names)."""

    def first(*keys, default=None):
        for k in keys:
            if c.get(k) is not None:
                return c[k]
        if default is None:
            raise KeyError(f"config has none of {keys}")
        return default

    h = int(first("hidden_size", "d_model", "n_embd"))
    heads = int(first("num_attention_heads", "n_heads"))
    mlp = (
        first("intermediate_size", "mlp_hidden_size", default=0)
        or first("mlp_ratio", default=4) * h
    )
    return ModelShape(
        hidden=h,
        layers=int(first("num_hidden_layers", "n_layers")),
        vocab=int(first("embedding_size", "vocab_size")),
        mlp=int(mlp),
        heads=heads,
        kv_heads=int(first("num_key_value_heads", "n_kv_heads", default=heads)),
        gated=str(c.get("model_type", "")).lower() not in _UNGATED,
        tied=bool(first("tie_word_embeddings", "weight_tying", default=True)),
    )


def model_shape(name_or_path: str | None) -> tuple[ModelShape, str]:
    """(shape, where it came from) for a model name or folder, without loading weights."""
    from daca.models.loading import SHIPPED

    name = str(name_or_path or "tiny")
    folder = SHIPPED.get(name, Path(name))
    if (folder / "config.json").is_file():
        return shape_from_config(json.loads((folder / "config.json").read_text())), "config.json"
    key = name.rstrip("/").rsplit("/", 1)[-1].lower()
    if key in KNOWN_SHAPES:
        return KNOWN_SHAPES[key], "built-in table"
    if name in SHIPPED:
        raise FileNotFoundError(f"the shipped model {name!r} is missing from {SHIPPED[name]}")
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
    except Exception:  # noqa: BLE001 - not a hub name, or no hub library: unknown below
        cached = None
    if isinstance(cached, str):
        return shape_from_config(json.loads(Path(cached).read_text())), "hub cache"
    raise LookupError(
        f"unknown model {name!r}: not a folder with config.json, not in the hub cache, and not "
        f"one of the built-in shapes ({', '.join(sorted(KNOWN_SHAPES))})"
    )
