"""QLoRA's base model: 4-bit NF4 weights with double quantisation (METHOD.md §5, as in the d1/wd1
reference codes), through bitsandbytes (>= 0.50) on any device it has a backend for: a CUDA GPU,
and also the CPU (bf16 or fp32 compute), so that the paper's QLoRA path runs in CI.

bitsandbytes is imported only here and only when a 4-bit model is asked for; where it is
missing, or has no 4-bit backend for the device, the error says so before anything is loaded.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def bnb_config(
    *, compute_dtype: torch.dtype = torch.bfloat16, quant_storage: torch.dtype | None = None
):
    """The paper's quantisation: NF4, double quantisation, ``compute_dtype`` (the paper: bf16).

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
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=quant_storage,
    )


def check_4bit_support(device: str | torch.device) -> None:
    """Raise a RuntimeError that says what is missing for 4-bit loading on ``device``: the
    bitsandbytes package, or its NF4 kernels for that device (probed on 64 numbers)."""
    device = torch.device(device)
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RuntimeError(
            "load_in_4bit needs the bitsandbytes package (>= 0.50, which also runs on a CPU): "
            "pip install bitsandbytes (or daca-grpo[quant])"
        )
    import bitsandbytes
    import bitsandbytes.functional as bnbf

    try:
        packed, state = bnbf.quantize_4bit(torch.ones(64, device=device), quant_type="nf4")
        bnbf.dequantize_4bit(packed, state)
    except (RuntimeError, NotImplementedError, AssertionError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RuntimeError(
            f"load_in_4bit: bitsandbytes {bitsandbytes.__version__} has no 4-bit NF4 backend "
            f"for device {device} ({first}). Run on a device it supports (a CUDA GPU, or "
            "device=cpu), or set load_in_4bit=false"
        ) from None


def keep_training_layout(model) -> None:
    """Keep bitsandbytes from repacking 4-bit weights for its CPU inference kernel.

    On a CPU with AVX512-BF16, the first forward in eval mode without gradients (a rollout)
    repacks each ``Linear4bit`` for ``gemv_4bit``, which has no autograd: every later training
    forward would then pass no gradient through the base layers (bitsandbytes 0.50 warns
    "an autograd kernel was not registered"), and layers narrower than 64 fail to repack."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def is_4bit(model) -> bool:
    """Whether ``model`` (or the base of a PEFT model) holds bitsandbytes 4-bit layers."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(base, "is_loaded_in_4bit", False))


def prepare_for_training(model):
    """PEFT's ``prepare_model_for_kbit_training`` (what TRL runs for the reference codes on a
    4-bit base): base weights frozen, the non-quantised ones (embeddings, norms, head) upcast to
    fp32. Gradient checkpointing stays the trainer's own (``families.enable_gradient_
    checkpointing``, non-reentrant, which needs no input-gradient hook)."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
