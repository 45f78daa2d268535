#!/usr/bin/env bash
# GPU smoke test of real-scale training: a ~1.2 B-parameter random LLaDA-8B-shaped model (LLaDA's
# architecture, vocabulary, special ids and head size, written in LLaDA's hub layout and loaded
# through daca.models.load as LLaDA-8B is), bf16, LoRA r 128, L = 256, 128 denoising steps,
# blocks of 32, G = 6, a few trainer steps of each base method as base and as full DACA (plus a
# 4-bit QLoRA run when bitsandbytes is installed).
# Prints step time, rollout share, peak GPU memory and the DPS and SML overhead ratios.
# Sized for < 5 minutes on one H100/H200-class GPU.
#
#   bash benchmarks/gpu_smoke.sh                 # GPU
#   bash benchmarks/gpu_smoke.sh --tiny          # the same code on a CPU, in seconds
#   bash benchmarks/gpu_smoke.sh --steps 4 --mu 4 --methods wd1
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ " $* " != *" --tiny "* ]]; then
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "no NVIDIA GPU visible; use --tiny to check the code paths on a CPU" >&2
    exit 2
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
exec timeout 330 python benchmarks/gpu_smoke.py "$@"
