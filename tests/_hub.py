"""Tiny checkpoint folders laid out exactly like the hub's LLaDA and Dream releases.

``write_llada(path)`` mirrors ``GSAI-ML/LLaDA-8B-Instruct`` and ``write_dream(path)`` mirrors
``Dream-org/Dream-v0-Instruct-7B``: the real ``config.json`` keys (``auto_map``,
``architectures``, ``model_type``, LLaDA's OLMo-style names), the real vocabulary sizes and
special-token ids, weights under the hub's state-dict key names, sharded like the hub
(``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``), and a tokenizer
that ``AutoTokenizer`` loads without remote code. Only the widths are tiny. Beside them lie the
family's ``*.py`` files, poisoned: importing one touches a marker file and raises, so a test can
prove a loader never executed them (``imported_python(path)``).

The tokenizer is byte-level BPE without merges (one token per byte, lossless) with the special
tokens at their real ids; weights are random from a seeded generator, with a standard deviation
(0.2) large enough that attention weights differ markedly between positions.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

INIT_STD = 0.2

# Llama 3's chat template as LLaDA-8B-Instruct ships it.
LLADA_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# Qwen2.5's ChatML template (Dream-v0-Instruct), without tool calls.
DREAM_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLADA_SPECIALS = {
    "<|startoftext|>": 126080,
    "<|endoftext|>": 126081,
    "<|mdm_mask|>": 126336,
    "<|start_header_id|>": 126346,
    "<|end_header_id|>": 126347,
    "<|eot_id|>": 126348,
}

# How Dream's tokenizer_config.json names its tokenizer: a class in the folder's own code.
DREAM_TOKENIZER_CLASS = {
    "tokenizer_class": "DreamTokenizer",
    "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
}

DREAM_SPECIALS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|beginoftext|>": 151665,
    "<|mask|>": 151666,
}


def llada_config(
    *,
    d_model=32,
    n_heads=4,
    n_kv_heads=4,
    n_layers=2,
    mlp_hidden_size=64,
    mask_token_id=126336,
    dtype="float32",
) -> dict:
    """LLaDA-8B-Instruct's config.json with tiny widths (real: 4096, 32, 32, 32, 12288)."""
    return {
        "activation_type": "silu",
        "alibi": False,
        "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0,
        "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True,
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
            "AutoModel": "modeling_llada.LLaDAModelLM",
        },
        "bias_for_layer_norm": False,
        "block_group_size": 1,
        "block_type": "llama",
        "d_model": d_model,
        "embedding_dropout": 0.0,
        "embedding_size": 126464,
        "eos_token_id": 126081,
        "flash_attention": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "init_cutoff_factor": None,
        "init_device": "meta",
        "init_fn": "mitchell",
        "init_std": 0.02,
        "input_emb_norm": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "mask_token_id": mask_token_id,
        "max_sequence_length": 4096,
        "mlp_hidden_size": mlp_hidden_size,
        "mlp_ratio": 4,
        "model_type": "llada",
        "multi_query_attention": None,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "n_layers": n_layers,
        "pad_token_id": 126081,
        "precision": "amp_bf16",
        "residual_dropout": 0.0,
        "rms_norm_eps": 1e-05,
        "rope": True,
        "rope_full_precision": True,
        "rope_theta": 500000.0,
        "scale_logits": False,
        "torch_dtype": dtype,
        "transformers_version": "4.46.3",
        "use_cache": False,
        "vocab_size": 126464,
        "weight_tying": False,
    }


def dream_config(
    *,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    intermediate_size=64,
    mask_token_id=151666,
    dtype="float32",
) -> dict:
    """Dream-v0-Instruct-7B's config.json with tiny widths (real: 3584, 28, 4, 28, 18944)."""
    return {
        "architectures": ["DreamModel"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_dream.DreamConfig",
            "AutoModel": "modeling_dream.DreamModel",
        },
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "mask_token_id": mask_token_id,
        "max_position_embeddings": 131072,
        "max_window_layers": 28,
        "model_type": "Dream",
        "num_attention_heads": num_attention_heads,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "pad_token_id": 151643,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "transformers_version": "4.46.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 152064,
    }


# --------------------------------------------------------------------------------- weights
def llada_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """LLaDA's state-dict keys (``LLaDAModelLM``, llama block) and their shapes."""
    d, v, f = c["d_model"], c["embedding_size"], c["mlp_hidden_size"]
    kv = c["n_kv_heads"] * (d // c["n_heads"])
    shapes = {"model.transformer.wte.weight": (v, d)}
    for i in range(c["n_layers"]):
        b = f"model.transformer.blocks.{i}."
        shapes.update(
            {
                b + "attn_norm.weight": (d,),
                b + "q_proj.weight": (d, d),
                b + "k_proj.weight": (kv, d),
                b + "v_proj.weight": (kv, d),
                b + "attn_out.weight": (d, d),
                b + "ff_norm.weight": (d,),
                b + "ff_proj.weight": (f, d),
                b + "up_proj.weight": (f, d),
                b + "ff_out.weight": (d, f),
            }
        )
    shapes["model.transformer.ln_f.weight"] = (d,)
    shapes["model.transformer.ff_out.weight"] = (v, d)
    return shapes


def dream_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Dream's state-dict keys (``DreamModel``: Qwen2's names) and their shapes."""
    d, v, f = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * (d // c["num_attention_heads"])
    shapes = {"model.embed_tokens.weight": (v, d)}
    for i in range(c["num_hidden_layers"]):
        b = f"model.layers.{i}."
        shapes.update(
            {
                b + "input_layernorm.weight": (d,),
                b + "self_attn.q_proj.weight": (d, d),
                b + "self_attn.q_proj.bias": (d,),
                b + "self_attn.k_proj.weight": (kv, d),
                b + "self_attn.k_proj.bias": (kv,),
                b + "self_attn.v_proj.weight": (kv, d),
                b + "self_attn.v_proj.bias": (kv,),
                b + "self_attn.o_proj.weight": (d, d),
                b + "post_attention_layernorm.weight": (d,),
                b + "mlp.gate_proj.weight": (f, d),
                b + "mlp.up_proj.weight": (f, d),
                b + "mlp.down_proj.weight": (d, f),
            }
        )
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (v, d)
    return shapes


def random_weights(shapes: dict, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Normal(0, INIT_STD) weights; norm weights 1 + Normal(0, INIT_STD) so that a loader
    dropping a norm's weight is seen."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for key, shape in shapes.items():
        w = torch.randn(shape, generator=gen) * INIT_STD
        if "norm" in key or "ln_f" in key:  # RMSNorm weights, around 1
            w = w + 1.0
        weights[key] = w.to(dtype)
    return weights


def write_weights(path: Path, weights: dict[str, torch.Tensor], shards: int) -> None:
    """The hub's sharded layout: model-0000k-of-0000n.safetensors and their index."""
    keys = list(weights)
    per = -(-len(keys) // shards)
    weight_map, total = {}, 0
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {key: weights[key].contiguous() for key in keys[k * per : (k + 1) * per]}
        save_file(part, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in a folder, by its key on disk."""
    weights = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return weights


# ------------------------------------------------------------------------------- tokenizer
def write_tokenizer(path: Path, specials: dict[str, int], tokenizer_config: dict) -> None:
    """tokenizer.json (byte-level BPE, no merges, specials at their ids) + tokenizer_config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update(specials)  # the specials sit in the model's vocabulary at their real ids
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [
        {
            "id": i,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for text, i in sorted(specials.items(), key=lambda item: item[1])
    ]
    (path / "tokenizer.json").write_text(json.dumps(spec))
    decoder = {
        str(i): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for text, i in specials.items()
    }
    config = {
        "added_tokens_decoder": decoder,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tokenizer_config,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    mapped = {k: v for k, v in tokenizer_config.items() if k.endswith("_token")}
    (path / "special_tokens_map.json").write_text(json.dumps(mapped, indent=2))


# ------------------------------------------------------------------------ poisoned python
def poison(path: Path, names: list[str]) -> None:
    """The family's .py files, each touching ``.imported-<name>`` and raising on import."""
    for name in names:
        marker = (path / f".imported-{name}").resolve()
        (path / f"{name}.py").write_text(
            "import pathlib\n"
            f"pathlib.Path({str(marker)!r}).touch()\n"
            f"raise ImportError('a daca test checkpoint: {name}.py must never be imported')\n"
        )


def imported_python(path: str | Path) -> list[str]:
    """The poisoned modules of a folder that something imported (empty: none)."""
    return sorted(p.name.removeprefix(".imported-") for p in Path(path).glob(".imported-*"))


# ------------------------------------------------------------------------------- folders
def write_llada(
    path: str | Path,
    *,
    seed: int = 0,
    shards: int = 2,
    mask_token_id: int = 126336,
    dtype: torch.dtype = torch.float32,
    **widths,
) -> Path:
    """A tiny LLaDA-8B-Instruct folder. ``mask_token_id`` moves ``<|mdm_mask|>`` to that id in
    both config.json and the tokenizer (to test that ids are read, not assumed)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = llada_config(
        mask_token_id=mask_token_id, dtype=str(dtype).removeprefix("torch."), **widths
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_weights(path, random_weights(llada_shapes(config), seed, dtype), shards)
    specials = {**LLADA_SPECIALS, "<|mdm_mask|>": mask_token_id}
    write_tokenizer(
        path,
        specials,
        {
            "bos_token": "<|startoftext|>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "mask_token": "<|mdm_mask|>",
            "chat_template": LLADA_CHAT_TEMPLATE,
        },
    )
    poison(path, ["configuration_llada", "modeling_llada"])
    return path


def write_dream(
    path: str | Path,
    *,
    seed: int = 0,
    shards: int = 2,
    mask_token_id: int = 151666,
    dtype: torch.dtype = torch.float32,
    hub_tokenizer_class: bool = False,
    extra_specials: dict[str, int] | None = None,
    **widths,
) -> Path:
    """A tiny Dream-v0-Instruct-7B folder (see ``write_llada`` for ``mask_token_id``).

    hub_tokenizer_class: name the tokenizer as the hub does, ``DreamTokenizer`` from the folder's
    ``tokenization_dream.py`` (``auto_map``), which ``AutoTokenizer`` refuses without remote code;
    by default the folder names ``PreTrainedTokenizerFast`` instead. extra_specials: more added
    tokens at their ids (DiffuCoder's)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dream_config(
        mask_token_id=mask_token_id, dtype=str(dtype).removeprefix("torch."), **widths
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    generation = {
        "_from_model_config": True,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "pad_token_id": 151643,
        "transformers_version": "4.46.2",
    }
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_weights(path, random_weights(dream_shapes(config), seed, dtype), shards)
    specials = {**DREAM_SPECIALS, "<|mask|>": mask_token_id, **(extra_specials or {})}
    write_tokenizer(
        path,
        specials,
        {
            "bos_token": "<|beginoftext|>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "mask_token": "<|mask|>",
            "chat_template": DREAM_CHAT_TEMPLATE,
            "errors": "replace",
            "split_special_tokens": False,
            **(DREAM_TOKENIZER_CLASS if hub_tokenizer_class else {}),
        },
    )
    poison(
        path, ["configuration_dream", "modeling_dream", "generation_utils", "tokenization_dream"]
    )
    return path


# DiffuCoder-7B-Instruct's tokenizer: Dream's, plus the <|dlm_pad|> its SFT fills a completion's
# tail with (its README cuts the output at it). Its id is the next free one, 151667: the Instruct
# folder's added_tokens.json is one entry (25 bytes) longer than the Base's, whose last is
# <|mask|> 151666 (hub file listing; the file itself was not readable here).
DIFFUCODER_SPECIALS = {"<|dlm_pad|>": 151667}


def write_diffucoder(path: str | Path, **kwargs) -> Path:
    """A tiny apple/DiffuCoder-7B-Instruct folder: Dream's layout (``model_type`` Dream,
    ``DreamModel``, Qwen2 keys) with DiffuCoder's added token."""
    return write_dream(path, extra_specials=DIFFUCODER_SPECIALS, **kwargs)
