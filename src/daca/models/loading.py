"""``daca.models.load``: one loader for the shipped tiny models, local folders and hub models.

A model is recognised by its ``config.json``'s ``model_type``:

- LLaDA (``llada``: LLaDA-8B-Base/Instruct, LLaDA-1.5, and the shipped tiny models) and Dream
  (``Dream``: Dream-v0-Base/Instruct-7B, DiffuCoder-7B) run on transformers' own Llama and Qwen2
  classes (``daca.models.native``): the folder's ``modeling_*.py`` is never imported, whatever
  ``trust_remote_code`` says;
- anything else is an ``AutoModelForMaskedLM`` (remote code only with ``trust_remote_code=True``).

Mask, end-of-sequence and pad ids come from the checkpoint's config and tokenizer; the known
values of the public LLaDA and Dream checkpoints are a check (a warning), not the source.

A folder written by daca (``daca.models.save_pretrained``, every training checkpoint) also holds
a ``daca.json``: the prompt format (``compact`` for the tiny models' task strings, ``chat``
otherwise), the generation settings the model was trained with, and for a LoRA checkpoint the
name of its base model, which ``load`` loads first and puts the adapter on.

The method core calls ``model(input_ids, attention_mask=...)`` with left-padded prompts and reads
"logits at position i predict token i" (``daca.core.modeling``). A masked LM whose logits change
under left padding even with the attention mask (it ignores the mask, or its positions are
absolute) gets the ``bucketed_forward`` adapter, installed on the model itself, with a warning.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from daca.models.native import NATIVE
from daca.shipped import SHIPPED, tiny_for_task  # noqa: F401 (tiny_for_task re-exported)


@dataclass(frozen=True)
class KnownIds:
    """Special-token ids of a public checkpoint family (METHOD.md §5 for LLaDA), used to check
    what the checkpoint says, for checkpoints with the family's vocabulary size."""

    vocab_size: int
    mask_id: int
    eos_ids: tuple[int, ...]
    pad_id: int


KNOWN_IDS = {
    # LLaDA: <|mdm_mask|>, <|endoftext|> and <|eot_id|>; the reference codes pad with EOS.
    "llada": KnownIds(126464, mask_id=126336, eos_ids=(126081, 126348), pad_id=126081),
    # Dream (Qwen2.5 tokenizer): <|mask|>, <|endoftext|> (also pad) and <|im_end|>.
    "dream": KnownIds(152064, mask_id=151666, eos_ids=(151643, 151645), pad_id=151643),
}
# Tokens that end a turn or the text, and the mask token, by family (looked up in the tokenizer).
END_TOKENS = {"llada": ("<|eot_id|>",), "dream": ("<|im_end|>",)}
MASK_TOKENS = {"llada": "<|mdm_mask|>", "dream": "<|mask|>"}


@dataclass
class LoadedModel:
    """A model with what the core and the trainer need to drive it.

    Unpacks as ``model, tokenizer, mask_id = daca.models.load(...)``.
    """

    model: torch.nn.Module
    tokenizer: object
    mask_id: int
    family: str  # "llada" | "dream" | "mlm"
    eos_ids: tuple[int, ...]
    pad_id: int
    prompt_width: int | None = None  # left pad prompts to exactly this width (absolute positions)
    path: str = ""
    ignores_attention_mask: bool = False  # left padding changed logits: forward runs by buckets
    prompt_format: str = "chat"  # "compact": the task's character prompt (the tiny models)
    name: str = ""  # what was asked for: "tiny", a hub name or a folder
    meta: dict = field(default_factory=dict)  # the folder's daca.json

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


class ModelFolderError(ValueError):
    """A model folder daca refuses to load (the message is one line naming the file and the
    problem): a pickle checkpoint, a bad ``daca.json``, code the folder asks to run."""


# What daca.json may hold, and the JSON types of its values (model_folder_problems). The
# generation keys are GenerationConfig's (daca.train.config); others there are ignored.
_META_TYPES = {
    "family": str,
    "prompt_format": str,
    "prompt_width": int,
    "generation": dict,
    "base_model": str,
    "base_in_4bit": bool,  # a LoRA adapter trained on NF4 base weights
    # What ``daca pretrain`` records about the run that made a shipped model.
    "pretrain": dict,
    "steps_trained": int,
    "seconds": (int, float),
    "parameters": int,
    "held_out": dict,
    "held_out_step": int,
    "held_out_steps": dict,
    "eval_size": int,
    "history": list,
}
_GENERATION_TYPES = {
    "gen_length": int,
    "steps": int,
    "block_length": int,
    "temperature": (int, float),
    "cfg_scale": (int, float),
    "remasking": str,
    "cache": str,
    "refresh_every": (int, type(None)),
    "trace_refresh": str,
    "parallel_threshold": (int, float, type(None)),
}
_POSITIVE = ("prompt_width", "gen_length", "steps", "block_length")
PROMPT_FORMATS = ("compact", "chat")


def read_meta(path: str) -> dict:
    """The ``daca.json`` of a folder written by daca ({} for others and hub names);
    ModelFolderError for one that is not JSON or holds what ``daca.json`` cannot."""
    meta_file = Path(path) / "daca.json"
    if not meta_file.is_file():
        return {}
    try:
        meta = json.loads(meta_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFolderError(f"{meta_file} is not JSON ({e}); fix or delete it") from None
    problem = meta_problem(meta)
    if problem:
        raise ModelFolderError(f"{meta_file}: {problem}")
    return meta


def _type_problem(key: str, value, expected) -> str | None:
    names = expected if isinstance(expected, tuple) else (expected,)
    # true is no number here (bool is a subclass of int)
    if not isinstance(value, names) or (isinstance(value, bool) and bool not in names):
        wanted = " or ".join("null" if t is type(None) else t.__name__ for t in names)
        return f"{key} must be {wanted}, not {json.dumps(value)[:60]}"
    if key.removeprefix("generation.") in _POSITIVE and value <= 0:
        return f"{key} must be positive, not {value}"
    return None


def meta_problem(meta) -> str | None:
    """What is wrong with the contents of a ``daca.json``, or None."""
    if not isinstance(meta, dict):
        return f"must hold a JSON object, not {type(meta).__name__}"
    unknown = sorted(set(meta) - set(_META_TYPES))
    if unknown:
        return f"unknown key(s) {unknown}; daca.json holds only {sorted(_META_TYPES)}"
    for key, value in meta.items():
        if problem := _type_problem(key, value, _META_TYPES[key]):
            return problem
    if meta.get("prompt_format", "chat") not in PROMPT_FORMATS:
        return f"prompt_format must be one of {list(PROMPT_FORMATS)}, not {meta['prompt_format']!r}"
    for key, value in meta.get("generation", {}).items():
        if key in _GENERATION_TYPES and (
            problem := _type_problem(f"generation.{key}", value, _GENERATION_TYPES[key])
        ):
            return problem
    return None


# Weight files that are pickles: loading one may run code (torch.load's weights_only stops
# the known ways, but daca reads weights from safetensors only, which cannot).
# (A trainer's training_args.bin or optimizer.pt beside safetensors weights is never read.)
_PICKLE_WEIGHTS = ("pytorch_model*.bin", "adapter_model.bin", "model*.pt", "model*.pth", "*.ckpt")


def check_weights_format(path: str) -> None:
    """ModelFolderError for a local folder whose weights exist only as pickles."""
    folder = Path(path)
    if not folder.is_dir() or any(folder.glob("*.safetensors")):
        return
    pickles = sorted(f.name for pattern in _PICKLE_WEIGHTS for f in folder.glob(pattern))
    if pickles:
        raise ModelFolderError(
            f"{path} holds its weights only as a pickle ({', '.join(pickles[:3])}), which daca "
            "does not load (unpickling can run code); convert it to safetensors where you trust "
            "it, e.g. model.save_pretrained(folder, safe_serialization=True)"
        )


def check_remote_code(path: str, hub: dict, family: str, trust_remote_code: bool) -> None:
    """ModelFolderError for a config.json whose ``auto_map`` names code that transformers
    would have to run (a family daca does not run natively, without trust_remote_code)."""
    auto_map = hub.get("auto_map")
    if family in NATIVE or trust_remote_code or not auto_map:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if hub.get("model_type") in CONFIG_MAPPING:
        return  # transformers' own class is used; the folder's code is not run
    shown = json.dumps(auto_map)[:120]
    raise ModelFolderError(
        f"{path}: config.json's auto_map {shown} names code in the model folder for model_type "
        f"{hub.get('model_type')!r}, which daca does not run; use a LLaDA or Dream checkpoint, "
        "or load it with daca.models.load(..., trust_remote_code=True) if you trust that code"
    )


def hub_config(path: str) -> dict:
    """The raw ``config.json`` of a folder or hub name, read as data (no code runs)."""
    from transformers.utils import cached_file

    if Path(path).is_dir():
        if not (Path(path) / "config.json").is_file():
            raise OSError(f"{path} has no config.json: it is not a model folder")
        file = Path(path) / "config.json"
    else:
        file = Path(cached_file(path, "config.json"))
    try:
        config = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFolderError(f"{file} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelFolderError(f"{file} must hold a JSON object, not {type(config).__name__}")
    return config


def family_of(model_type: str | None) -> str:
    """``llada`` / ``dream`` for the families daca runs natively, else ``mlm``."""
    kind = str(model_type or "").lower()
    return kind if kind in NATIVE else "mlm"


def load(
    name_or_path: str | None = "tiny",
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
    quantization_config=None,
    check_padding: bool | None = None,
    base_in_4bit: bool | None = None,
) -> LoadedModel:
    """Load a masked diffusion LM, its tokenizer and special ids (``"tiny"``: the shipped model).

    dtype: weights dtype (``torch.bfloat16`` on a GPU); quantization_config: a transformers
    quantisation config (``load_4bit`` passes 4-bit NF4), which places the
    model on ``device`` while loading. trust_remote_code: run a folder's own modeling code, for
    families daca does not know (never for LLaDA and Dream). check_padding: test whether left
    padding changes the logits and, if so, install ``bucketed_forward`` with a warning (default:
    other masked LMs whose prompts are not padded to a fixed width). base_in_4bit: for a LoRA
    checkpoint, load its base in 4-bit NF4 (as a QLoRA run trained it) or in ``dtype``; None:
    as its ``daca.json`` says.
    """
    path = resolve(name_or_path)
    meta = read_meta(path)
    check_weights_format(path)
    if (Path(path) / "adapter_config.json").is_file():
        if base_in_4bit is None:
            base_in_4bit = bool(meta.get("base_in_4bit"))
        return _load_adapter(
            path, meta, device=device, dtype=dtype, trust=trust_remote_code, nf4=base_in_4bit
        )
    hub = hub_config(path)
    family = family_of(hub.get("model_type"))
    check_remote_code(path, hub, family, trust_remote_code)
    kwargs = {"use_safetensors": True}  # never a pickle, even from the hub
    if dtype is not None:
        kwargs["dtype"] = dtype
    if quantization_config is not None:
        # Quantised weights are placed while loading; they cannot be moved afterwards.
        place = torch.device(device)
        if place.type == "cuda":
            place = place.index if place.index is not None else torch.cuda.current_device()
        kwargs.update(quantization_config=quantization_config, device_map={"": place})
    if family in NATIVE:
        model = _load_native(path, family, hub, kwargs)
    else:
        from transformers import AutoModelForMaskedLM

        model = AutoModelForMaskedLM.from_pretrained(
            path, trust_remote_code=trust_remote_code, **kwargs
        )
    if quantization_config is None:
        model.to(device)
    model.eval()
    tokenizer = _load_tokenizer(
        path, model.config, family, trust_remote_code and family not in NATIVE
    )
    mask_id, eos_ids, pad_id = special_ids(family, hub, tokenizer, path)
    bundle = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        mask_id=mask_id,
        family=family,
        eos_ids=eos_ids,
        pad_id=pad_id,
        prompt_width=meta.get("prompt_width"),
        path=path,
        prompt_format=meta.get("prompt_format") or _legacy_format(meta),
        name=str(name_or_path or "tiny"),
        meta=meta,
    )
    if check_padding is None:
        check_padding = family not in NATIVE and bundle.prompt_width is None
    return adapt(bundle, check_padding=check_padding)


def _legacy_format(meta: dict) -> str:
    return "compact" if meta.get("family") == "tiny" else "chat"


def _load_native(path: str, family: str, hub: dict, kwargs: dict):
    """A LLaDA or Dream checkpoint into its transformers class; a weight the checkpoint lacks,
    or one the class has no place for, is an error (not a silently random layer)."""
    cls, make_config, key_mapping = NATIVE[family]
    model, info = cls.from_pretrained(
        path, config=make_config(hub), key_mapping=key_mapping, output_loading_info=True, **kwargs
    )
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = sorted(set(info["missing_keys"]) - tied)
    unexpected = sorted(info["unexpected_keys"])
    if missing or unexpected or info.get("mismatched_keys"):
        raise ValueError(
            f"{path}: the weights do not fit a {family} model of this config.json: missing "
            f"{missing[:4]}, unexpected {unexpected[:4]}, mismatched "
            f"{sorted(info.get('mismatched_keys') or [])[:4]}"
        )
    return model


def _load_tokenizer(path: str, config, family: str, trust_remote_code: bool):
    """The checkpoint's tokenizer. Dream's hub folder names its own ``DreamTokenizer`` class (a
    Qwen2 BPE tokenizer); without remote code it loads as transformers' Qwen2 tokenizer.
    ``config``: the model's, so that AutoTokenizer does not parse a config.json it cannot
    know."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            path, config=config, trust_remote_code=trust_remote_code
        )
    except (ValueError, OSError) as e:
        if family != "dream":
            raise
        from transformers import Qwen2TokenizerFast

        try:
            return Qwen2TokenizerFast.from_pretrained(path)
        except Exception:  # noqa: BLE001 - report the first, more telling error
            raise e from None


def _token_id(tokenizer, token: str) -> int | None:
    return tokenizer.get_vocab().get(token) if tokenizer is not None else None


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def special_ids(family: str, hub: dict, tokenizer, path: str = "") -> tuple[int, tuple, int]:
    """(mask id, end-of-sequence ids, pad id) read off the checkpoint.

    LLaDA and Dream: the mask is ``config.json``'s ``mask_token_id`` (else the tokenizer's mask
    token); the end ids are the config's ``eos_token_id``, the tokenizer's EOS and the family's
    end-of-turn token (the first fills targets); pad is the config's, else the tokenizer's,
    else the first end id. Other masked LMs: the tokenizer's mask, EOS (a BERT-style
    separator when there is none) and pad tokens.
    """
    if family not in NATIVE:
        return _tokenizer_ids(tokenizer, path)
    mask = hub.get("mask_token_id")
    if mask is None:
        mask = tokenizer.mask_token_id
        if mask is None:
            mask = _token_id(tokenizer, MASK_TOKENS[family])
    if mask is None:
        raise ValueError(f"{path}: neither config.json nor the tokenizer names a mask token")
    ends = _as_ids(hub.get("eos_token_id")) + _as_ids(tokenizer.eos_token_id)
    ends += [i for t in END_TOKENS[family] if (i := _token_id(tokenizer, t)) is not None]
    eos_ids = tuple(dict.fromkeys(ends))  # unique, in order
    if not eos_ids:
        raise ValueError(f"{path}: neither config.json nor the tokenizer names an end token")
    pad = hub.get("pad_token_id")
    pad = tokenizer.pad_token_id if pad is None else pad
    pad = eos_ids[0] if pad is None else int(pad)
    _check_known(family, hub, int(mask), eos_ids, pad, path)
    return int(mask), eos_ids, pad


def _tokenizer_ids(tok, path: str) -> tuple[int, tuple, int]:
    mask = tok.mask_token_id
    if mask is None:
        raise ValueError(
            f"{path}: the tokenizer has no mask token; a masked diffusion LM needs one"
        )
    # BERT-style tokenizers have no EOS: their separator ends a sequence.
    ends = _as_ids(tok.eos_token_id) + _as_ids(getattr(tok, "sep_token_id", None))
    if not ends:
        raise ValueError(f"{path}: the tokenizer has no end-of-sequence or separator token")
    pad = tok.pad_token_id if tok.pad_token_id is not None else ends[0]
    return int(mask), (ends[0],), int(pad)


def _check_known(family, hub, mask, eos_ids, pad, path) -> None:
    known = KNOWN_IDS.get(family)
    vocab = hub.get("embedding_size") or hub.get("vocab_size")
    if known is None or vocab != known.vocab_size:
        return
    if mask != known.mask_id or pad != known.pad_id or not set(known.eos_ids) <= set(eos_ids):
        warnings.warn(
            f"{path}: special ids mask={mask}, eos={eos_ids}, pad={pad} differ from the public "
            f"{family} checkpoints' (mask={known.mask_id}, eos={known.eos_ids}, "
            f"pad={known.pad_id}); using the checkpoint's",
            UserWarning,
            stacklevel=3,
        )


def load_4bit(
    name_or_path: str, *, device: str | torch.device = "cuda", dtype=torch.bfloat16
) -> LoadedModel:
    """``load`` with 4-bit NF4 weights on ``device`` (``daca.models.quant``); the other weights
    and the 4-bit layers' compute in ``dtype`` (bf16, as the paper; fp32 where bf16 is
    unwanted)."""
    from daca.models import quant

    quant.check_4bit_support(device)
    config = quant.bnb_config(compute_dtype=dtype)
    bundle = load(name_or_path, device=device, dtype=dtype, quantization_config=config)
    quant.keep_training_layout(bundle.model)
    return bundle


def _load_adapter(path: str, meta: dict, *, device, dtype, trust, nf4: bool) -> LoadedModel:
    """A LoRA checkpoint: its base (``daca.json``'s ``base_model``, else PEFT's
    ``base_model_name_or_path``) loaded through ``load`` (in 4-bit NF4 when ``nf4``), then the
    adapter on it."""
    from peft import PeftModel

    base_name = meta.get("base_model")
    if base_name is None:
        base_name = json.loads((Path(path) / "adapter_config.json").read_text()).get(
            "base_model_name_or_path"
        )
    if not base_name:
        raise ValueError(f"{path}: a LoRA adapter that names no base model")
    if nf4:
        bundle = load_4bit(base_name, device=device, dtype=dtype or torch.float32)
        bundle.model = PeftModel.from_pretrained(bundle.model, path).eval()  # placed: no .to()
    else:
        bundle = load(base_name, device=device, dtype=dtype, trust_remote_code=trust)
        bundle.model = PeftModel.from_pretrained(bundle.model, path).to(device).eval()
    bundle.path, bundle.name = path, path
    bundle.meta = {**bundle.meta, **meta}
    bundle.prompt_format = meta.get("prompt_format", bundle.prompt_format)
    return bundle


def save_pretrained(bundle: LoadedModel, folder, model=None, *, state_dict=None) -> Path:
    """Write a complete model folder that ``load``, ``daca eval`` and ``daca sample`` accept.

    ``model`` (default ``bundle.model``): a native family writes its hub layout; a PEFT model
    writes its adapter in PEFT's own format, and ``daca.json`` names the base to put it on.
    Beside it: the tokenizer and ``daca.json`` (``write_meta``).
    """
    folder = Path(folder)
    model = bundle.model if model is None else model
    kwargs = {} if state_dict is None else {"state_dict": state_dict}
    model.save_pretrained(folder, **kwargs)
    if bundle.tokenizer is not None:
        bundle.tokenizer.save_pretrained(folder)
    write_meta(bundle, folder, model)
    follow_umask(folder)
    return folder


def follow_umask(folder: Path) -> None:
    """Give every file written into ``folder`` the mode of a file the user creates: the weights
    are written to a private temporary file and renamed (mode 0600) while the rest is 0644."""
    umask = os.umask(0o022)  # reading the umask means setting it; restored at once
    os.umask(umask)
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)


def write_meta(bundle: LoadedModel, folder, model=None) -> None:
    """The ``daca.json`` of a model folder: what ``load`` needs beyond the weights and the
    tokenizer (family, prompt format and width, generation settings, a LoRA adapter's base)."""
    model = bundle.model if model is None else model
    meta = {"family": bundle.family, "prompt_format": bundle.prompt_format}
    if "generation" in bundle.meta:
        meta["generation"] = bundle.meta["generation"]
    if bundle.prompt_width is not None:
        meta["prompt_width"] = bundle.prompt_width
    if hasattr(model, "peft_config"):
        meta["base_model"] = _base_name(bundle)
        if getattr(model.get_base_model(), "is_loaded_in_4bit", False):
            meta["base_in_4bit"] = True  # the adapter was trained on NF4 base weights
    (Path(folder) / "daca.json").write_text(json.dumps(meta, indent=1) + "\n")


def _base_name(bundle: LoadedModel) -> str:
    """How a LoRA checkpoint names its base: the shipped name, else the base's path or name."""
    if bundle.meta.get("base_model"):
        return bundle.meta["base_model"]
    return bundle.name if bundle.name in SHIPPED else bundle.path or bundle.name


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
    # ``logits_to_keep``: an int k > 0 asks for the last k positions, a tensor for ascending
    # positions; a bucket drops its p pad positions, so it is asked for its real ones, shifted.
    keep = kwargs.get("logits_to_keep")
    if isinstance(keep, Tensor):
        rows_out = len(keep)
    else:
        rows_out = min(keep, T) if isinstance(keep, int) and keep > 0 else T
    pieces, order = [], []
    for p in pads.unique().tolist():
        rows = (pads == p).nonzero().squeeze(1)
        shifted = {"logits_to_keep": keep[keep >= p] - p} if isinstance(keep, Tensor) else {}
        logits = _logits(inner(input_ids[rows, p:], **(kwargs | shifted)))
        pieces.append(F.pad(logits, (0, 0, rows_out - logits.shape[1], 0)))
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
    """If left padding changes the logits, install the length-bucketed forward (with a
    warning). Idempotent; returns ``bundle``."""
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
