"""Tiny checkpoint folders laid out like inclusionAI/LLaDA2.0-mini (and LLaDA2.1-mini).

config.json: the keys of dllm's ``configuration_llada2_moe.py`` (``LLaDA2MoeConfig``,
``model_type`` "llada2_moe"), the vocabulary of 157184 rows, EOS 156892 and the mask 156895
(its modeling code's ``generate`` defaults); only the widths are tiny, and the attention block
is 8 (``attention_block_size``, daca's key; the hub's block is 32) so that short completions
span several blocks. Weights: the state-dict keys of its ``LLaDA2MoeModelLM``
(``model.word_embeddings``, ``attention.query_key_value`` / ``dense`` / ``query_layernorm`` /
``key_layernorm``, ``mlp.gate.weight`` and ``mlp.gate.expert_bias`` the router,
``mlp.experts.<j>.*`` and ``mlp.shared_experts.*``; the first ``first_k_dense_replace`` layers a
dense ``mlp.*_proj``). The tokenizer: LLaDA-MoE's stand-in (``_hub_moe``: the same vocabulary).
Poisoned ``configuration_llada2_moe.py`` / ``modeling_llada2_moe.py`` lie beside them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from _hub import poison, random_weights, write_weights
from _hub_moe import head_shapes, swiglu_shapes, write_moe_tokenizer

BLOCK = 8


def llada2_config(
    *,
    hidden_size=32,
    heads=4,
    kv_heads=2,
    head_dim=16,
    layers=2,
    experts=4,
    groups=2,
    top_groups=1,
    top_k=2,
    expert_size=16,
    dense_size=64,
    dense_layers=1,
    shared=1,
    qkv_bias=False,
    out_bias=False,
    qk_norm=True,
    tied=False,
) -> dict:
    """LLaDA2.0-mini's config.json fields, tiny widths (2 layers, the first dense, 4 experts in
    2 groups, top 2 of the best group, a shared expert)."""
    return {
        "architectures": ["LLaDA2MoeModelLM"],
        "auto_map": {
            "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
            "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
            "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
        },
        "attention_block_size": BLOCK,
        "attention_dropout": 0.0,
        "embedding_dropout": 0.0,
        "eos_token_id": 156892,
        "first_k_dense_replace": dense_layers,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": dense_size,
        "max_position_embeddings": 8192,
        "max_window_layers": 28,
        "model_type": "llada2_moe",
        "moe_intermediate_size": expert_size,
        "n_group": groups,
        "norm_head": False,
        "num_attention_heads": heads,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "num_shared_experts": shared,
        "output_dropout": 0.0,
        "output_router_logits": False,
        "pad_token_id": 156892,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 600000,
        "routed_scaling_factor": 2.5,
        "sliding_window": 4096,
        "tie_word_embeddings": tied,
        "topk_group": top_groups,
        "torch_dtype": "float32",
        "transformers_version": "4.56.0",
        "use_bias": out_bias,
        "use_cache": False,
        "use_qk_norm": qk_norm,
        "use_qkv_bias": qkv_bias,
        "use_sliding_window": False,
        "vocab_size": 157184,
    }


def llada2_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """LLaDA2MoeModelLM's state-dict keys and shapes (a tied head is stored once)."""
    d, v, hd = c["hidden_size"], c["vocab_size"], c["head_dim"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    shapes = {"model.word_embeddings.weight": (v, d)}
    for i in range(c["num_hidden_layers"]):
        b = f"model.layers.{i}."
        shapes[b + "input_layernorm.weight"] = (d,)
        shapes[b + "attention.query_key_value.weight"] = ((heads + 2 * kv) * hd, d)
        if c["use_qkv_bias"]:
            shapes[b + "attention.query_key_value.bias"] = ((heads + 2 * kv) * hd,)
        if c["use_qk_norm"]:
            shapes[b + "attention.query_layernorm.weight"] = (hd,)
            shapes[b + "attention.key_layernorm.weight"] = (hd,)
        shapes[b + "attention.dense.weight"] = (d, heads * hd)
        if c["use_bias"]:
            shapes[b + "attention.dense.bias"] = (d,)
        shapes[b + "post_attention_layernorm.weight"] = (d,)
        mlps = [("mlp.", c["intermediate_size"])]
        if i >= c["first_k_dense_replace"]:
            shapes[b + "mlp.gate.weight"] = (c["num_experts"], d)
            shapes[b + "mlp.gate.expert_bias"] = (c["num_experts"],)
            f = c["moe_intermediate_size"]
            mlps = [(f"mlp.experts.{j}.", f) for j in range(c["num_experts"])]
            if c["num_shared_experts"]:
                mlps.append(("mlp.shared_experts.", f * c["num_shared_experts"]))
        for prefix, f in mlps:
            shapes.update(swiglu_shapes(b + prefix, f, d))
    return shapes | head_shapes(c, d, v)


def llada2_weights(c: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random weights; a router bias of a few tenths (the sigmoid scores it shifts lie near
    0.5), so that it changes which experts and groups win."""
    weights = random_weights(llada2_shapes(c), seed, torch.float32)
    for key, w in weights.items():
        if key.endswith("expert_bias"):
            weights[key] = w * 2
    return weights


def write_llada2(
    path,
    *,
    seed: int = 0,
    shards: int = 2,
    mask_token_id: int = 156895,
    model_type: str = "llada2_moe",
    **widths,
) -> Path:
    """A tiny LLaDA2.0-mini folder (``widths``: ``llada2_config``'s; ``mask_token_id`` moves
    ``<|mask|>`` in the tokenizer; ``model_type`` "llada21_moe" for LLaDA2.1)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = llada2_config(**widths) | {"model_type": model_type}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_weights(path, llada2_weights(config, seed), shards)
    write_moe_tokenizer(path, mask_token_id)
    poison(path, ["configuration_llada2_moe", "modeling_llada2_moe"])
    return path
