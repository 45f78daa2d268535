"""The native families on transformers' own Llama, Qwen2 and Qwen3 classes: no remote code.

(LLaDA-MoE, Qwen3 with sparse MoE blocks of daca's own, is in ``daca.models.native_moe``.)

LLaDA-8B (and LLaDA-1.5, and the embedded tiny models) is a Llama block — RMSNorm, rotate-half
RoPE, SwiGLU, no bias, untied head — with bidirectional attention; Dream-7B (and Dream-Coder,
DiffuCoder) is Qwen2 with bidirectional attention whose logits are shifted right by one; an
A2D model (dllm's autoregressive-to-diffusion recipe) is its AR architecture — Qwen3, Qwen2 or
Llama — with bidirectional attention and no shift. So a checkpoint of each family loads into
``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` with:

- a config translated from the hub's ``config.json`` (``llama_config``, ``qwen2_config``; an
  A2D config.json is its AR class's config already, ``a2d_config``), ``is_causal`` off in the
  config (transformers then builds a bidirectional mask) and in every attention module (so
  SDPA never falls back to its causal kernel when no mask is passed);
- LLaDA's state-dict keys mapped onto Llama's while loading (``LLADA_KEYS``, transformers'
  public ``key_mapping``); Dream's and A2D's keys are their transformers class's already.

The classes below are those transformers classes with four changes: causality off,
positions counted from the first real token of a left-padded row (so a padded row equals the
row alone), Dream's shift undone (logits at i predict token i, the core's contract in
``daca.core.modeling``), and ``save_pretrained`` writing the family's hub layout back (hub key
names, the original ``config.json`` fields), so a trained model loads with daca and with the
family's own code alike. Everything else — SDPA, gradient checkpointing, caches, PEFT target names
``q_proj … down_proj``, DeepSpeed/FSDP wrapping — is transformers' own.
"""

from __future__ import annotations

import copy
import json
import re
from functools import partial
from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

from daca.core.modeling import block_causal_mask, padded_positions

# LLaDA's hub names beside Llama's: the model's top level, then each block's.
_TOP_NAMES = [("wte", "model.embed_tokens"), ("ln_f", "model.norm"), ("ff_out", "lm_head")]
_BLOCK_NAMES = [
    ("q_proj", "self_attn.q_proj"),
    ("k_proj", "self_attn.k_proj"),
    ("v_proj", "self_attn.v_proj"),
    ("attn_out", "self_attn.o_proj"),
    ("ff_proj", "mlp.gate_proj"),  # SwiGLU: act(ff_proj x) * up_proj x, then ff_out
    ("up_proj", "mlp.up_proj"),
    ("ff_out", "mlp.down_proj"),
    ("attn_norm", "input_layernorm"),
    ("ff_norm", "post_attention_layernorm"),
]
# Hub key (regex) -> Llama key, for ``from_pretrained(key_mapping=...)``, whose substitution
# takes one group: one pattern per name.
LLADA_KEYS = {rf"^model\.transformer\.{a}\.": f"{b}." for a, b in _TOP_NAMES} | {
    rf"^model\.transformer\.blocks\.(\d+)\.{a}\.": rf"model.layers.\1.{b}." for a, b in _BLOCK_NAMES
}
# Llama key (regex) -> hub key, for saving.
_TO_LLADA = {rf"^{re.escape(b)}\.": f"model.transformer.{a}." for a, b in _TOP_NAMES} | {
    rf"^model\.layers\.(\d+)\.{re.escape(b)}\.": rf"model.transformer.blocks.\1.{a}."
    for a, b in _BLOCK_NAMES
}


def rename_keys(state: dict, mapping: dict[str, str]) -> dict:
    """``state`` with each key renamed by the first pattern of ``mapping`` that matches; a key
    no pattern matches is a KeyError (a silently dropped weight would load as random)."""
    out = {}
    for key, value in state.items():
        for pattern, target in mapping.items():
            new, n = re.subn(pattern, target, key)
            if n:
                out[new] = value
                break
        else:
            raise KeyError(f"no hub name for weight {key!r}")
    return out


# ----------------------------------------------------------------------------- configs
# LLaDA's OLMo-style options this mapping reproduces exactly; any other value is rejected
# rather than loaded into an architecture that differs from the checkpoint's.
_LLADA_REQUIRED = {
    "block_type": ("llama",),
    "layer_norm_type": ("rms",),
    "activation_type": ("silu", "swiglu"),
    "rope": (True,),
    "alibi": (False, None),
    "scale_logits": (False, None),
    "input_emb_norm": (False, None),
    "attention_layer_norm": (False, None),
    "include_bias": (False, None),
    "include_qkv_bias": (False, None),
    "multi_query_attention": (False, None),
}


def llama_config(hub: dict, **overrides) -> LlamaConfig:
    """Llama config of a LLaDA ``config.json`` mapping (keys as in GSAI-ML/LLaDA-8B-Instruct)."""
    for key, allowed in _LLADA_REQUIRED.items():
        if key in hub and hub[key] not in allowed:
            raise ValueError(
                f"this LLaDA checkpoint sets {key}={hub[key]!r}; daca runs LLaDA on "
                f"transformers' Llama, which needs {key} in {allowed}"
            )
    d, heads = int(hub["d_model"]), int(hub["n_heads"])
    mlp = hub.get("mlp_hidden_size") or int(hub.get("mlp_ratio", 4)) * d
    config = LlamaConfig(
        vocab_size=int(hub.get("embedding_size") or hub["vocab_size"]),
        hidden_size=d,
        intermediate_size=int(mlp),
        num_hidden_layers=int(hub["n_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(hub.get("n_kv_heads") or heads),
        hidden_act="silu",
        max_position_embeddings=int(hub.get("max_sequence_length", 4096)),
        rms_norm_eps=float(hub.get("rms_norm_eps", 1e-5)),
        rope_parameters={"rope_type": "default", "rope_theta": float(hub.get("rope_theta", 1e4))},
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=bool(hub.get("weight_tying", False)),
        pad_token_id=None,  # an embedding padding_idx would freeze the pad (= EOS) row
        eos_token_id=hub.get("eos_token_id"),
        bos_token_id=hub.get("bos_token_id"),
        **overrides,
    )
    return _bidirectional_config(config, hub)


def llada_hub_config(config: LlamaConfig) -> dict:
    """The LLaDA ``config.json`` of a Llama config: the original fields, sizes from ``config``."""
    hub = dict(getattr(config, "hub_config", None) or _LLADA_DEFAULTS)
    rope = config.rope_parameters or {}
    hub.update(
        d_model=config.hidden_size,
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads,
        n_layers=config.num_hidden_layers,
        mlp_hidden_size=config.intermediate_size,
        embedding_size=config.vocab_size,
        vocab_size=min(int(hub.get("vocab_size") or config.vocab_size), config.vocab_size),
        max_sequence_length=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=rope.get("rope_theta", hub.get("rope_theta")),
        weight_tying=bool(config.tie_word_embeddings),
    )
    return hub


# Fields of LLaDA's config.json that a model made from scratch (the tiny ones) writes.
_LLADA_DEFAULTS = {
    "model_type": "llada",
    "architectures": ["LLaDAModelLM"],
    "activation_type": "silu",
    "alibi": False,
    "attention_dropout": 0.0,
    "attention_layer_norm": False,
    "block_type": "llama",
    "embedding_dropout": 0.0,
    "include_bias": False,
    "include_qkv_bias": False,
    "input_emb_norm": False,
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "residual_dropout": 0.0,
    "rope": True,
    "rope_full_precision": True,
    "scale_logits": False,
    "use_cache": False,
}


def qwen2_config(hub: dict, **overrides) -> Qwen2Config:
    """Qwen2 config of a Dream ``config.json`` mapping (its keys are Qwen2's already)."""
    if hub.get("use_sliding_window"):
        raise ValueError("this Dream checkpoint uses sliding-window attention, which daca rejects")
    config = Qwen2Config(
        vocab_size=int(hub["vocab_size"]),
        hidden_size=int(hub["hidden_size"]),
        intermediate_size=int(hub["intermediate_size"]),
        num_hidden_layers=int(hub["num_hidden_layers"]),
        num_attention_heads=int(hub["num_attention_heads"]),
        num_key_value_heads=int(hub.get("num_key_value_heads") or hub["num_attention_heads"]),
        hidden_act=hub.get("hidden_act", "silu"),
        max_position_embeddings=int(hub.get("max_position_embeddings", 32768)),
        rms_norm_eps=float(hub.get("rms_norm_eps", 1e-6)),
        rope_parameters={"rope_type": "default", "rope_theta": float(hub.get("rope_theta", 1e6))},
        tie_word_embeddings=bool(hub.get("tie_word_embeddings", False)),
        attention_dropout=float(hub.get("attention_dropout", 0.0)),
        use_sliding_window=False,
        pad_token_id=None,  # an embedding padding_idx would freeze the pad (= EOS) row
        eos_token_id=hub.get("eos_token_id"),
        bos_token_id=hub.get("bos_token_id"),
        **overrides,
    )
    if hub.get("rope_scaling"):
        raise ValueError(f"this Dream checkpoint sets rope_scaling={hub['rope_scaling']!r}")
    return _bidirectional_config(config, hub)


# The size fields of a Qwen2/Qwen3/Llama-style config.json, written back from the model.
_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def sized_hub_config(config, model_type: str) -> dict:
    """The hub ``config.json`` of a Qwen2/Qwen3/Llama config: the original fields (a model
    made from scratch: just ``model_type``), sizes from ``config``."""
    hub = dict(getattr(config, "hub_config", None) or {"model_type": model_type})
    hub.update({key: getattr(config, key) for key in _SIZES})
    hub["tie_word_embeddings"] = bool(config.tie_word_embeddings)
    if "head_dim" in hub:
        hub["head_dim"] = config.head_dim
    return hub


dream_hub_config = partial(sized_hub_config, model_type="Dream")

# config.json fields that describe the file or the AR model's own loading, not the
# architecture; the rest of an A2D config.json is its AR class's config as it stands.
_NOT_ARCHITECTURE = (
    "model_type",
    "architectures",
    "auto_map",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "_name_or_path",
    "use_cache",
    "pad_token_id",  # an embedding padding_idx would freeze the pad row
)


def a2d_config(config_class, hub: dict, **overrides):
    """The Qwen3/Qwen2/Llama config of an A2D ``config.json`` (dllm's ``A2D*Config``: the AR
    config with a new ``model_type``)."""
    if hub.get("use_sliding_window"):
        # dllm's A2D forward gives sliding-window layers the full bidirectional mask.
        raise ValueError("this A2D checkpoint sets use_sliding_window, which daca rejects")
    # A copy: transformers writes into the nested rope dict, which must go back to disk as read.
    fields = copy.deepcopy({k: v for k, v in hub.items() if k not in _NOT_ARCHITECTURE})
    config = config_class(**(fields | {"pad_token_id": None, **overrides}))
    return _bidirectional_config(config, hub)


def _bidirectional_config(config, hub: dict):
    config.is_causal = False  # transformers' mask builders then make a bidirectional mask
    block = hub.get("attention_block_size")  # daca's key: block-causal attention in blocks
    if block is not None and (not isinstance(block, int) or block < 1):
        raise ValueError(f"attention_block_size must be a positive integer, got {block!r}")
    config.attention_block = block
    config.use_cache = False  # a diffusion forward caches nothing unless a sampler asks
    config.hub_config = dict(hub)  # written back as config.json on save
    config.mask_token_id = hub.get("mask_token_id")
    return config


# ----------------------------------------------------------------------------- models
def _positions_from_mask(attention_mask, input_ids, position_ids):
    """Positions counted from the first real token of each left-padded row."""
    if position_ids is not None or attention_mask is None or attention_mask.dim() != 2:
        return position_ids
    if input_ids is not None and attention_mask.shape != input_ids.shape:
        return None  # a mask that also covers cached keys: the caller passes positions
    return padded_positions(attention_mask)


def _no_causal_attention(model) -> None:
    for module in model.modules():
        if hasattr(module, "is_causal"):
            module.is_causal = False


class _HubLayout:
    """``save_pretrained`` in the family's hub layout: hub key names, hub ``config.json``."""

    hub_config_of = staticmethod(lambda config: dict(config.hub_config))
    to_hub_keys: dict[str, str] | None = None

    def save_pretrained(
        self,
        save_directory,
        *,
        state_dict: dict | None = None,
        is_main_process: bool = True,
        max_shard_size: str | int = "5GB",
        **_ignored,
    ) -> None:
        from huggingface_hub import save_torch_state_dict

        if not is_main_process:
            return
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        state = dict(self.state_dict() if state_dict is None else state_dict)
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # the hub layouts store a tied head once
        if self.to_hub_keys is not None:
            state = rename_keys(state, self.to_hub_keys)
        state = {k: v.detach().contiguous() for k, v in state.items()}
        save_torch_state_dict(state, folder, max_shard_size=max_shard_size)
        hub = self.hub_config_of(self.config)
        hub["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
        (folder / "config.json").write_text(json.dumps(hub, indent=2, sort_keys=True) + "\n")
        for name, content in self.hub_files(hub).items():
            (folder / name).write_text(json.dumps(content, indent=2) + "\n")

    @staticmethod
    def hub_files(hub: dict) -> dict[str, dict]:
        """Other JSON files the family's own code needs beside ``config.json``."""
        return {}


class _Bidirectional:
    """The diffusion forward over a transformers causal-LM class: no causal mask, positions
    from the attention mask, and logits shifted right by ``logits_shift`` (Dream's 1: its
    hidden state at i - 1 predicts token i). With ``config.attention_block`` (LLaDA 2.x; a
    config.json's ``attention_block_size``, e.g. dllm's BD3LM-trained A2D models) attention is
    block-causal instead (``daca.core.modeling.block_causal_mask``)."""

    logits_shift = 0

    def __init__(self, config):
        config.is_causal = False
        super().__init__(config)
        _no_causal_attention(self)
        if self.attention_block is not None and self.logits_shift:
            raise ValueError("block-causal attention with shifted logits (Dream) is not supported")

    @property
    def attention_block(self) -> int | None:
        """The block of block-causal attention, which the sampler decodes in; None when the
        attention is bidirectional."""
        return getattr(self.config, "attention_block", None)

    @property
    def attention_anchor(self) -> str:
        """Where the blocks are counted from (``daca.core.modeling.ANCHORS``)."""
        return getattr(self.config, "attention_anchor", "end")

    def _block_causal(self, input_ids, attention_mask, kwargs):
        """A full forward's block-causal mask, built from its padding mask; a cached step's
        [B, 1, q, kv] mask (daca.core.block_cache lays it out) passes through."""
        if attention_mask is not None and attention_mask.dim() == 4:
            return attention_mask
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError(
                "a cached step of a block-causal model needs a [B, 1, q, kv] mask over the "
                "cached keys (daca.core.block_cache builds it), not a padding mask"
            )
        inputs = input_ids if input_ids is not None else kwargs["inputs_embeds"]
        block, anchor = self.attention_block, self.attention_anchor
        return block_causal_mask(attention_mask, inputs.shape[:2], block, inputs.device, anchor)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        position_ids = _positions_from_mask(attention_mask, input_ids, position_ids)
        if self.attention_block is not None:
            attention_mask = self._block_causal(input_ids, attention_mask, kwargs)
        out = super().forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        )
        if self.logits_shift:
            out.logits = torch.cat([out.logits[:, :1], out.logits[:, :-1]], dim=1)
        return out


class LLaDAForDiffusionLM(_HubLayout, _Bidirectional, LlamaForCausalLM):
    """transformers' ``LlamaForCausalLM`` run as LLaDA: bidirectional, positions from the
    attention mask, saved in LLaDA's hub layout."""

    hub_config_of = staticmethod(llada_hub_config)
    to_hub_keys = _TO_LLADA

    def load_state_dict(self, state_dict, *args, **kwargs):
        """Also takes LLaDA's hub key names: a checkpoint this class wrote, read back by code
        that loads state dicts itself (transformers' Trainer on resume, for one)."""
        if any(key.startswith("model.transformer.") for key in state_dict):
            state_dict = rename_keys(state_dict, LLADA_KEYS)
        return super().load_state_dict(state_dict, *args, **kwargs)


class DreamForDiffusionLM(_HubLayout, _Bidirectional, Qwen2ForCausalLM):
    """transformers' ``Qwen2ForCausalLM`` run as Dream: bidirectional, positions from the
    attention mask, Dream's shift undone, saved in Dream's hub layout.

    Dream's logits at i predict token i + 1 (its sampler shifts them right by one); here
    ``logits[:, i]`` predicts token i and ``logits[:, 0]`` repeats Dream's first row, as
    Dream's own ``cat([logits[:, :1], logits[:, :-1]])`` does.
    """

    hub_config_of = staticmethod(dream_hub_config)
    logits_shift = 1

    @staticmethod
    def hub_files(hub: dict) -> dict[str, dict]:
        # Dream's own from_pretrained requires a generation_config.json.
        ids = ("bos_token_id", "eos_token_id", "pad_token_id")
        return {"generation_config.json": {k: hub[k] for k in ids if hub.get(k) is not None}}


class A2DQwen3ForDiffusionLM(_HubLayout, _Bidirectional, Qwen3ForCausalLM):
    """transformers' ``Qwen3ForCausalLM`` run as dllm's A2D Qwen3 (``a2d-qwen3``)."""

    hub_config_of = staticmethod(partial(sized_hub_config, model_type="a2d-qwen3"))


class A2DQwen2ForDiffusionLM(_HubLayout, _Bidirectional, Qwen2ForCausalLM):
    """transformers' ``Qwen2ForCausalLM`` run as dllm's A2D Qwen2 (``a2d-qwen2``)."""

    hub_config_of = staticmethod(partial(sized_hub_config, model_type="a2d-qwen2"))


class A2DLlamaForDiffusionLM(_HubLayout, _Bidirectional, LlamaForCausalLM):
    """transformers' ``LlamaForCausalLM`` run as dllm's A2D Llama (``a2d-llama``)."""

    hub_config_of = staticmethod(partial(sized_hub_config, model_type="a2d-llama"))
