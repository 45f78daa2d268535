"""Tiny checkpoint folders laid out like inclusionAI/LLaDA-MoE-7B-A1B-Base / -Instruct.

config.json: the keys of the hub's ``configuration_lladamoe.py`` (dllm's ``LLaDAMoEConfig``,
``model_type`` "llada" as on the hub), the vocabulary of 157184 rows, EOS 156892 and the mask
156895 (the ids dllm's and dInfer's code pass for LLaDA-MoE); only the widths are tiny.
Weights: the state-dict keys of its ``LLaDAMoEModelLM`` (OLMoE's names: ``mlp.gate`` the
router, ``mlp.experts.<j>.{gate,up,down}_proj`` the experts, per-head ``self_attn.q_norm`` /
``k_norm``; ``mlp.expert_bias`` where ``moe_router_enable_expert_bias``). The tokenizer: a
byte-level stand-in with LLaDA-MoE's specials at those ids (``<|role_end|>``'s id and the
chat template's role markers are stand-ins: this suite could not read the hub's tokenizer).
Poisoned ``configuration_lladamoe.py`` / ``modeling_lladamoe.py`` lie beside them, as in
``_hub``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from _hub import poison, random_weights, write_tokenizer, write_weights
from _hub_a2d import attention_shapes

MOE_SPECIALS = {
    "<|endoftext|>": 156892,
    "<|mask|>": 156895,
    "<|role_end|>": 156900,  # a stand-in id
}
# A stand-in for the Instruct tokenizer's template: turns closed by <|role_end|>.
MOE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<role>' + message['role'] | upper + '</role>' + message['content'] + '<|role_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<role>ASSISTANT</role>' }}{% endif %}"
)


def llada_moe_config(
    *,
    hidden_size=32,
    heads=4,
    kv_heads=2,
    layers=2,
    experts=4,
    top_k=2,
    expert_size=16,
    dense_size=64,
    moe_layer_freq=None,
    expert_bias=False,
    tied=False,
) -> dict:
    """LLaDA-MoE-7B-A1B's config.json fields, tiny widths (2 layers, 4 experts, top 2)."""
    return {
        "architectures": ["LLaDAMoEModelLM"],
        "auto_map": {
            "AutoConfig": "configuration_lladamoe.LLaDAConfig",
            "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
            "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM",
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "clip_qkv": None,
        "dense_intermediate_size": dense_size,
        "eos_token_id": 156892,
        "expert_intermediate_size": expert_size,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "max_position_embeddings": 8192,
        "model_type": "llada",
        "moe_layer_freq": moe_layer_freq or [1] * layers,
        "moe_router_enable_expert_bias": expert_bias,
        "moe_router_score_function": "softmax",
        "norm_topk_prob": True,  # its code ignores it: the top k are never renormalised
        "num_attention_heads": heads,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "output_router_logits": False,
        "pad_token_id": 156892,
        "partial_rotary_factor": 1.0,
        "qk_layernorm": True,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 50000.0,
        "router_aux_loss_coef": 0.01,
        "routed_scaling_factor": 1,
        "shared_expert_intermediate_size": None,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "transformers_version": "4.47.1",
        "use_cache": False,
        "vocab_size": 157184,
    }


def llada_moe_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """LLaDAMoEModelLM's state-dict keys and shapes (a tied head is stored once)."""
    d, v = c["hidden_size"], c["vocab_size"]
    hd = d // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, d)}
    for i, kind in enumerate(c["moe_layer_freq"]):
        b = f"model.layers.{i}."
        shapes.update(attention_shapes(b, d, q, kv))
        shapes[b + "self_attn.q_norm.weight"] = (hd,)
        shapes[b + "self_attn.k_norm.weight"] = (hd,)
        mlps = [("mlp.", c["dense_intermediate_size"])]
        if kind:
            shapes[b + "mlp.gate.weight"] = (c["num_experts"], d)
            if c["moe_router_enable_expert_bias"]:
                shapes[b + "mlp.expert_bias"] = (c["num_experts"],)
            f = c["expert_intermediate_size"]
            mlps = [(f"mlp.experts.{j}.", f) for j in range(c["num_experts"])]
        for prefix, f in mlps:
            shapes.update(swiglu_shapes(b + prefix, f, d))
    return shapes | head_shapes(c, d, v)


def swiglu_shapes(prefix: str, f: int, d: int) -> dict[str, tuple[int, ...]]:
    """One SwiGLU MLP's (an expert's, a shared or a dense one) projections of width ``f``."""
    return {
        prefix + "gate_proj.weight": (f, d),
        prefix + "up_proj.weight": (f, d),
        prefix + "down_proj.weight": (d, f),
    }


def head_shapes(c: dict, d: int, v: int) -> dict[str, tuple[int, ...]]:
    """The final norm and, unless tied to the embedding, the output head."""
    return {"model.norm.weight": (d,)} | (
        {} if c["tie_word_embeddings"] else {"lm_head.weight": (v, d)}
    )


def moe_weights(c: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random weights; a router bias of a few hundredths (the softmax probabilities it shifts
    are ~1/E), so that it changes which experts win."""
    weights = random_weights(llada_moe_shapes(c), seed, torch.float32)
    for key, w in weights.items():
        if key.endswith("expert_bias"):
            weights[key] = w / 5
    return weights


def write_llada_moe(
    path, *, seed: int = 0, shards: int = 2, mask_token_id: int = 156895, **widths
) -> Path:
    """A tiny LLaDA-MoE-7B-A1B-Instruct folder (``widths``: ``llada_moe_config``'s;
    ``mask_token_id`` moves ``<|mask|>`` in the tokenizer, to test that the id is read)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = llada_moe_config(**widths)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_weights(path, moe_weights(config, seed), shards)
    write_moe_tokenizer(path, mask_token_id)
    poison(path, ["configuration_lladamoe", "modeling_lladamoe"])
    return path


def write_moe_tokenizer(path: Path, mask_token_id: int) -> None:
    """The stand-in tokenizer of LLaDA-MoE's and LLaDA 2.x's vocabulary (``<|mask|>`` at
    ``mask_token_id``)."""
    write_tokenizer(
        path,
        {**MOE_SPECIALS, "<|mask|>": mask_token_id},
        {
            "bos_token": None,
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "mask_token": "<|mask|>",
            "chat_template": MOE_CHAT_TEMPLATE,
        },
    )
