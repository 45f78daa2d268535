"""``daca.models.load``: one loader for the shipped tiny model, local folders and hub models.

A folder written by ``daca pretrain`` holds a ``daca.json`` naming its family and prompt width;
other folders and hub names are recognised by their config's ``model_type``: LLaDA and Dream
(remote code, ``trust_remote_code``) or any transformers-native ``AutoModelForMaskedLM``.

The method core calls ``model(input_ids, attention_mask=...)`` with left-padded prompts and reads
"logits at position i predict token i" (``daca.modeling``). Where a family breaks that contract
the loader installs a *forward adapter* on the model itself, replacing ``model.forward`` in place:
the model stays the same object (class, parameters, state-dict keys), so PEFT, accelerate,
``save_pretrained`` and checkpoint resume see the family's own model. Adapters:

- ``dream_forward``: Dream's logits are shifted right by one (``logits[:, i]`` predicts token
  i + 1) and its forward wants a 4-D boolean mask; the adapter passes one and unshifts.
- ``bucketed_forward``: for models whose logits change under left padding even with the
  attention mask (older LLaDA copies ignore ``attention_mask``; models with absolute positions),
  rows with the same padding run together without it, which equals running each row alone.
  ``load`` detects this (``left_padding_changes_logits``) and warns.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

TINY_PATH = Path(__file__).resolve().parent.parent / "assets" / "tiny"
# The shipped tiny models, by name: one per embedded task (the tiny model is too small to learn
# both Sudoku and Countdown well at once).
SHIPPED = {"tiny": TINY_PATH, "tiny-countdown": TINY_PATH.parent / "tiny-countdown"}


@dataclass(frozen=True)
class Family:
    """Token ids of a model family whose tokenizer does not say them (METHOD.md §5 for LLaDA)."""

    name: str
    mask_id: int
    eos_ids: tuple[int, ...]  # end-of-sequence tokens; the first one fills targets
    pad_id: int


# Keys: the lower-cased ``model_type`` of the HF config.
FAMILIES = {
    # LLaDA: <|mdm_mask|>, <|endoftext|> and <|eot_id|>; the reference codes pad with EOS.
    "llada": Family("llada", mask_id=126336, eos_ids=(126081, 126348), pad_id=126081),
    # Dream (Qwen2.5 tokenizer): <|mask|>, <|endoftext|> (also pad) and <|im_end|>.
    "dream": Family("dream", mask_id=151666, eos_ids=(151643, 151645), pad_id=151643),
}


@dataclass
class LoadedModel:
    """A model with what the core and the trainer need to drive it.

    Unpacks as ``model, tokenizer, mask_id = daca.models.load(...)``.
    """

    model: torch.nn.Module
    tokenizer: object
    mask_id: int
    family: str  # "tiny" | "llada" | "dream" | "mlm"
    eos_ids: tuple[int, ...]
    pad_id: int
    prompt_width: int | None = None  # tiny: prompts are left padded to exactly this width
    path: str = ""
    ignores_attention_mask: bool = False  # left padding changed logits: forward runs by buckets

    def __iter__(self):
        return iter((self.model, self.tokenizer, self.mask_id))


def resolve(name_or_path: str | None) -> str:
    name = str(name_or_path or "tiny")
    if name in SHIPPED:
        if not (SHIPPED[name] / "config.json").is_file():
            raise FileNotFoundError(
                f"the shipped model {name!r} is missing from {SHIPPED[name]}; run `daca pretrain` "
                "or reinstall daca-grpo"
            )
        return str(SHIPPED[name])
    return name


def tiny_for_task(name_or_path: str | None, task: str) -> str | None:
    """``"tiny"`` means the shipped model of the task: Countdown has its own."""
    if name_or_path in (None, "", "tiny") and task == "countdown":
        return "tiny-countdown"
    return name_or_path


def family_of(model_type: str | None, meta: dict) -> str:
    """The family name for a config's ``model_type`` and a folder's ``daca.json``."""
    kind = str(model_type or "").lower()
    if kind in FAMILIES:
        return kind
    return meta.get("family", "mlm")


def load(
    name_or_path: str | None = "tiny",
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = True,
    quantization_config=None,
    check_padding: bool | None = None,
) -> LoadedModel:
    """Load a masked diffusion LM, its tokenizer and mask id (``"tiny"``: the shipped model).

    dtype: weights dtype (``torch.bfloat16`` on a GPU); quantization_config: a transformers
    quantisation config (``daca.models.quant.load_4bit`` passes 4-bit NF4), which places the
    model on ``device`` while loading. check_padding: test whether left padding changes the
    logits and, if so, install ``bucketed_forward`` with a warning (default: every model whose
    prompts are not padded to a fixed width, i.e. all but the tiny family).
    """
    from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, AutoTokenizer

    path = resolve(name_or_path)
    meta_file = Path(path) / "daca.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    family = family_of(getattr(config, "model_type", None), meta)
    spec = FAMILIES.get(family)
    if spec is not None:
        # LLaDA's config under transformers 5 lacks `use_cache`, which its forward reads; a
        # diffusion LM never caches keys and values, so set it off for the remote families.
        config.use_cache = False
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    kwargs = {"config": config, "trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if quantization_config is not None:
        # Quantised weights are placed while loading; they cannot be moved afterwards.
        place = torch.device(device)
        if place.type == "cuda":
            place = place.index if place.index is not None else torch.cuda.current_device()
        kwargs.update(quantization_config=quantization_config, device_map={"": place})
    if spec is not None:
        model_class = _remote_class(config, path) if trust_remote_code else AutoModel
    else:
        model_class = AutoModelForMaskedLM
    model = model_class.from_pretrained(path, **kwargs)
    if quantization_config is None:
        model.to(device)
    model.eval()
    if spec is not None:
        mask_id, eos_ids, pad_id = spec.mask_id, spec.eos_ids, spec.pad_id
    else:
        mask_id = tokenizer.mask_token_id
        if mask_id is None:
            raise ValueError(
                f"{path}: the tokenizer has no mask token; a masked diffusion LM needs one"
            )
        # BERT-style tokenizers have no EOS: their separator ends a sequence.
        ends = (tokenizer.eos_token_id, getattr(tokenizer, "sep_token_id", None))
        eos_ids = tuple(i for i in ends if i is not None)[:1]
        if not eos_ids:
            raise ValueError(f"{path}: the tokenizer has no end-of-sequence or separator token")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    bundle = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        mask_id=int(mask_id),
        family=family,
        eos_ids=tuple(int(i) for i in eos_ids),
        pad_id=int(pad_id),
        prompt_width=meta.get("prompt_width"),
        path=path,
    )
    if check_padding is None:
        check_padding = bundle.prompt_width is None
    return adapt(bundle, check_padding=check_padding)


def _remote_class(config, path: str):
    """The family's remote model class, its ``__init__`` made to end with ``post_init()``.

    transformers 5's ``from_pretrained`` reads attributes that ``post_init`` sets (the tied
    weight keys); LLaDA's remote code predates that and never calls it.
    """
    from transformers import AutoModel
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    ref = (getattr(config, "auto_map", None) or {}).get("AutoModel")
    if ref is None:  # a family transformers knows natively
        return AutoModel
    cls = get_class_from_dynamic_module(ref, path)
    init = cls.__init__
    if not getattr(init, "_daca_post_init", False):

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if not hasattr(self, "all_tied_weights_keys"):
                self.post_init()

        __init__._daca_post_init = True
        cls.__init__ = __init__
    return cls


# ----------------------------------------------------------------------------- forward adapters
class _AdaptedForward:
    """``model.forward`` replaced by ``adapter(previous_forward, *args, **kwargs)``.

    A plain attribute holding the previous (bound) forward: ``copy.deepcopy`` of the model
    rebinds it to the copy, and accelerate's mixed-precision wrapper wraps it like any callable.
    """

    def __init__(self, adapter, inner):
        self.adapter, self.inner = adapter, inner
        self.name = adapter.__name__

    def __call__(self, *args, **kwargs):
        return self.adapter(self.inner, *args, **kwargs)


def install_forward_adapter(model: torch.nn.Module, adapter) -> bool:
    """Route ``model(...)`` through ``adapter(inner_forward, ...)``; False if already there."""
    names, fwd = [], model.forward
    while isinstance(fwd, _AdaptedForward):
        names.append(fwd.name)
        fwd = fwd.inner
    if adapter.__name__ in names:
        return False
    model.forward = _AdaptedForward(adapter, model.forward)
    return True


def forward_adapters(model: torch.nn.Module) -> list[str]:
    """Names of the adapters installed on ``model``, outermost first."""
    names, fwd = [], model.forward
    while isinstance(fwd, _AdaptedForward):
        names.append(fwd.name)
        fwd = fwd.inner
    return names


def _logits(out) -> Tensor:
    return out if isinstance(out, Tensor) else out.logits


def _output(logits: Tensor):
    from transformers.modeling_outputs import MaskedLMOutput

    return MaskedLMOutput(logits=logits)


def dream_forward(inner, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs):
    """Dream's forward as the core expects it: input_ids [B, T], mask [B, T] -> logits [B, T, V]
    with logits at i predicting token i.

    Dream's own forward takes a 4-D boolean mask (True = may attend) and returns logits shifted
    right by one (its generation code undoes this with ``cat([logits[:, :1], logits[:, :-1]])``).
    Padding is masked as a key only, so no query row is fully masked (no NaN), and positions
    count real tokens, as in Dream's sampler. Position 0 keeps its own (meaningless) row.
    """
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        real = attention_mask.bool()
        kwargs.setdefault("position_ids", (real.long().cumsum(1) - 1).clamp_min(0))
        T = real.shape[1]
        attention_mask = real[:, None, None, :].expand(-1, 1, T, -1)
    else:
        attention_mask = None
    logits = _logits(inner(input_ids, attention_mask=attention_mask, **kwargs))
    return _output(torch.cat([logits[:, :1], logits[:, :-1]], dim=1))


def bucketed_forward(inner, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs):
    """Left padding removed before the model sees it: input_ids, mask [B, T] -> logits [B, T, V].

    Rows with the same number of leading pad positions (``attention_mask == 0``) run as one
    batch on their real tokens only, so each row's logits are those of the row run alone;
    padded positions get logits 0. Only left padding can be removed (the core pads prompts on
    the left and never pads completions); any other mask is a ValueError.
    """
    if attention_mask is None or bool(attention_mask.bool().all()):
        return inner(input_ids, attention_mask=attention_mask, **kwargs)
    real = attention_mask.bool()
    B, T = real.shape
    pads = T - real.sum(1)
    if not torch.equal(real, torch.arange(T, device=real.device)[None] >= pads[:, None]):
        raise ValueError("bucketed_forward removes left padding only; got another attention mask")
    pieces, order = [], []
    for p in pads.unique().tolist():
        rows = (pads == p).nonzero().squeeze(1)
        logits = _logits(inner(input_ids[rows, p:], **kwargs))
        pieces.append(F.pad(logits, (0, 0, p, 0)))
        order.append(rows)
    logits = torch.cat(pieces)[torch.argsort(torch.cat(order))]
    return _output(logits)


@torch.no_grad()
def left_padding_changes_logits(
    model, token_ids: list[int], pad_id: int, *, num_pad: int = 8, tol: float = 0.05
) -> bool:
    """Whether adding ``num_pad`` left pad tokens (attention mask 0) changes the real tokens'
    logits by more than ``tol``, relative to the spread of the logits:
    ``‖a − b‖ / ‖a − mean_v(a)‖`` over the real positions but the first, whose row means nothing
    to a shifted family like Dream (bf16 rounding stays near 1e-2; a model that attends to the
    padding moves its logits by a large fraction of their spread)."""
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    padded = torch.cat([torch.full((1, num_pad), pad_id, device=device), ids], dim=1)
    mask = torch.ones_like(padded)
    mask[:, :num_pad] = 0
    was_training = model.training
    model.eval()
    try:
        a = _logits(model(ids))[:, 1:].float()
        b = _logits(model(padded, attention_mask=mask))[:, num_pad + 1 :].float()
    finally:
        model.train(was_training)
    spread = (a - a.mean(-1, keepdim=True)).norm()
    return bool((a - b).norm() > tol * spread)


def _probe_ids(bundle: LoadedModel) -> list[int]:
    """A short prompt-like input: digits and symbols every tokenizer has, then masks."""
    ids = []
    if bundle.tokenizer is not None:
        ids = bundle.tokenizer("12 + 34 = 46, 5 * 6 = 30", add_special_tokens=False)["input_ids"]
    ids = [i for i in ids if i not in (bundle.pad_id, bundle.mask_id)][:16] or list(range(1, 9))
    return ids + [bundle.mask_id] * 4


def adapt(bundle: LoadedModel, *, check_padding: bool = True) -> LoadedModel:
    """Install the family's forward adapter and, if left padding changes the logits, the
    length-bucketed forward (with a warning). Idempotent; returns ``bundle``."""
    if bundle.family == "dream":
        install_forward_adapter(bundle.model, dream_forward)
    if check_padding and left_padding_changes_logits(
        bundle.model, _probe_ids(bundle), bundle.pad_id
    ):
        install_forward_adapter(bundle.model, bucketed_forward)
        bundle.ignores_attention_mask = True
        warnings.warn(
            f"{bundle.path or bundle.family}: left padding changes this model's logits even "
            "with the attention mask (the model ignores attention_mask, or its positions are "
            "absolute); prompts of different lengths now run in separate batches, one forward "
            "per distinct prompt length, which is slower. Update the model's code if you can.",
            UserWarning,
            stacklevel=2,
        )
    return bundle
