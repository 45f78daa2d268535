"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B-Base, -Instruct) on transformers' own classes.

LLaDA-MoE's modeling code is OLMoE's block with Qwen3's attention: per-head q/k RMSNorm before
rotate-half RoPE, no bias, grouped KV heads, and every MLP (or the layers ``moe_layer_freq``
marks 1) a sparse mixture of SwiGLU experts: a bias-free linear router, softmax over all
experts in fp32, the top k kept *without* renormalising (its code hard-codes
``norm_topk_prob = False``, whatever config.json says), each chosen expert's output weighted by
its probability. That is transformers' Qwen3 body with a sparse MoE block in place of each
MLP: the model is ``Qwen3ForCausalLM`` (bidirectional, as ``daca.models.native`` runs every
family) whose MLPs are ``_SparseMoeBlock``, a router and the experts in a few lines of our own
(transformers' Qwen3-MoE block fuses its experts and renormalises by a config flag).

The experts stay one ``Qwen3MoeMLP`` (three ``nn.Linear``) each, as the checkpoint stores them
(``mlp.experts.<j>.{gate,up,down}_proj``), not transformers' fused 3-D expert tensors: so the
hub keys load as they are, PEFT's LoRA targets ``gate_proj``/``up_proj``/``down_proj`` reach
every expert, and 4-bit loading quantises them like any projection. Being a
``Qwen3ForCausalLM``, it takes ``logits_to_keep`` and the block KV cache (daca.core).

Options of LLaDA-MoE's config this mapping does not reproduce (a shared expert, partial RoPE,
q/k/v clipping, RoPE scaling, no q/k norm) are refused in one line by ``moe_config_problem``,
before any weight loads; ``moe_router_enable_expert_bias`` is reproduced (the bias is added to
the softmax probabilities before the top k, and stays in the kept weights, as its code does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

from daca.models.native import _Bidirectional, _bidirectional_config, _HubLayout, rename_keys

# The config.json keys the translation reads (dllm's LLaDAMoEConfig names).
MOE_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "expert_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "vocab_size",
    "rope_theta",
)
# Options whose other values LLaDA-MoE's code runs differently from this mapping: key ->
# the values this mapping reproduces (a missing key reads as the first).
_MOE_REQUIRED_VALUES = {
    "shared_expert_intermediate_size": (None,),  # a shared expert beside the routed ones
    "clip_qkv": (None,),
    "rope_scaling": (None,),
    "partial_rotary_factor": (1.0, 1, None),  # RoPE on part of each head
    "qk_layernorm": (True,),  # transformers' Qwen3 attention always has the q/k norms
    "hidden_act": ("silu",),
}


def moe_config_problem(hub: dict) -> str | None:
    """What makes a LLaDA-MoE config.json one this mapping cannot run exactly, or None."""
    missing = [key for key in MOE_REQUIRED if key not in hub]
    if missing:
        return f"a LLaDA-MoE config.json that lacks {missing}"
    for key, allowed in _MOE_REQUIRED_VALUES.items():
        if hub.get(key, allowed[0]) not in allowed:
            return f"this LLaDA-MoE config sets {key}={hub[key]!r}, which daca does not run"
    d, heads = int(hub["hidden_size"]), int(hub["num_attention_heads"])
    if hub.get("head_dim") not in (None, d // heads):  # its code's head width is d / heads
        return f"this LLaDA-MoE config sets head_dim={hub['head_dim']}, not {d // heads}"
    freq = _layer_kinds(hub)
    if len(freq) != int(hub["num_hidden_layers"]) or set(freq) - {0, 1}:
        return f"moe_layer_freq={hub.get('moe_layer_freq')!r} is not one 0/1 per layer"
    if 0 in freq and not hub.get("dense_intermediate_size"):
        return "moe_layer_freq names dense layers but dense_intermediate_size is not set"
    return None


def _layer_kinds(hub: dict) -> list[int]:
    """1 for a mixture-of-experts layer, 0 for a dense one (missing: every layer MoE)."""
    return list(hub.get("moe_layer_freq") or [1] * int(hub["num_hidden_layers"]))


def llada_moe_config(hub: dict, **overrides) -> Qwen3Config:
    """Qwen3 config, with Qwen3-MoE's expert fields, of a LLaDA-MoE ``config.json`` mapping."""
    if problem := moe_config_problem(hub):
        raise ValueError(problem)
    d, heads = int(hub["hidden_size"]), int(hub["num_attention_heads"])
    experts = int(hub["expert_intermediate_size"])
    config = Qwen3Config(
        vocab_size=int(hub["vocab_size"]),
        hidden_size=d,
        intermediate_size=int(hub.get("dense_intermediate_size") or experts),  # dense layers
        num_hidden_layers=int(hub["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(hub.get("num_key_value_heads") or heads),
        head_dim=d // heads,
        hidden_act="silu",
        max_position_embeddings=int(hub.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(hub.get("rms_norm_eps", 1e-5)),
        rope_parameters={"rope_type": "default", "rope_theta": float(hub["rope_theta"])},
        attention_bias=bool(hub.get("attention_bias", False)),
        attention_dropout=float(hub.get("attention_dropout", 0.0)),
        tie_word_embeddings=bool(hub.get("tie_word_embeddings", False)),
        use_sliding_window=False,
        sliding_window=None,
        pad_token_id=None,  # an embedding padding_idx would freeze the pad row
        eos_token_id=hub.get("eos_token_id"),
        bos_token_id=hub.get("bos_token_id"),
        # Read by _SparseMoeBlock and LLaDAMoEForDiffusionLM's layers (Qwen3-MoE's names).
        num_experts=int(hub["num_experts"]),
        num_experts_per_tok=int(hub["num_experts_per_tok"]),
        moe_intermediate_size=experts,
        norm_topk_prob=False,  # LLaDA-MoE's code never renormalises the top k
        mlp_only_layers=[i for i, kind in enumerate(_layer_kinds(hub)) if kind == 0],
        router_expert_bias=bool(hub.get("moe_router_enable_expert_bias")),
        **overrides,
    )
    return _bidirectional_config(config, hub)


# Fields of LLaDA-MoE's config.json that a model made from scratch writes: enough for its own
# code (dllm's LLaDAMoEConfig) to build the same model.
_MOE_DEFAULTS = {
    "model_type": "llada",
    "architectures": ["LLaDAMoEModelLM"],
    "attention_bias": False,
    "clip_qkv": None,
    "hidden_act": "silu",
    "moe_router_enable_expert_bias": False,
    "norm_topk_prob": False,
    "partial_rotary_factor": 1.0,
    "qk_layernorm": True,
    "rope_scaling": None,
    "shared_expert_intermediate_size": None,
}


def llada_moe_hub_config(config: Qwen3Config) -> dict:
    """The LLaDA-MoE ``config.json`` of the model's config: the original fields, sizes from
    ``config``."""
    hub = dict(getattr(config, "hub_config", None) or _MOE_DEFAULTS)
    hub.update(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        dense_intermediate_size=config.intermediate_size,
        expert_intermediate_size=config.moe_intermediate_size,
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_layer_freq=[
            int(i not in config.mlp_only_layers) for i in range(config.num_hidden_layers)
        ],
        rope_theta=(config.rope_parameters or {}).get("rope_theta", hub.get("rope_theta")),
        tie_word_embeddings=bool(config.tie_word_embeddings),
    )
    return hub


# ----------------------------------------------------------------------------- modules
class _Experts(nn.ModuleList):
    """The routed experts, one ``Qwen3MoeMLP`` each (the hub's ``experts.<j>.*_proj``): each
    expert on the tokens routed to it, weighted, summed (transformers' eager expert loop, with
    the tokens grouped by one sort). One nn.Linear triple per expert, as the checkpoint stores
    them, so that PEFT adapts and bitsandbytes quantises each expert as it does any projection."""

    def __init__(self, config):
        super().__init__(
            Qwen3MoeMLP(config, intermediate_size=config.moe_intermediate_size)
            for _ in range(config.num_experts)
        )

    def forward(self, hidden_states, top_k_index, top_k_weights):
        # One stable sort groups the (token, slot) pairs by expert and one host sync reads the
        # group sizes, instead of a scan of every pair and a sync per expert: the same pairs in
        # the same order per expert, so the same sums to the bit (bench_moe_experts.py).
        k = top_k_index.shape[1]
        order = top_k_index.flatten().argsort(stable=True)
        counts = torch.bincount(top_k_index.flatten(), minlength=len(self)).tolist()
        tokens, weights = order // k, top_k_weights.flatten()[order, None]
        out = torch.zeros_like(hidden_states)
        start = 0
        for j, n in enumerate(counts):
            if n:
                token = tokens[start : start + n]
                y = self[j](hidden_states[token]) * weights[start : start + n]
                out.index_add_(0, token, y.to(out.dtype))
                start += n
        return out


class _Router(nn.Module):
    """LLaDA-MoE's router: a bias-free linear, softmax over every expert in fp32, the top k
    kept unrenormalised; with ``moe_router_enable_expert_bias`` its ``expert_bias`` is added
    to the probabilities before the top k and stays in the kept weights, as its code does."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        nn.init.normal_(self.weight, std=config.initializer_range)  # a model made from scratch
        if config.router_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        else:
            self.expert_bias = None

    def forward(self, hidden_states):
        """Top-k weights and expert indices [N, k] of tokens [N, d]."""
        logits = F.linear(hidden_states, self.weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        if self.expert_bias is not None:
            probs = probs + self.expert_bias
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        return weights.to(logits.dtype), index


class _SparseMoeBlock(nn.Module):
    """A sparse MoE layer: each token through its top-k experts, weighted by the router (the
    hub's ``mlp.gate`` and ``mlp.experts``). Ours, not transformers' Qwen3-MoE block, whose
    fused expert tensors and internal call signatures change between releases."""

    def __init__(self, config):
        super().__init__()
        self.gate = _Router(config)
        self.experts = _Experts(config)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        weights, index = self.gate(tokens)
        return self.experts(tokens, index, weights).reshape(shape)


# The router's bias: a buffer of the block in LLaDA-MoE's code, of the router here.
_BIAS_FROM_HUB = {r"\.mlp\.expert_bias$": ".mlp.gate.expert_bias"}
_BIAS_TO_HUB = {r"\.mlp\.gate\.expert_bias$": ".mlp.expert_bias", r"^": ""}  # rest: unchanged


class LLaDAMoEForDiffusionLM(_HubLayout, _Bidirectional, Qwen3ForCausalLM):
    """transformers' ``Qwen3ForCausalLM`` with sparse MoE blocks, run as LLaDA-MoE:
    bidirectional, positions from the attention mask, saved in LLaDA-MoE's hub layout."""

    hub_config_of = staticmethod(llada_moe_hub_config)
    to_hub_keys = _BIAS_TO_HUB

    def __init__(self, config):
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            dense = i in config.mlp_only_layers
            layer.mlp = Qwen3MLP(config) if dense else _SparseMoeBlock(config)

    def load_state_dict(self, state_dict, *args, **kwargs):
        """Also takes the hub's name of the router bias (a checkpoint this class wrote, read
        back by code that loads state dicts itself)."""
        if any(key.endswith(".mlp.expert_bias") for key in state_dict):
            state_dict = rename_keys(state_dict, _BIAS_FROM_HUB | {r"^": ""})
        return super().load_state_dict(state_dict, *args, **kwargs)
