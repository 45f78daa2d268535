"""LLaDA 2.x (inclusionAI/LLaDA2.0-mini, -flash, LLaDA2.1-*) on transformers' own classes.

LLaDA 2.x's modeling code (dllm's ``modeling_llada2_moe.py`` and ``modeling_llada21_moe.py``,
the same network) is Ling 2.0's MoE block, which is transformers' GLM-4.5 MoE block
(``Glm4MoeForCausalLM``) in all but the layout of its weights:

- attention: grouped KV heads, per-head RMSNorm on q and k before RoPE, rotate-half RoPE on the
  first ``partial_rotary_factor`` of each head; the checkpoint stores q, k and v as one fused
  ``query_key_value`` projection and the output projection as ``dense`` (with a bias when
  ``use_bias``). ``_FusedAttention`` keeps that layout (so hub keys, LoRA target names and 4-bit
  loading are the checkpoint's) and calls transformers' RoPE and attention functions;
- MLPs: the first ``first_k_dense_replace`` layers dense SwiGLU, the others a sparse mixture of
  SwiGLU experts plus shared experts, routed by a sigmoid of a bias-free linear in fp32: the
  ``expert_bias`` is added for the choice only, the choice group-limited (``n_group`` groups
  scored by their two best experts, ``topk_group`` kept), the kept weights renormalised when
  k > 1 and scaled by ``routed_scaling_factor`` (``_GroupRouter``, ``_MoeBlock``: ours, one
  ``nn.Linear`` triple per expert as the checkpoint stores them; transformers' GLM block fuses
  its experts into 3-D tensors);
- attention pattern: **block-causal**. LLaDA 2.x is a block diffusion model: a position attends
  to every position of its own block and of the blocks before it, never to a later block
  (dllm's ``LLaDA2Sampler`` builds that mask; the model is trained with it). Here the forward
  builds it itself, from the padding mask, so every caller (the sampler, the update's
  likelihoods, TRL) runs the family's pattern (``daca.core.modeling.block_causal_mask``).

Blocks are ``attention_block`` (32, dllm's and inclusionAI's default) positions counted from
each row's first token (``attention_anchor`` "start"), as LLaDA 2.x's ``generate`` cuts
prompt ++ completion; daca pads its prompts to whole blocks (``daca.models.prompts
.pad_prompts``) so that the completion begins a block (docs/scale.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRMSNorm, apply_rotary_pos_emb
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

from daca.models.native import _Bidirectional, _bidirectional_config, _HubLayout
from daca.models.native_moe import _Experts

ATTENTION_BLOCK = 32  # LLaDA 2.x's block (dllm's LLaDA2SamplerConfig.block_size)

# The config.json keys the translation reads (dllm's LLaDA2MoeConfig names).
LLADA2_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "vocab_size",
)
# Options whose other values LLaDA 2.x's code runs differently from this mapping (a missing
# key reads as the first value).
_LLADA2_REQUIRED_VALUES = {
    "rope_scaling": (None,),
    "hidden_act": ("silu",),
    "use_sliding_window": (False,),  # its sliding_window never reaches SDPA; refused to be sure
}


def llada2_config_problem(hub: dict) -> str | None:
    """What makes a LLaDA 2.x config.json one this mapping cannot run exactly, or None."""
    missing = [key for key in LLADA2_REQUIRED if key not in hub]
    if missing:
        return f"a LLaDA 2.x config.json that lacks {missing}"
    for key, allowed in _LLADA2_REQUIRED_VALUES.items():
        if hub.get(key, allowed[0]) not in allowed:
            return f"this LLaDA 2.x config sets {key}={hub[key]!r}, which daca does not run"
    experts, groups = int(hub["num_experts"]), int(hub.get("n_group") or 1)
    if experts % groups or not 1 <= int(hub.get("topk_group") or 1) <= groups:
        return (
            f"n_group={groups} / topk_group={hub.get('topk_group')} do not split {experts} experts"
        )
    if hub.get("num_shared_experts") == 0:  # its code then builds zero-width shared experts
        return "num_shared_experts=0 (zero-width shared experts), which daca does not run"
    if int(hub.get("first_k_dense_replace") or 0) and not hub.get("intermediate_size"):
        return "first_k_dense_replace names dense layers but intermediate_size is not set"
    return None


class LLaDA2Config(Glm4MoeConfig):
    """GLM-4.5-MoE's config under LLaDA 2.x's own model type: transformers and PEFT convert
    "glm4_moe" checkpoints' per-expert weights into fused expert tensors, a layout LLaDA 2.x's
    checkpoints, and these per-expert modules, do not have."""

    model_type = "llada2_moe"


def llada2_config(hub: dict, **overrides) -> LLaDA2Config:
    """GLM-4.5-MoE config of a LLaDA 2.x ``config.json`` (with daca's fields for the layout)."""
    if problem := llada2_config_problem(hub):
        raise ValueError(problem)
    d, heads = int(hub["hidden_size"]), int(hub["num_attention_heads"])
    shared = hub.get("num_shared_experts")
    config = LLaDA2Config(
        vocab_size=int(hub["vocab_size"]),
        hidden_size=d,
        intermediate_size=int(hub.get("intermediate_size") or hub["moe_intermediate_size"]),
        num_hidden_layers=int(hub["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(hub.get("num_key_value_heads") or heads),
        head_dim=int(hub.get("head_dim") or d // heads),
        hidden_act="silu",
        max_position_embeddings=int(hub.get("max_position_embeddings", 16384)),
        rms_norm_eps=float(hub.get("rms_norm_eps", 1e-5)),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(hub.get("rope_theta", 10000.0)),
            "partial_rotary_factor": float(hub.get("partial_rotary_factor", 0.5)),
        },
        attention_bias=bool(hub.get("use_qkv_bias", False)),
        attention_dropout=float(hub.get("attention_dropout", 0.0)),
        tie_word_embeddings=bool(hub.get("tie_word_embeddings", False)),
        use_qk_norm=bool(hub.get("use_qk_norm", True)),
        n_routed_experts=int(hub["num_experts"]),
        num_experts_per_tok=int(hub["num_experts_per_tok"]),
        moe_intermediate_size=int(hub["moe_intermediate_size"]),
        n_shared_experts=1,  # GLM's own MoE blocks (replaced by _MoeBlock) always have one
        n_group=int(hub.get("n_group") or 1),
        topk_group=int(hub.get("topk_group") or 1),
        routed_scaling_factor=float(hub.get("routed_scaling_factor", 2.5)),
        first_k_dense_replace=int(hub.get("first_k_dense_replace") or 0),
        pad_token_id=None,  # an embedding padding_idx would freeze the pad row
        eos_token_id=hub.get("eos_token_id"),
        bos_token_id=hub.get("bos_token_id"),
        **overrides,
    )
    config.num_experts = config.n_routed_experts  # read by native_moe._Experts
    config.shared_experts = int(shared or 0)  # read by _MoeBlock
    config.output_bias = bool(hub.get("use_bias", True))  # the attention's dense bias
    config = _bidirectional_config(config, hub)  # reads a checkpoint's attention_block_size
    if config.attention_block is None:
        config.attention_block = ATTENTION_BLOCK  # LLaDA 2.x attends in blocks whatever it says
    config.attention_anchor = "start"  # its generate cuts prompt ++ completion from position 0
    return config


# Fields of LLaDA 2.x's config.json that a model made from scratch writes: enough for its own
# code (dllm's LLaDA2MoeConfig) to build the same model.
_LLADA2_DEFAULTS = {
    "model_type": "llada2_moe",
    "architectures": ["LLaDA2MoeModelLM"],
    "hidden_act": "silu",
    "rope_scaling": None,
    "use_sliding_window": False,
}


def llada2_hub_config(config: LLaDA2Config) -> dict:
    """The LLaDA 2.x ``config.json`` of the model's config: the original fields, sizes from
    ``config``."""
    hub = dict(getattr(config, "hub_config", None) or _LLADA2_DEFAULTS)
    rope = config.rope_parameters or {}
    hub.update(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        num_experts=config.n_routed_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        num_shared_experts=config.shared_experts or None,
        n_group=config.n_group,
        topk_group=config.topk_group,
        routed_scaling_factor=config.routed_scaling_factor,
        first_k_dense_replace=config.first_k_dense_replace,
        use_qkv_bias=config.attention_bias,
        use_bias=config.output_bias,
        use_qk_norm=config.use_qk_norm,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=rope.get("rope_theta", hub.get("rope_theta")),
        partial_rotary_factor=rope.get("partial_rotary_factor", 0.5),
        tie_word_embeddings=bool(config.tie_word_embeddings),
    )
    if config.attention_block != ATTENTION_BLOCK:
        hub["attention_block_size"] = config.attention_block
    return hub


# ----------------------------------------------------------------------------- modules
class _FusedAttention(nn.Module):
    """LLaDA 2.x's attention in its checkpoint's layout (``query_key_value``, q/k norms named
    ``query_layernorm``/``key_layernorm``, ``dense``), computed as transformers' GLM-4.5 MoE
    attention computes it: q, k, v split by heads, q/k RMSNorm, partial rotate-half RoPE, the
    KV cache's update, then transformers' SDPA attention function."""

    is_causal = False

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = config.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_key_value_groups = self.heads // self.kv_heads  # read by the attention function
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        width = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.query_key_value = nn.Linear(config.hidden_size, width, bias=config.attention_bias)
        if config.use_qk_norm:
            self.query_layernorm = Glm4MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.key_layernorm = Glm4MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.dense = nn.Linear(
            self.heads * self.head_dim, config.hidden_size, bias=config.output_bias
        )

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        shape = hidden_states.shape[:-1]
        qkv = self.query_key_value(hidden_states).view(*shape, -1, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=-2)
        if self.config.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        # SDPA whatever attn_implementation says: block-causal attention needs its mask, which
        # flash attention's varlen path would drop.
        out, weights = sdpa_attention_forward(
            self, q, k, v, attention_mask,
            dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
            **kwargs,
        )  # fmt: skip
        return self.dense(out.reshape(*shape, -1).contiguous()), weights


class _GroupRouter(nn.Module):
    """LLaDA 2.x's router (its ``LLaDA2MoeGate``): sigmoid scores of a bias-free linear in fp32;
    the choice, on scores + ``expert_bias``, limited to the ``topk_group`` groups whose two best
    experts score highest; the chosen experts' scores (without the bias) renormalised when
    k > 1 and scaled by ``routed_scaling_factor``."""

    def __init__(self, config):
        super().__init__()
        self.top_k, self.groups = config.num_experts_per_tok, config.n_group
        self.topk_group, self.scale = config.topk_group, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        nn.init.normal_(self.weight, std=config.initializer_range)  # a model made from scratch
        self.register_buffer("expert_bias", torch.zeros(config.n_routed_experts))

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Top-k weights and expert indices [N, k] of tokens [N, d]."""
        scores = torch.sigmoid(F.linear(tokens.float(), self.weight.float()))
        choice = scores + self.expert_bias
        per_group = choice.view(len(tokens), self.groups, -1)
        group_scores = per_group.topk(2, dim=-1)[0].sum(-1)
        kept = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        in_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~in_kept.repeat_interleave(per_group.shape[-1], 1), -torch.inf)
        index = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, index)
        if self.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return (weights * self.scale).to(tokens.dtype), index


class _MoeBlock(nn.Module):
    """A sparse MoE layer: each token through its top-k experts, weighted by the router, plus
    the shared experts on every token (the hub's ``mlp.gate``, ``mlp.experts``,
    ``mlp.shared_experts``)."""

    def __init__(self, config):
        super().__init__()
        self.gate = _GroupRouter(config)
        self.experts = _Experts(config)
        width = config.moe_intermediate_size * config.shared_experts
        self.shared_experts = Qwen3MoeMLP(config, intermediate_size=width) if width else None

    def forward(self, hidden_states):
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        weights, index = self.gate(tokens)
        out = self.experts(tokens, index, weights).reshape(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


# Hub key (regex) -> this class's key, for ``from_pretrained(key_mapping=...)``, and back.
LLADA2_KEYS = {
    r"^model\.word_embeddings\.": "model.embed_tokens.",
    r"^model\.layers\.(\d+)\.attention\.": r"model.layers.\1.self_attn.",
}
_TO_LLADA2 = {
    r"^model\.embed_tokens\.": "model.word_embeddings.",
    r"^model\.layers\.(\d+)\.self_attn\.": r"model.layers.\1.attention.",
    r"^": "",  # every other key: the same name
}


class LLaDA2ForDiffusionLM(_HubLayout, _Bidirectional, Glm4MoeForCausalLM):
    """transformers' ``Glm4MoeForCausalLM`` with LLaDA 2.x's fused attention and MoE blocks,
    run block-causally in blocks of ``attention_block`` (``_Bidirectional``: the forward builds
    the mask from the padding mask, ``daca.core.modeling.block_causal_mask``), positions from
    the attention mask, saved in LLaDA 2.x's hub layout. Being a ``Glm4MoeForCausalLM``, it
    takes ``logits_to_keep`` and transformers' caches (the sampler's block cache, which lays
    out a block-causal mask over the keys it stores)."""

    hub_config_of = staticmethod(llada2_hub_config)
    to_hub_keys = _TO_LLADA2

    def __init__(self, config):
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = _FusedAttention(config, i)
            if i >= config.first_k_dense_replace:
                layer.mlp = _MoeBlock(config)
