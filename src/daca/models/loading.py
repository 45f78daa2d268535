"""``daca.models.load``: one loader for the shipped tiny model, local folders and hub models.

A folder written by ``daca pretrain`` holds a ``daca.json`` naming its family and prompt width;
other folders and hub names are recognised by their config's ``model_type``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

TINY_PATH = Path(__file__).resolve().parent.parent / "assets" / "tiny"

# Family defaults (METHOD.md §5 for LLaDA). Keys: model_type in the HF config.
_FAMILIES = {
    "llada": {"family": "llada", "mask_id": 126336, "eos_ids": (126081, 126348)},
    "dream": {"family": "dream", "mask_id": 151666, "eos_ids": (151643,)},
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

    def __iter__(self):
        return iter((self.model, self.tokenizer, self.mask_id))


def resolve(name_or_path: str | None) -> str:
    if name_or_path in (None, "", "tiny"):
        if not (TINY_PATH / "config.json").is_file():
            raise FileNotFoundError(
                f"the shipped tiny model is missing from {TINY_PATH}; run `daca pretrain` "
                "or reinstall daca-grpo"
            )
        return str(TINY_PATH)
    return str(name_or_path)


def load(
    name_or_path: str | None = "tiny",
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = True,
) -> LoadedModel:
    """Load a masked diffusion LM, its tokenizer and mask id (``"tiny"``: the shipped model)."""
    from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, AutoTokenizer

    path = resolve(name_or_path)
    meta_file = Path(path) / "daca.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    family = _FAMILIES.get(str(config.model_type).lower(), {"family": meta.get("family", "mlm")})
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    if family["family"] in ("llada", "dream"):
        model = AutoModel.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    else:
        model = AutoModelForMaskedLM.from_pretrained(path, **kwargs)
    model.to(device).eval()
    mask_id = family.get("mask_id", tokenizer.mask_token_id)
    if mask_id is None:
        raise ValueError(
            f"{path}: the tokenizer has no mask token; a masked diffusion LM needs one"
        )
    eos_ids = family.get("eos_ids", tuple(i for i in (tokenizer.eos_token_id,) if i is not None))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        mask_id=int(mask_id),
        family=family["family"],
        eos_ids=tuple(int(i) for i in eos_ids),
        pad_id=int(pad_id),
        prompt_width=meta.get("prompt_width"),
        path=path,
    )
