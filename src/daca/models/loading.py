"""``daca.models.load``: one loader for the shipped tiny models, local folders and hub models.

A model is recognised by its ``config.json``'s ``model_type``:

- the native families of ``daca.models.families.FAMILIES`` — LLaDA (``llada``: LLaDA-8B-Base/
  Instruct, LLaDA-1.5, the shipped tiny models), Dream (``Dream``: Dream-v0-7B, Dream-Coder-7B,
  DiffuCoder-7B) and dllm's A2D models (``a2d-qwen3``, ``a2d-qwen2``, ``a2d-llama``) — run on
  transformers' own Llama, Qwen2 and Qwen3 classes (``daca.models.native``): the folder's
  ``modeling_*.py`` is never imported, whatever ``trust_remote_code`` says;
- a masked LM transformers ships (BERT, ModernBERT …) is an ``AutoModelForMaskedLM``, and so is
  a folder's own code with ``trust_remote_code=True``; any other model type is refused in one
  line naming the native families, before any weights load.

Mask, end-of-sequence and pad ids come from the checkpoint's config and tokenizer; the known
values of the public checkpoints (the family table) are a check (a warning), not the source.

A folder written by daca (``daca.models.save_pretrained``, every training checkpoint) also holds
a ``daca.json``: the prompt format (``compact`` for the tiny models' task strings, ``chat``
otherwise), the generation settings the model was trained with, and for a LoRA checkpoint the
name of its base model, which ``load`` loads first and puts the adapter on.

The method core calls ``model(input_ids, attention_mask=...)`` with left-padded prompts and reads
"logits at position i predict token i" (``daca.core.modeling``). A masked LM whose logits change
under left padding even with the attention mask (it ignores the mask, or its positions are
absolute) gets the ``bucketed_forward`` adapter (``daca.models.padding``), installed on the model
itself, with a warning.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from daca.models.families import FAMILIES, config_problem, family_of, supported_families
from daca.models.native_classes import NATIVE
from daca.models.padding import adapt
from daca.shipped import SHIPPED, tiny_for_task  # noqa: F401 (tiny_for_task re-exported)


@dataclass
class LoadedModel:
    """A model with what the core and the trainer need to drive it.

    Unpacks as ``model, tokenizer, mask_id = daca.models.load(...)``.
    """

    model: torch.nn.Module
    tokenizer: object
    mask_id: int
    family: str  # a name of daca.models.families.FAMILIES, or "mlm"
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
        f"{hub.get('model_type')!r}, which daca does not run; use a checkpoint of a family daca "
        f"runs natively: {supported_families()}; or load it with daca.models.load(..., "
        "trust_remote_code=True) if you trust that code"
    )


def check_architecture(path: str, hub: dict, family: str, trust_remote_code: bool) -> None:
    """ModelFolderError, before any weights load, for a model type daca cannot run: neither a
    native family nor a masked LM transformers ships (nor the folder's own code, trusted), or a
    native family's type on a config.json that is not that family's architecture."""
    if family in FAMILIES:
        if problem := config_problem(FAMILIES[family], hub):
            raise ModelFolderError(f"{path}: {problem}; daca runs {supported_families()}")
        return
    if trust_remote_code and hub.get("auto_map"):
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    kind = hub.get("model_type")
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return
    raise ModelFolderError(
        f"{path}: config.json's model_type {kind!r} is not a masked diffusion LM daca can run: "
        f"the native families are {supported_families()}; other masked LMs must be a model type "
        "transformers ships as a masked LM (bert, modernbert …)"
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
    family = family_of(hub.get("model_type"), hub)
    check_remote_code(path, hub, family, trust_remote_code)
    check_architecture(path, hub, family, trust_remote_code)
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
    if family in NATIVE:
        check_ids_fit(model, path, mask_id=mask_id, pad_id=pad_id)
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
    """A native family's checkpoint into its transformers class; a weight the checkpoint lacks,
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
        tokenizer = AutoTokenizer.from_pretrained(
            path, config=config, trust_remote_code=trust_remote_code
        )
    except (ValueError, OSError) as e:
        if family != "dream":
            raise
        from transformers import Qwen2TokenizerFast

        try:
            tokenizer = Qwen2TokenizerFast.from_pretrained(path)
        except Exception:  # noqa: BLE001 - report the first, more telling error
            raise e from None
    if family in FAMILIES:
        # What the family's template reads beside the messages (daca.models.prompts.render_chat).
        tokenizer.daca_chat_kwargs = dict(FAMILIES[family].chat_kwargs)
    return tokenizer


def _token_id(tokenizer, token: str) -> int | None:
    return tokenizer.get_vocab().get(token) if tokenizer is not None else None


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def special_ids(family: str, hub: dict, tokenizer, path: str = "") -> tuple[int, tuple, int]:
    """(mask id, end-of-sequence ids, pad id) read off the checkpoint.

    Native families: the mask is ``config.json``'s ``mask_token_id`` (else the tokenizer's mask
    token, else the family's mask token looked up in the tokenizer); the end ids are the
    config's ``eos_token_id``, the tokenizer's EOS and the family's end tokens (the first fills
    targets); pad is the config's, else the tokenizer's, else the first end id. Other masked
    LMs: the tokenizer's mask, EOS (a BERT-style separator when there is none) and pad tokens.
    """
    if family not in NATIVE:
        return _tokenizer_ids(tokenizer, path)
    mask = hub.get("mask_token_id")
    if mask is None:
        mask = tokenizer.mask_token_id
        if mask is None:
            mask = _token_id(tokenizer, FAMILIES[family].mask_token)
    if mask is None:
        raise ValueError(f"{path}: neither config.json nor the tokenizer names a mask token")
    ends = _as_ids(hub.get("eos_token_id")) + _as_ids(tokenizer.eos_token_id)
    ends += [i for t in FAMILIES[family].end_tokens if (i := _token_id(tokenizer, t)) is not None]
    eos_ids = tuple(dict.fromkeys(ends))  # unique, in order
    if not eos_ids:
        raise ValueError(f"{path}: neither config.json nor the tokenizer names an end token")
    pad = hub.get("pad_token_id")
    pad = tokenizer.pad_token_id if pad is None else pad
    pad = eos_ids[0] if pad is None else int(pad)
    _check_known(family, hub, int(mask), eos_ids, pad, path)
    return int(mask), eos_ids, pad


def check_ids_fit(model, path: str, **ids: int) -> None:
    """ValueError for a special id with no row in the model's embedding (a token the tokenizer
    added without the embedding growing, as an A2D conversion of Llama 3 leaves it)."""
    rows = model.get_input_embeddings().num_embeddings
    for name, value in ids.items():
        if not 0 <= value < rows:
            raise ValueError(
                f"{path}: the {name.removesuffix('_id')} token id {value} has no row in the "
                f"model's {rows}-row embedding; resize the embedding to the tokenizer "
                "(model.resize_token_embeddings(len(tokenizer))) and save it again"
            )


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
    known = FAMILIES[family].known_ids
    vocab = hub.get("embedding_size") or hub.get("vocab_size")
    if known is None or vocab != known.vocab_size:
        return
    if mask != known.mask_id or pad not in known.pad_ids or not set(known.eos_ids) <= set(eos_ids):
        warnings.warn(
            f"{path}: special ids mask={mask}, eos={eos_ids}, pad={pad} differ from the public "
            f"{family} checkpoints' (mask={known.mask_id}, eos={known.eos_ids}, "
            f"pad={'/'.join(map(str, known.pad_ids))}); using the checkpoint's",
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
