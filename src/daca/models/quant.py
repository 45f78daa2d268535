"""QLoRA's base model: 4-bit NF4 weights with double quantisation and bf16 compute
(METHOD.md §5, as in the d1/wd1 reference codes), through bitsandbytes on a CUDA GPU.

bitsandbytes is imported only here and only when a 4-bit model is asked for; without a GPU the
error says so before anything is loaded.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from daca.models.loading import LoadedModel, load


def bnb_config(*, quant_storage: torch.dtype | None = None):
    """The paper's quantisation: NF4, double quantisation, bf16 compute.

    quant_storage: the dtype the packed 4-bit weights are stored in. FSDP can only shard
    parameters of the dtype of the others, so under FSDP it must be bf16 (same bytes); the
    default (None) picks bf16 when ``accelerate launch`` runs FSDP, else bitsandbytes' uint8.
    """
    from transformers import BitsAndBytesConfig

    if quant_storage is None:
        fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        quant_storage = torch.bfloat16 if fsdp else torch.uint8
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=quant_storage,
    )


def check_4bit_support(device: str | torch.device) -> None:
    """Raise a RuntimeError that says what is missing for 4-bit loading on ``device``."""
    device = torch.device(device)
    if not torch.cuda.is_available() or device.type != "cuda":
        where = "none is available here" if not torch.cuda.is_available() else f"got {device}"
        raise RuntimeError(
            f"load_in_4bit needs a CUDA GPU (bitsandbytes NF4 kernels) and {where}. Train on a "
            "GPU machine, or set load_in_4bit=false (and bf16=false on a CPU)."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RuntimeError(
            "load_in_4bit needs the bitsandbytes package on this GPU machine: "
            "pip install bitsandbytes"
        )


def load_4bit(
    name_or_path: str, *, device: str | torch.device = "cuda", dtype=torch.bfloat16
) -> LoadedModel:
    """``daca.models.load`` with 4-bit NF4 weights on ``device`` (the other weights in dtype)."""
    check_4bit_support(device)
    return load(name_or_path, device=device, dtype=dtype, quantization_config=bnb_config())
