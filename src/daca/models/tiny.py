"""The embedded tiny masked diffusion LMs, built from a config with no custom modeling code.

- ``tiny_config``/``build_model``: ModernBERT (bidirectional, rotary positions), so left padding
  with an attention mask leaves the real tokens' logits unchanged. Tests use it for that.
- ``tiny_bert_config``: BERT, about 4x faster on a CPU at this size; the shipped default model.
  Its positions are absolute, so its prompts are always left padded to one fixed width
  (``prompt_width``), in pretraining and in RL alike.
- ``build_tokenizer``: a character-level tokenizer over the tasks' alphabet, built offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    BertConfig,
    BertForMaskedLM,
    ModernBertConfig,
    ModernBertForMaskedLM,
    PreTrainedTokenizerFast,
)

ALPHABET = "0123456789+-*/()=,:"
SPECIAL_TOKENS = ("[PAD]", "[MASK]", "[EOS]", "[UNK]")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of ``ALPHABET``, plus pad, mask, end-of-sequence and unknown."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(ALPHABET))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
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


def tiny_bert_config(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_positions: int = 64,
    pad_token_id: int = 0,
) -> BertConfig:
    """Config of the shipped tiny BERT masked LM (no dropout: RL ratios need a deterministic
    forward)."""
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_positions,
        pad_token_id=pad_token_id,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        type_vocab_size=1,
        attn_implementation="eager",
    )


def build_model(config, seed: int = 0):
    """A freshly initialised masked LM for ``config``; the seed fixes the weights without
    touching the global RNG."""
    cls = BertForMaskedLM if isinstance(config, BertConfig) else ModernBertForMaskedLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.eval()


def new_tiny(
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 256,
    prompt_width: int = 20,
    gen_length: int = 16,
    seed: int = 0,
):
    """A fresh tiny BERT and its tokenizer, sized for prompts of ``prompt_width`` tokens and
    completions of ``gen_length``."""
    tokenizer = build_tokenizer()
    config = tiny_bert_config(
        len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_positions=prompt_width + gen_length,
        pad_token_id=tokenizer.pad_token_id,
    )
    return build_model(config, seed=seed), tokenizer


def save_tiny(folder, model, tokenizer, *, prompt_width: int = 20, **meta):
    """Save in the shipped model's format: weights, tokenizer and the ``daca.json`` that
    ``daca.models.load`` reads (family, prompt width, and whatever ``meta`` records)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    info = {"family": "tiny", "prompt_width": prompt_width, **meta}
    (folder / "daca.json").write_text(json.dumps(info, indent=1) + "\n")
    return folder
