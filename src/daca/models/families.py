"""Per-family knowledge: the family table, LoRA targets, gradient checkpointing, model shapes.

``FAMILIES`` is the one table of the checkpoint families daca runs natively
(``daca.models.native``): which ``config.json`` model types belong to each, its mask and
end-of-turn tokens, the special ids of its public checkpoints (a check, never the source: the
loader reads the checkpoint's own), its LoRA targets and where its chat template comes from.

Shapes feed the memory estimate of ``daca train --dry-run`` (``daca.tools.memory``), which must work
from the config alone: a config.json (a local folder's, read as JSON with no remote code run; a
built-in copy of the public checkpoints' for their hub names; else the local hub cache's)
builds the model on the meta device, and the shape is read off that module.
"""

from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

# All attention and MLP projections (METHOD.md §5): every native family runs on transformers'
# Llama, Qwen2 or Qwen3, whose module names are the standard ones (LLaDA-MoE's experts too: one
# gate/up/down_proj each, daca.models.native_moe). d1 targets q, k, v only.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# The sizes a Qwen2/Qwen3/Llama-style config.json must give (LLaDA's are OLMo's names).
QWEN_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# Keys of a mixture-of-experts config.json (LLaDA-MoE's, Qwen's, Mixtral's): refused under a
# dense family's type. LLaDA-MoE's config.json says "llada" and names its experts "num_experts":
# that is the llada-moe family (family_of).
MOE_KEYS = ("num_experts", "expert_intermediate_size", "moe_intermediate_size", "num_local_experts")


@dataclass(frozen=True)
class KnownIds:
    """Special-token ids of a family's public checkpoints (METHOD.md §5 for LLaDA), used to
    check what a checkpoint with the family's vocabulary size says."""

    vocab_size: int
    mask_id: int
    eos_ids: tuple[int, ...]
    pad_ids: tuple[int, ...]  # any of them is one a public checkpoint uses


@dataclass(frozen=True)
class Family:
    """A checkpoint family daca runs on transformers' own classes (``daca.models.native``)."""

    name: str  # LoadedModel.family and daca.json's "family"; a key of native_classes.NATIVE
    model_types: tuple[str, ...]  # config.json's model_type, lower-cased
    mask_token: str  # looked up in the tokenizer when config.json names no mask_token_id
    end_tokens: tuple[str, ...]  # tokens that end a turn or a completion, beside EOS
    chat_template: str  # where the chat prompt format comes from (docs/scale.md)
    checkpoints: tuple[str, ...]  # public hub names of the family
    known_ids: KnownIds | None = None
    lora_targets: tuple[str, ...] = PROJECTIONS
    chat_kwargs: dict = field(default_factory=dict)  # extra variables the template reads
    required_keys: tuple[str, ...] = QWEN_KEYS  # config.json keys the translation reads
    # The family a config.json of this model_type belongs to when it names num_experts
    # (LLaDA-MoE's says "llada"); config_check: "module:function" of a mixture of experts'
    # own config check (config.json -> a problem or None), which replaces the dense families'
    # MoE refusal and required keys.
    with_experts: str | None = None
    config_check: str | None = None


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "llada",
            ("llada",),
            mask_token="<|mdm_mask|>",
            end_tokens=("<|eot_id|>",),
            chat_template="the tokenizer's (LLaDA-8B-Instruct: Llama 3 headers, <|eot_id|>)",
            checkpoints=("GSAI-ML/LLaDA-8B-Instruct", "GSAI-ML/LLaDA-8B-Base", "GSAI-ML/LLaDA-1.5"),
            # <|mdm_mask|>, <|endoftext|> and <|eot_id|>; the reference codes pad with EOS.
            known_ids=KnownIds(126464, 126336, (126081, 126348), (126081,)),
            required_keys=("d_model", "n_layers", "n_heads"),
            with_experts="llada-moe",
        ),
        Family(
            "dream",
            ("dream",),
            mask_token="<|mask|>",
            # <|dlm_pad|>: DiffuCoder-Instruct fills a completion's tail with it after its answer.
            end_tokens=("<|im_end|>", "<|dlm_pad|>"),
            chat_template="the tokenizer's (Qwen2.5 ChatML)",
            checkpoints=(
                "Dream-org/Dream-v0-Instruct-7B",
                "Dream-org/Dream-v0-Base-7B",
                "Dream-org/Dream-Coder-v0-Instruct-7B",
                "Dream-org/Dream-Coder-v0-Base-7B",
                "apple/DiffuCoder-7B-Base",
                "apple/DiffuCoder-7B-Instruct",
                "apple/DiffuCoder-7B-cpGRPO",
            ),
            # <|mask|>, <|endoftext|> (also pad) and <|im_end|> (Qwen2.5 tokenizer).
            known_ids=KnownIds(152064, 151666, (151643, 151645), (151643,)),
        ),
        # Autoregressive models turned into masked diffusion LMs by dllm's A2D recipe
        # (dllm/pipelines/a2d): the AR architecture, attention made bidirectional, no logit
        # shift (its MDLM trainer and sampler default to right_shift_logits=False), and
        # <|mask|> added to the AR tokenizer (a new id, so read from the tokenizer).
        Family(
            "a2d-qwen3",
            ("a2d-qwen3",),
            mask_token="<|mask|>",
            end_tokens=("<|im_end|>",),
            chat_template="the tokenizer's (Qwen3 ChatML), rendered with enable_thinking=False",
            checkpoints=("dllm-hub/Qwen3-0.6B-diffusion-mdlm-v0.1",),
            # dllm renders Qwen3's template without thinking unless asked (dllm.utils.models).
            chat_kwargs={"enable_thinking": False},
        ),
        Family(
            "a2d-qwen2",
            ("a2d-qwen2",),
            mask_token="<|mask|>",
            end_tokens=("<|im_end|>",),
            chat_template="the tokenizer's (Qwen2.5 ChatML)",
            checkpoints=("dllm-hub/Qwen2.5-Coder-0.5B-Instruct-diffusion-mdlm-v0.1",),
        ),
        Family(
            "a2d-llama",
            ("a2d-llama",),
            mask_token="<|mask|>",
            end_tokens=("<|eot_id|>",),
            chat_template="the tokenizer's (Llama 3 headers, <|eot_id|>)",
            checkpoints=(),
        ),
        # LLaDA-MoE's config.json says model_type "llada" (family_of tells it by its experts);
        # "lladamoe" is what dllm's README has users rewrite it to. Its tokenizer (LLaDA 2.x's
        # vocabulary) ends a turn with <|role_end|> (dllm.utils.models); mask 156895 and EOS
        # 156892 are the ids dllm's and dInfer's code pass for it.
        Family(
            "llada-moe",
            ("lladamoe",),
            mask_token="<|mask|>",
            end_tokens=("<|role_end|>",),
            chat_template="the tokenizer's (turns end in <|role_end|>)",
            checkpoints=(
                "inclusionAI/LLaDA-MoE-7B-A1B-Base",
                "inclusionAI/LLaDA-MoE-7B-A1B-Instruct",
            ),
            known_ids=KnownIds(157184, 156895, (156892,), (156892,)),
            required_keys=(),  # checked by its config_check
            config_check="daca.models.native_moe:moe_config_problem",
        ),
        # LLaDA 2.0 / 2.1 (Ling 2.0's MoE, run block-causally: daca.models.native_llada2).
        # The same tokenizer as LLaDA-MoE's (dllm ends its turns with <|role_end|>); mask 156895
        # and EOS 156892 are the defaults of its modeling code's generate.
        Family(
            "llada2",
            ("llada2_moe", "llada21_moe"),
            mask_token="<|mask|>",
            end_tokens=("<|role_end|>",),
            chat_template="the tokenizer's (turns end in <|role_end|>)",
            checkpoints=(
                "inclusionAI/LLaDA2.0-mini",
                "inclusionAI/LLaDA2.0-flash",
                "inclusionAI/LLaDA2.1-mini",
                "inclusionAI/LLaDA2.1-flash",
            ),
            known_ids=KnownIds(157184, 156895, (156892,), (156892,)),
            # Its checkpoint's names: q, k and v are one fused projection, the output "dense".
            lora_targets=("query_key_value", "dense", "gate_proj", "up_proj", "down_proj"),
            required_keys=(),
            config_check="daca.models.native_llada2:llada2_config_problem",
        ),
    )
}
_BY_MODEL_TYPE = {kind: family for family in FAMILIES.values() for kind in family.model_types}


def family_of(model_type: str | None, hub: dict | None = None) -> str:
    """The name of the native family of a config.json ``model_type`` (``llada``, ``dream``,
    ``a2d-qwen3`` …), else ``mlm`` (a masked LM daca runs through ``AutoModelForMaskedLM``).
    ``hub``: the config.json, which tells LLaDA-MoE (``llada`` with ``num_experts``) from
    LLaDA."""
    family = _BY_MODEL_TYPE.get(str(model_type or "").lower())
    if family is not None and family.with_experts and (hub or {}).get("num_experts"):
        return family.with_experts
    return family.name if family else "mlm"


def config_problem(family: Family, hub: dict) -> str | None:
    """What makes a config.json of the family's model type one its translation cannot run
    (``daca.models.native``), or None: a mixture of experts under a dense family's name
    (LLaDA-MoE-7B-A1B's config.json says ``llada``), or sizes it lacks."""
    kind = hub.get("model_type")
    if family.config_check:
        module, function = family.config_check.split(":")
        problem = getattr(importlib.import_module(module), function)(hub)
        return problem and f"config.json says model_type {kind!r} ({family.name}): {problem}"
    moe = [key for key in MOE_KEYS if hub.get(key)]
    if moe:
        return (
            f"config.json says model_type {kind!r} ({family.name}) but describes a mixture of "
            f"experts ({moe[0]}={hub[moe[0]]}), which daca does not run under that type "
            "(LLaDA-MoE's checkpoints: model_type 'llada' with num_experts)"
        )
    missing = [key for key in family.required_keys if key not in hub]
    if missing:
        return f"config.json says model_type {kind!r} ({family.name}) but lacks {missing}"
    return None


def supported_families() -> str:
    """One phrase naming every native family and its model types, for error messages."""
    return ", ".join(f"{f.name} (model_type {'/'.join(f.model_types)})" for f in FAMILIES.values())


def lora_targets(bundle) -> list[str] | str:
    """PEFT ``target_modules`` for the bundle's family (other models: every linear layer)."""
    family = FAMILIES.get(bundle.family)
    return list(family.lora_targets) if family else "all-linear"


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
    4-bit loading quantises (every expert's, for a mixture of experts: all are resident).
    head_on_completion: the head runs on the completion's positions only (transformers'
    Llama/Qwen2 classes take ``logits_to_keep``; daca.core.modeling). linear_names: each
    linear's module name (as PEFT's ``target_modules`` match them); lora_targets: the family's
    default targets (None: every linear, as PEFT's "all-linear"); expert_share: the share of
    tokens a routed expert's linears see (top k / experts; 1 for a dense model).
    """

    hidden: int
    layers: int
    vocab: int
    mlp: int
    parameters: int
    linears: tuple[tuple[int, int], ...]
    head_on_completion: bool = False
    active_parameters: int = 0  # a mixture of experts': what one token runs through
    block_causal: bool = False  # LLaDA 2.x: attention in blocks (daca.models.native_llada2)
    linear_names: tuple[str, ...] = ()
    lora_targets: tuple[str, ...] | None = None
    expert_share: float = 1.0

    @property
    def active(self) -> int:
        """Parameters one token runs through (all of them, but for a mixture of experts)."""
        return self.active_parameters or self.parameters

    @property
    def linear_parameters(self) -> int:
        """Weights of the layers' projections (their biases, if any, are not counted here)."""
        return sum(i * o for i, o in self.linears)

    @property
    def other_parameters(self) -> int:
        """Embeddings, output head, norms and biases: what 4-bit loading keeps in bf16."""
        return self.parameters - self.linear_parameters

    def adapted(self, targets=None) -> list[tuple[tuple[int, int], float]]:
        """((in, out), share of tokens it sees) of each linear a LoRA of ``target_modules``
        ``targets`` adapts (None: the family's default), matched as PEFT matches a list: the
        module's name, or its last dotted parts. A routed expert's sees ``expert_share``."""
        targets = targets or self.lora_targets
        names = self.linear_names or ("",) * len(self.linears)
        return [
            (shape, self.expert_share if ".experts." in name else 1.0)
            for shape, name in zip(self.linears, names, strict=True)
            if targets is None or any(name == t or name.endswith(f".{t}") for t in targets)
        ]

    def lora_parameters(self, r: int, targets=None) -> int:
        """A rank-r adapter on each linear ``targets`` names (``adapted``): r · (in + out)."""
        return r * sum(i + o for (i, o), _ in self.adapted(targets))


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
# dllm's Tiny-A2D models: Qwen3-0.6B's and Qwen2.5-Coder-0.5B-Instruct's config.json fields
# (dllm's A2D conversion keeps them; only model_type changes).
A2D_QWEN3_06B_CONFIG = {
    "model_type": "a2d-qwen3", "hidden_size": 1024, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
    "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-06,
    "use_sliding_window": False,
}  # fmt: skip
A2D_QWEN25_CODER_05B_CONFIG = {
    "model_type": "a2d-qwen2", "hidden_size": 896, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
    "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "use_sliding_window": False,
}  # fmt: skip
# inclusionAI/LLaDA2.0-mini's config.json fields as public code quotes them (the hub itself was
# not readable where this was written); they give 16.26 B parameters, 1.43 B active: the
# model card's 16 B / 1.4 B. use_bias (the attention's output bias) is not quoted: off.
LLADA2_MINI_CONFIG = {
    "model_type": "llada2_moe", "hidden_size": 2048, "num_hidden_layers": 20,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 5120, "moe_intermediate_size": 512, "num_experts": 256,
    "num_experts_per_tok": 8, "num_shared_experts": 1, "n_group": 8, "topk_group": 4,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "score_function": "sigmoid",
    "norm_topk_prob": True, "use_qk_norm": True, "use_qkv_bias": False, "use_bias": False,
    "partial_rotary_factor": 0.5, "rope_theta": 600000, "rms_norm_eps": 1e-06,
    "max_position_embeddings": 32768, "vocab_size": 157184, "tie_word_embeddings": False,
}  # fmt: skip
# inclusionAI/LLaDA-MoE-7B-A1B's shape as public notes quote it (OLMoE's: 16 layers of 64
# experts, 8 per token, 1024 wide), with its tokenizer's 157184 rows (the families table):
# 7.36 B parameters, the name's 7B. Whether the head is tied is not quoted: untied, as OLMoE.
LLADA_MOE_7B_CONFIG = {
    "model_type": "llada", "architectures": ["LLaDAMoEModelLM"], "hidden_size": 2048,
    "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
    "expert_intermediate_size": 1024, "dense_intermediate_size": 8192, "num_experts": 64,
    "num_experts_per_tok": 8, "vocab_size": 157184, "rope_theta": 50000,
    "max_position_embeddings": 8192, "qk_layernorm": True, "hidden_act": "silu",
    "tie_word_embeddings": False,
}  # fmt: skip
# Keys: the last part of a hub name, lower case (a local copy is read from its config.json).
KNOWN_CONFIGS = {
    "llada-8b-instruct": LLADA_8B_CONFIG,
    "llada-8b-base": LLADA_8B_CONFIG,
    "llada-1.5": LLADA_8B_CONFIG,
    "dream-v0-instruct-7b": DREAM_7B_CONFIG,
    "dream-v0-base-7b": DREAM_7B_CONFIG,
    # Dream-Coder (from Qwen2.5-Coder-7B) and DiffuCoder: Dream's architecture at Qwen2.5-7B's
    # shape, the widths above (the vocabulary too: 152064 rows).
    "dream-coder-v0-instruct-7b": DREAM_7B_CONFIG,
    "dream-coder-v0-base-7b": DREAM_7B_CONFIG,
    "diffucoder-7b-base": DREAM_7B_CONFIG,
    "diffucoder-7b-instruct": DREAM_7B_CONFIG,
    "diffucoder-7b-cpgrpo": DREAM_7B_CONFIG,
    "llada2.0-mini": LLADA2_MINI_CONFIG,
    "llada-moe-7b-a1b-base": LLADA_MOE_7B_CONFIG,
    "llada-moe-7b-a1b-instruct": LLADA_MOE_7B_CONFIG,
    "qwen3-0.6b-diffusion-mdlm-v0.1": A2D_QWEN3_06B_CONFIG,
    "qwen2.5-coder-0.5b-instruct-diffusion-mdlm-v0.1": A2D_QWEN25_CODER_05B_CONFIG,
}


def meta_module(config: dict):
    """The model of a config.json mapping, built on the meta device (no memory, no weights):
    LLaDA and Dream as daca runs them (``daca.models.native``), other model types as
    transformers' masked LM of that type. LookupError if transformers has no class for it."""
    import torch

    from daca.models.native_classes import NATIVE

    kind = str(config.get("model_type", "")).lower()
    with torch.device("meta"):
        family = family_of(kind, config)
        if family in NATIVE:
            cls, make_config, _ = NATIVE[family]
            return cls(make_config(config))
        from transformers import AutoConfig, AutoModelForMaskedLM

        fields = {k: v for k, v in config.items() if k != "model_type"}
        try:
            return AutoModelForMaskedLM.from_config(AutoConfig.for_model(kind, **fields))
        except (ValueError, KeyError) as e:
            raise LookupError(f"transformers has no masked LM of model_type {kind!r}") from e


def shape_of_module(model) -> ModelShape:
    """The shape of a transformers model: its parameters counted, the linear layers of its
    layer stack listed (``model.layers`` of a causal LM, else its longest ModuleList: a
    mixture of experts holds a longer one per layer). A mixture of experts' ``mlp`` is the
    width a token runs through (top k · expert width) and ``active_parameters`` leaves out
    the experts a token skips."""
    from torch import nn

    from daca.core.modeling import causal_lm_backbone

    stack = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(stack, nn.ModuleList):
        stack = max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len)
    embedding = model.get_input_embeddings()
    parameters = sum(p.numel() for p in model.parameters())
    config = model.config
    mlp, active = int(config.intermediate_size), parameters
    experts, top_k = getattr(config, "num_experts", 0), getattr(config, "num_experts_per_tok", 0)
    if experts and top_k:
        mlp = top_k * int(config.moe_intermediate_size)
        routed = sum(p.numel() for n, p in stack.named_parameters() if ".experts." in n)
        active = parameters - routed + routed * top_k // experts
    prefix = next(name for name, module in model.named_modules() if module is stack)
    linears = [
        (f"{prefix}.{name}", m) for name, m in stack.named_modules() if isinstance(m, nn.Linear)
    ]
    return ModelShape(
        hidden=embedding.embedding_dim,
        layers=len(stack),
        vocab=embedding.num_embeddings,
        mlp=mlp,
        parameters=parameters,
        linears=tuple((m.in_features, m.out_features) for _, m in linears),
        head_on_completion=causal_lm_backbone(model) is not None,
        active_parameters=active,
        block_causal=getattr(model, "attention_block", None) is not None,
        linear_names=tuple(name for name, _ in linears),
        expert_share=top_k / experts if experts and top_k else 1.0,
    )


def shape_from_config(config: dict) -> ModelShape:
    """The shape of the model a config.json mapping describes, read off its meta-device module,
    with its family's default LoRA targets."""
    family = FAMILIES.get(family_of(config.get("model_type"), config))
    targets = family.lora_targets if family else None
    return replace(shape_of_module(meta_module(config)), lora_targets=targets)


def model_shape(name_or_path: str | None) -> tuple[ModelShape, str]:
    """(shape, where its config came from) for a model name or folder, without loading weights."""
    config, source = _config_of(str(name_or_path or "tiny"))
    if source == "built-in config.json":  # fixed: built once (LLaDA 2.x's 15k modules: ~4 s)
        return _built_in_shape(json.dumps(config, sort_keys=True)), source
    return shape_from_config(config), source


@functools.cache
def _built_in_shape(config_json: str) -> ModelShape:
    return shape_from_config(json.loads(config_json))


def _config_of(name: str) -> tuple[dict, str]:
    """A folder's config.json, else the built-in copy of a known hub name's, else the hub
    cache's; read as JSON (no remote code runs)."""
    from daca.shipped import SHIPPED

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
