"""The embedded tiny masked diffusion LMs: miniature LLaDAs.

- ``new_tiny``/``save_tiny``: a LLaDA-architecture model (Llama block, bidirectional, RoPE) of a
  few hundred thousand parameters, saved in LLaDA's hub layout (``model_type`` "llada", LLaDA's
  key names), so the shipped default loads and trains through exactly the code of LLaDA-8B
  (``daca.models.native``). Its prompts are the tasks' compact character strings.
- ``build_tokenizer``: a character-level tokenizer over the tasks' alphabet, built offline.
- ``tiny_config``/``build_model``: a small ModernBERT, the stand-in for "any other masked LM"
  (``AutoModelForMaskedLM``) in tests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    ModernBertConfig,
    ModernBertForMaskedLM,
    PreTrainedTokenizerFast,
)

from daca.models.loading import follow_umask
from daca.models.native import _LLADA_DEFAULTS, LLaDAForDiffusionLM, llama_config

ALPHABET = "0123456789+-*/()=,:"
SPECIAL_TOKENS = ("[PAD]", "[MASK]", "[EOS]", "[UNK]")


def build_tokenizer(words: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """One token per character of ``ALPHABET``, plus pad, mask, end-of-sequence and unknown,
    plus one per entry of ``words`` (a task's ``compact_vocabulary``: more characters, and
    whole words such as ``<answer>`` that are read as one token, never split)."""
    extra = tuple(dict.fromkeys(w for w in words if w not in ALPHABET))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(ALPHABET) + extra)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    whole = sorted((w for w in extra if len(w) > 1), key=len, reverse=True)
    # [\s\S]: any character, a newline included (Oniguruma's "." stops at one)
    pattern = "|".join([*(re.escape(w) for w in whole), r"[\s\S]"]) if extra else "."
    core.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="[PAD]",
        mask_token="[MASK]",
        eos_token="[EOS]",
        unk_token="[UNK]",
        padding_side="left",
    )


def tiny_config(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_positions: int = 512,
    pad_token_id: int = 0,
) -> ModernBertConfig:
    """Config of a small ModernBERT masked LM (every layer global attention)."""
    return ModernBertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_positions,
        global_attn_every_n_layers=1,
        pad_token_id=pad_token_id,
        bos_token_id=pad_token_id,
        eos_token_id=pad_token_id,
        cls_token_id=pad_token_id,
        sep_token_id=pad_token_id,
        attn_implementation="sdpa",
    )


def build_model(config, seed: int = 0):
    """A freshly initialised ModernBERT masked LM for ``config``; the seed fixes the weights
    without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ModernBertForMaskedLM(config)
    return model.eval()


def tiny_llada_config(
    tokenizer,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_positions: int = 128,
) -> dict:
    """LLaDA ``config.json`` fields of a tiny model over ``tokenizer`` (ids from it)."""
    return {
        **_LLADA_DEFAULTS,
        "d_model": hidden_size,
        "n_layers": num_layers,
        "n_heads": num_heads,
        "n_kv_heads": num_heads,
        "mlp_hidden_size": intermediate_size,
        "vocab_size": len(tokenizer),
        "embedding_size": len(tokenizer),
        "max_sequence_length": max_positions,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "weight_tying": False,
        "mask_token_id": tokenizer.mask_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def new_tiny(
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_positions: int = 128,
    seed: int = 0,
    words: tuple[str, ...] = (),
):
    """A fresh tiny LLaDA and its tokenizer (``build_tokenizer(words)``); the seed fixes the
    weights without touching the global RNG. ``max_positions`` bounds prompt + completion
    (``prompt_limit``)."""
    tokenizer = build_tokenizer(words)
    hub = tiny_llada_config(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_positions=max_positions,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LLaDAForDiffusionLM(llama_config(hub))
    return model.eval(), tokenizer


def save_tiny(folder, model, tokenizer, **meta):
    """Save in the shipped models' format: LLaDA's hub layout, the tokenizer, and the
    ``daca.json`` that ``daca.models.load`` reads (compact prompts, whatever ``meta`` records)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    info = {"family": "llada", "prompt_format": "compact", **meta}
    (folder / "daca.json").write_text(json.dumps(info, indent=1) + "\n")
    follow_umask(folder)  # the weights too (transformers writes them 0600)
    return folder
