"""Prompt texts to token ids, and completion ids back to text, per model family.

Chat models read their prompts through the tokenizer's chat template, rendered here under a
deadline (``render_chat``); a task row becomes a prompt text in ``daca.tasks.prompts``. A prompt
longer than the model reads is an error naming it, or, when asked, cut to its last tokens.
"""

from __future__ import annotations

import functools
import sys
import time
from contextlib import contextmanager

import torch
from torch import Tensor

from daca.core.modeling import attention_anchor_of, attention_block_of, start_aligned_pad
from daca.models.loading import LoadedModel

# ----------------------------------------------------------------------------- chat templates
# A model folder's chat_template is a program (jinja) from whoever wrote the folder. transformers
# runs it in jinja's sandbox, which stops escapes but not loops: two nested loops over range()
# render for hours. So it runs here under a deadline that a line tracer enforces at every line
# and call of the template's own code (jinja compiles it to Python): pure Python cannot outrun
# it, unlike a thread, which cannot be stopped, or a process, which costs seconds per prompt
# batch. The one operator that runs unbounded inside a single C call, ``**`` on integers
# (9**9**9), is refused before rendering; and a template, and what it renders, are capped.
CHAT_TEMPLATE_SECONDS = 5.0  # for one prompt (a real template renders in ~1 ms)
MAX_CHAT_TEMPLATE_CHARS = 200_000  # the longest hub templates (tools, reasoning): ~20 000
MAX_RENDERED_CHARS = 4_000_000  # a prompt the template made (about a million tokens)


class ChatTemplateError(ValueError):
    """A model folder's chat template that is too long, too slow or fails on a prompt."""


class _TemplateDeadline(Exception):
    pass


def _template_code(frame) -> bool:
    return frame.f_code.co_filename == "<template>"  # jinja's name for compiled templates


@contextmanager
def _deadline(seconds: float):
    """Raise _TemplateDeadline in the template's code (or any call) once ``seconds`` passed."""
    end = time.monotonic() + seconds

    def on_line(frame, event, arg):
        if time.monotonic() > end:
            raise _TemplateDeadline
        return on_line

    def on_call(frame, event, arg):
        if time.monotonic() > end:
            raise _TemplateDeadline
        return on_line if _template_code(frame) else None

    before = sys.gettrace()  # a coverage tool's tracer, put back after
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(before)


def _template_texts(tok) -> list[str]:
    template = tok.chat_template
    return list(template.values()) if isinstance(template, dict) else [str(template)]


def check_chat_template(tok) -> None:
    """ChatTemplateError for a chat template longer than MAX_CHAT_TEMPLATE_CHARS, one jinja
    cannot parse, or one that uses ``**`` (a power of integers runs unbounded in C)."""
    for text in _template_texts(tok):
        if len(text) > MAX_CHAT_TEMPLATE_CHARS:
            raise ChatTemplateError(
                f"the tokenizer's chat_template has {len(text)} characters, more than the "
                f"{MAX_CHAT_TEMPLATE_CHARS} daca renders; fix tokenizer_config.json"
            )
        problem = _template_problem(text)
        if problem:
            raise ChatTemplateError(f"the tokenizer's chat_template {problem}")


@functools.lru_cache(maxsize=16)
def _template_problem(text: str) -> str | None:
    """What is wrong with a template's source, or None (parsed once per template)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        """transformers' ``{% generation %}`` block, so that such templates parse."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", GenerationTag])
    try:
        tree = env.parse(text)
    except jinja2.TemplateSyntaxError as e:
        return f"is not valid jinja (line {e.lineno}: {e.message})"
    if any(True for _ in tree.find_all(nodes.Pow)):
        return (
            "uses '**', which daca does not render (a power of integers can run for hours); "
            "fix tokenizer_config.json"
        )
    return None


def render_chat(tok, messages, *, seconds: float | None = None) -> str:
    """``tok.apply_chat_template`` (generation prompt added, as text) within ``seconds``
    (default CHAT_TEMPLATE_SECONDS): ChatTemplateError, one line, for a template that fails, is
    too slow or renders too much. The template also reads the variables the model's family
    sets (``daca_chat_kwargs``, set on load from ``daca.models.families.FAMILIES``)."""
    seconds = CHAT_TEMPLATE_SECONDS if seconds is None else seconds
    check_chat_template(tok)
    extra = getattr(tok, "daca_chat_kwargs", None) or {}
    try:
        with _deadline(seconds):
            text = tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **extra
            )
    except _TemplateDeadline:
        raise ChatTemplateError(
            f"the tokenizer's chat_template did not render a prompt within {seconds:g} s "
            "(loops without end?); fix tokenizer_config.json"
        ) from None
    except Exception as e:  # noqa: BLE001 - the template is the folder's program: any failure
        raise ChatTemplateError(
            f"the tokenizer's chat_template failed on a prompt: {type(e).__name__}: "
            f"{str(e).splitlines()[0][:300] if str(e) else ''}"
        ) from None
    if len(text) > MAX_RENDERED_CHARS:
        raise ChatTemplateError(
            f"the tokenizer's chat_template rendered {len(text)} characters for one prompt "
            f"(at most {MAX_RENDERED_CHARS}); fix tokenizer_config.json"
        )
    return text


def prompt_limit(bundle: LoadedModel, gen_length: int) -> int | None:
    """The most prompt tokens the model reads: the tiny model's fixed width, else its positions
    (``max_position_embeddings``, LLaDA's ``max_sequence_length``) less the completion's
    ``gen_length``; None when the model's config does not say."""
    if bundle.prompt_width is not None:
        return bundle.prompt_width
    config = getattr(bundle.model, "config", None)
    for key in ("max_position_embeddings", "max_sequence_length"):
        positions = getattr(config, key, None)
        if isinstance(positions, int) and positions > 0:
            return max(positions - gen_length, 0)
    return None


def prompt_token_ids(bundle: LoadedModel, texts: list[str]) -> list[list[int]]:
    """Token ids of each prompt, unpadded (special tokens added for all but the tiny model)."""
    tok = bundle.tokenizer
    return [
        tok(t, add_special_tokens=bundle.prompt_format != "compact")["input_ids"] for t in texts
    ]


def fit_prompts(
    ids: list[list[int]], limit: int | None, *, truncate: bool, texts: list[str] | None = None
) -> tuple[list[list[int]], int]:
    """Prompts of at most ``limit`` tokens: (ids, how many were cut).

    ``truncate``: keep the last ``limit`` tokens of a longer prompt (the end holds the question
    and, for chat models, the assistant header); else a longer prompt is a ValueError naming it.
    """
    if limit is None:
        return ids, 0
    long = [i for i, seq in enumerate(ids) if len(seq) > limit]
    if long and not truncate:
        i = long[0]
        shown = f" {texts[i][:80]!r}{'...' if len(texts[i]) > 80 else ''}" if texts else ""
        raise ValueError(
            f"prompt {i}{shown} has {len(ids[i])} tokens, more than the {limit} the model reads; "
            f"shorten it or set truncate_prompts=true to keep its last {limit} tokens"
        )
    return [seq[len(seq) - limit :] if len(seq) > limit else seq for seq in ids], len(long)


def pad_prompts(bundle: LoadedModel, ids: list[list[int]]) -> tuple[Tensor, Tensor]:
    """Left-padded prompt ids [B, P] and attention mask [B, P] (P: the tiny model's width, else
    the longest prompt); for a model whose blocks count from the first token (LLaDA 2.x),
    each prompt in whole blocks, padded after it too (``pad_for_model``)."""
    return pad_for_model(bundle.model, ids, bundle.pad_id, bundle.prompt_width)


def pad_for_model(
    model, ids: list[list[int]], pad_id: int, prompt_width: int | None = None
) -> tuple[Tensor, Tensor]:
    """``pad_prompts`` for a model and pad id (the TRL front-end's entry): left padding to
    ``prompt_width`` or the longest prompt, or ``daca.core.modeling.start_aligned_pad`` for a
    block-causal model anchored at the start, so that its completion begins a block."""
    width = max(len(i) for i in ids)
    if prompt_width is not None and width > prompt_width:
        raise ValueError(f"a prompt has more than the model's {prompt_width} tokens")
    if (block := attention_block_of(model)) is not None and attention_anchor_of(model) == "start":
        return start_aligned_pad(ids, pad_id, block)
    return left_pad(ids, prompt_width or width, pad_id)


def left_pad(ids: list[list[int]], width: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """Token lists left padded to ``width``: ids [B, width] long, attention mask [B, width] long
    (1 = real token)."""
    out = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for b, seq in enumerate(ids):
        if seq:
            out[b, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
            mask[b, width - len(seq) :] = 1
    return out, mask


def encode_prompts(
    bundle: LoadedModel, texts: list[str], *, limit: int | None = None, truncate: bool = False
) -> tuple[Tensor, Tensor]:
    """Left-padded prompt ids [B, P] and attention mask [B, P].

    A prompt longer than the tiny model's width, or than ``limit``, raises ValueError naming
    it, or with ``truncate`` keeps its last tokens (``fit_prompts``).
    """
    if bundle.prompt_width is not None:
        limit = bundle.prompt_width if limit is None else min(limit, bundle.prompt_width)
    ids, _ = fit_prompts(prompt_token_ids(bundle, texts), limit, truncate=truncate, texts=texts)
    return pad_prompts(bundle, ids)


def encode_targets(bundle: LoadedModel, texts: list[str], gen_length: int) -> Tensor:
    """Completion ids [B, L] for supervised targets: the text, then end-of-sequence to L."""
    tok = bundle.tokenizer
    out = torch.full((len(texts), gen_length), bundle.eos_ids[0], dtype=torch.long)
    for b, text in enumerate(texts):
        seq = tok(text, add_special_tokens=False)["input_ids"]
        if len(seq) > gen_length:
            raise ValueError(f"target {text!r} is longer than gen_length={gen_length}")
        out[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


def completion_mask(bundle: LoadedModel, completion_ids: Tensor) -> Tensor:
    """[B, L] bool: tokens up to and including the first end-of-sequence token."""
    return up_to_eos(completion_ids, bundle.eos_ids)


def up_to_eos(completion_ids: Tensor, eos_ids) -> Tensor:
    """[B, L] bool: tokens up to and including the first of ``eos_ids``."""
    eos = torch.as_tensor(list(eos_ids), dtype=completion_ids.dtype, device=completion_ids.device)
    is_eos = torch.isin(completion_ids, eos)
    before = is_eos.long().cumsum(1) - is_eos.long()  # eos tokens strictly before n
    return before == 0


# Stands for a whole completion that holds an id the tokenizer cannot decode (Dream's embedding
# has 152064 rows, its tokenizer 151667 tokens): visible in logs, and without tags, digits or
# code, so that every task scores it 0.
OUT_OF_VOCABULARY = "[invalid completion: a sampled token id lies outside the tokenizer]"


def decode_completions(bundle: LoadedModel, completion_ids: Tensor) -> list[str]:
    """Text of each completion, cut at the first end-of-sequence token; ``OUT_OF_VOCABULARY``
    for one holding an id outside the tokenizer."""
    keep = completion_mask(bundle, completion_ids)
    vocabulary = len(bundle.tokenizer)
    texts = []
    for ids, k in zip(completion_ids.tolist(), keep.tolist(), strict=True):
        ids = [i for i, kk in zip(ids, k, strict=True) if kk and i not in bundle.eos_ids]
        if any(i < 0 or i >= vocabulary for i in ids):
            texts.append(OUT_OF_VOCABULARY)
            continue
        texts.append(bundle.tokenizer.decode(ids, skip_special_tokens=True))
    return texts
