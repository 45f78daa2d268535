"""Tiny checkpoint folders laid out like dllm's A2D models (autoregressive models turned into
masked diffusion LMs: ``dllm/pipelines/a2d``).

dllm's ``a2d/convert.py`` loads the AR model, drops its ``auto_map`` and ``architectures``,
builds the ``A2D*Config`` from the AR config's fields (its only change: ``model_type``
``a2d-qwen3`` / ``a2d-llama``) and saves ``A2D*LMHeadModel`` with transformers'
``save_pretrained``: the AR state-dict keys unchanged, ``architectures`` the A2D class's, a
tied head stored once. Its tokenizer gets ``<|mask|>`` added as a new special token (the next
free id; ``dllm.utils.models.get_tokenizer``), which training saves beside the weights.

``write_a2d_qwen3`` mirrors ``dllm-hub/Qwen3-0.6B-diffusion-mdlm-v0.1`` (Qwen3-0.6B's
config.json keys, vocabulary 151936, tied head, per-head q/k RMSNorm, explicit ``head_dim``);
``write_a2d_qwen2`` mirrors ``dllm-hub/Qwen2.5-Coder-0.5B-Instruct-diffusion-mdlm-v0.1``
(Qwen2.5-Coder-0.5B-Instruct's keys, q/k/v biases, tied head);
``write_a2d_llama`` mirrors an A2D Llama-3.2-1B (Llama 3.2's config keys, its llama3 RoPE
scaling, tied head). Only the widths are tiny. The Llama 3 tokenizer fills its 128256
embedding rows, so the added ``<|mask|>`` (128256) needs a larger embedding: the tiny folder's
is 128320 rows (the tokenizer padded to a multiple of 64, as ``resize_token_embeddings``
with ``pad_to_multiple_of=64`` makes it). A poisoned ``modeling_*.py`` lies beside each, as
in ``_hub``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from _hub import poison, random_weights, write_tokenizer, write_weights

# Qwen3's ChatML ending as its template writes it: with enable_thinking=False (dllm's default)
# the generation prompt carries an empty think block.
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

QWEN3_SPECIALS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<think>": 151667,
    "</think>": 151668,
    "<|mask|>": 151669,  # added by dllm: the Qwen3 tokenizer's ids end at 151668
}
QWEN25_SPECIALS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|mask|>": 151665,  # added by dllm: the Qwen2.5 tokenizer's ids end at 151664
}
LLAMA3_SPECIALS = {
    "<|begin_of_text|>": 128000,
    "<|end_of_text|>": 128001,
    "<|start_header_id|>": 128006,
    "<|end_header_id|>": 128007,
    "<|eot_id|>": 128009,
    "<|mask|>": 128256,  # added by dllm: the Llama 3 tokenizer's ids end at 128255
}
LLAMA3_ROPE_SCALING = {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def a2d_qwen3_config(
    *, hidden_size=32, heads=4, kv_heads=2, head_dim=16, layers=2, intermediate_size=64
) -> dict:
    """Qwen3-0.6B's config.json as dllm's A2D conversion writes it (real: 1024, 16, 8, 128, 28,
    3072)."""
    return {
        "architectures": ["A2DQwen3LMHeadModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "a2d-qwen3",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "transformers_version": "4.57.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


def a2d_qwen2_config(*, hidden_size=32, heads=4, kv_heads=2, layers=2, intermediate_size=64):
    """Qwen2.5-Coder-0.5B-Instruct's config.json as dllm's A2D conversion writes it (real: 896,
    14, 2, 24, 4864)."""
    return {
        "architectures": ["A2DQwen2LMHeadModel"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "model_type": "a2d-qwen2",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "transformers_version": "4.57.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


def a2d_llama_config(
    *,
    hidden_size=32,
    heads=4,
    kv_heads=2,
    head_dim=8,
    layers=2,
    intermediate_size=64,
    vocab_size=128320,
) -> dict:
    """Llama-3.2-1B's config.json as dllm's A2D conversion writes it (real: 2048, 32, 8, 64, 16,
    8192; vocabulary 128256, here 128320 for the added mask)."""
    return {
        "architectures": ["A2DLlamaLMHeadModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "a2d-llama",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": dict(LLAMA3_ROPE_SCALING),
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "transformers_version": "4.57.1",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def attention_shapes(prefix: str, d: int, q: int, kv: int) -> dict[str, tuple[int, ...]]:
    """A Llama/Qwen layer's norms and attention projections (``prefix``: ``model.layers.N.``)."""
    return {
        prefix + "input_layernorm.weight": (d,),
        prefix + "self_attn.q_proj.weight": (q, d),
        prefix + "self_attn.k_proj.weight": (kv, d),
        prefix + "self_attn.v_proj.weight": (kv, d),
        prefix + "self_attn.o_proj.weight": (d, q),
        prefix + "post_attention_layernorm.weight": (d,),
    }


def a2d_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """The AR class's state-dict keys (Qwen3: q_norm/k_norm over a head; Llama: neither) and
    their shapes; a tied head is not stored."""
    d, v, f = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    hd = c.get("head_dim") or d // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, d)}
    for i in range(c["num_hidden_layers"]):
        b = f"model.layers.{i}."
        shapes.update(attention_shapes(b, d, q, kv))
        shapes.update(
            {
                b + "mlp.gate_proj.weight": (f, d),
                b + "mlp.up_proj.weight": (f, d),
                b + "mlp.down_proj.weight": (d, f),
            }
        )
        if c["model_type"] == "a2d-qwen3":
            shapes[b + "self_attn.q_norm.weight"] = (hd,)
            shapes[b + "self_attn.k_norm.weight"] = (hd,)
        if c["model_type"] == "a2d-qwen2":  # Qwen2's q/k/v biases
            shapes.update(
                {
                    b + f"self_attn.{x}_proj.bias": (n,)
                    for x, n in zip("qkv", (q, kv, kv), strict=True)
                }
            )
    shapes["model.norm.weight"] = (d,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    return shapes


# tokenizer_config.json of the Qwen A2D models (Qwen3's and Qwen2.5's tokenizers alike).
CHATML_TOKENIZER = {
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "mask_token": "<|mask|>",
    "chat_template": QWEN3_CHAT_TEMPLATE,
    "errors": "replace",
    "split_special_tokens": False,
}


def _write(path, config, specials, tokenizer_config, module, seed, shards) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_weights(path, random_weights(a2d_shapes(config), seed, torch.float32), shards)
    write_tokenizer(path, specials, tokenizer_config)
    poison(path, [module])
    return path


def write_a2d_qwen3(
    path, *, seed: int = 0, shards: int = 1, mask_token_id: int = 151669, **widths
) -> Path:
    """A tiny dllm-hub/Qwen3-0.6B-diffusion-mdlm-v0.1 folder (``mask_token_id`` moves
    ``<|mask|>`` in the tokenizer, to test that the id is read, not assumed)."""
    tokenizer = CHATML_TOKENIZER
    config = a2d_qwen3_config(**widths)
    specials = {**QWEN3_SPECIALS, "<|mask|>": mask_token_id}
    return _write(path, config, specials, tokenizer, "modeling_qwen3", seed, shards)


def write_a2d_qwen2(
    path, *, seed: int = 0, shards: int = 1, mask_token_id: int = 151665, **widths
) -> Path:
    """A tiny dllm-hub/Qwen2.5-Coder-0.5B-Instruct-diffusion-mdlm-v0.1 folder (see
    ``write_a2d_qwen3`` for ``mask_token_id``)."""
    tokenizer = CHATML_TOKENIZER  # the same ChatML; Qwen2.5 has no think block
    config = a2d_qwen2_config(**widths)
    specials = {**QWEN25_SPECIALS, "<|mask|>": mask_token_id}
    return _write(path, config, specials, tokenizer, "modeling_qwen2", seed, shards)


def write_a2d_llama(
    path, *, seed: int = 0, shards: int = 1, mask_token_id: int = 128256, **widths
) -> Path:
    """A tiny A2D Llama-3.2-1B folder (Llama 3 tokenizer: no pad token, EOS pads; see
    ``write_a2d_qwen3`` for ``mask_token_id``)."""
    tokenizer = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "mask_token": "<|mask|>",
        "chat_template": LLAMA3_CHAT_TEMPLATE,
    }
    config = a2d_llama_config(**widths)
    specials = {**LLAMA3_SPECIALS, "<|mask|>": mask_token_id}
    return _write(path, config, specials, tokenizer, "modeling_llama", seed, shards)
