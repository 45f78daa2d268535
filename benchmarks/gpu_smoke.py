"""GPU smoke test: a few real training steps of a random LLaDA-shaped model through the trainer.

The model is a bidirectional ModernBERT of LLaDA's vocabulary and head size with ~1.1 B
parameters (hidden 2048, 16 layers, MLP 6144), bf16, a rank-128 LoRA and gradient checkpointing,
on 4x4 Sudoku prompts left padded to 200 tokens (the reference codes' prompt budget). Each base
method runs as base and as full DACA (DPS + SML) at L = 256, 128 denoising steps, blocks of 32,
G = 6; the script prints per run the median step time, the rollout's share of it and the peak
GPU memory, and per method the overhead ratios: DPS = rollout time full / base (recording the
trace is the only difference there), SML = update time full / base. With bitsandbytes
installed, one more run loads the base model in 4-bit NF4 (QLoRA). Sized for < 5 minutes on
one H100/H200; runs past ``--budget`` seconds are skipped.

    python benchmarks/gpu_smoke.py            # on a GPU (see gpu_smoke.sh)
    python benchmarks/gpu_smoke.py --tiny     # the same code paths on a CPU in seconds
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from daca.config import load_config
from daca.models.tiny import build_model, build_tokenizer, tiny_config
from daca.trainer import Trainer

GPU = dict(vocab=126464, hidden=2048, layers=16, heads=16, mlp=6144, prompt_width=200,
           gen_length=256, steps=128, block_length=32)  # fmt: skip
TINY = dict(vocab=64, hidden=64, layers=2, heads=2, mlp=128, prompt_width=24,
            gen_length=16, steps=8, block_length=8)  # fmt: skip
RATIO_BETA = {"diffu_grpo": 0.04, "gdpo": 0.0, "wd1": 0.0}


def save_random_model(folder: Path, size: dict, dtype: torch.dtype, device: str) -> int:
    """A random LLaDA-shaped masked LM in the shipped model's folder format; its parameters.
    Initialised on ``device`` (a GPU initialises a billion parameters in a moment)."""
    cfg = tiny_config(
        size["vocab"],
        hidden_size=size["hidden"],
        num_layers=size["layers"],
        num_heads=size["heads"],
        intermediate_size=size["mlp"],
        max_positions=size["prompt_width"] + size["gen_length"] + 64,
    )
    with torch.device(device):
        model = build_model(cfg, seed=0).to(dtype)
    model.save_pretrained(folder)
    n = sum(p.numel() for p in model.parameters())
    del model
    build_tokenizer().save_pretrained(folder)
    # The tiny family: compact Sudoku prompts, left padded to a fixed width.
    meta = {"family": "tiny", "prompt_width": size["prompt_width"]}
    (folder / "daca.json").write_text(json.dumps(meta))
    return n


def run(folder, out, name, method, variant, size, args, extra=()) -> dict:
    """``args.steps`` training steps of one configuration; timings of all but the first."""
    cuda = not args.tiny
    overrides = [
        f"name={name}", f"output_dir={out}", f"model={folder}", "task=sudoku",
        f"method={method}", f"num_iterations={1 if method == 'wd1' else args.mu}",
        f"beta={RATIO_BETA[method]}", "num_generations=6", "per_device_train_batch_size=6",
        "gradient_accumulation_steps=1", f"max_steps={args.steps}", "train_size=60",
        "eval_size=6", "tensorboard=false", f"bf16={str(cuda).lower()}",
        "gradient_checkpointing=true", "lora.enabled=true", "lora.r=128", "lora.alpha=64",
        "lora.target_modules=[Wqkv, Wo, Wi]", f"device={'cuda' if cuda else 'cpu'}",
        f"generation.gen_length={size['gen_length']}", f"generation.steps={size['steps']}",
        f"generation.block_length={size['block_length']}", "generation.temperature=0.9",
        f"dps.enabled={str(variant == 'full').lower()}",
        f"sml.enabled={str(variant == 'full').lower()}", "sml.num_strata=4", *extra,
    ]  # fmt: skip
    cfg = load_config(None, overrides)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg, progress=False)
    history = [trainer.train_step() for _ in range(args.steps)]
    peak = torch.cuda.max_memory_allocated() / 1024**3 if cuda else float("nan")
    del trainer
    gc.collect()
    timed = history[1:] or history  # the first step compiles kernels and warms caches
    med = {k: statistics.median(h[k] for h in timed) for k in ("time_rollout", "time_update")}
    med["time_reward"] = statistics.median(h["time_reward"] for h in timed)
    step = sum(med.values())
    return {"step": step, "rollout_share": med["time_rollout"] / step, "peak_gib": peak, **med}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (code check)")
    ap.add_argument("--steps", type=int, default=4, help="training steps per run (first = warm-up)")
    ap.add_argument("--mu", type=int, default=2, help="μ of the ratio methods (paper: 8-12)")
    ap.add_argument("--methods", default="diffu_grpo,wd1,gdpo")
    ap.add_argument("--budget", type=float, default=270.0, help="skip runs after this many s")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5 renames
    start = time.perf_counter()
    if args.tiny:
        torch.set_num_threads(1)
        size, dtype = TINY, torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: run with --tiny to check the code paths on a CPU")
        size, dtype = GPU, torch.bfloat16
        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        folder, out = Path(tmp) / "model", Path(tmp) / "runs"
        n = save_random_model(folder, size, dtype, "cpu" if args.tiny else "cuda")
        print(
            f"random LLaDA-shaped model: {n / 1e6:,.1f} M parameters, vocab {size['vocab']}, "
            f"prompts {size['prompt_width']} + L {size['gen_length']}, {size['steps']} steps, "
            f"block {size['block_length']}, G 6, LoRA r 128, μ {args.mu} (ratio methods)"
        )
        header = f"{'run':22s} {'step s':>8s} {'rollout':>8s} {'update s':>9s} {'peak GiB':>9s}"
        print(header)
        results = {}
        for method in args.methods.split(","):
            for variant in ("base", "full"):
                name = f"{method}-{variant}"
                if time.perf_counter() - start > args.budget:
                    print(f"{name:22s} skipped (past the {args.budget:.0f} s budget)")
                    continue
                r = results[name] = run(folder, out, name, method, variant, size, args)
                print(
                    f"{name:22s} {r['step']:8.2f} {r['rollout_share']:8.1%} "
                    f"{r['time_update']:9.2f} {r['peak_gib']:9.2f}".replace("nan", "n/a")
                )
        print("overhead of full DACA over base (same method, same machine):")
        for method in args.methods.split(","):
            base, full = results.get(f"{method}-base"), results.get(f"{method}-full")
            if base and full:
                dps = full["time_rollout"] / base["time_rollout"]
                sml = full["time_update"] / base["time_update"]
                step = full["step"] / base["step"]
                print(f"  {method:10s} DPS (rollout) {dps:.3f}x   SML (update) {sml:.3f}x   "
                      f"step {step:.3f}x")  # fmt: skip
        if args.tiny:
            pass
        elif importlib.util.find_spec("bitsandbytes") is None:
            print("QLoRA (4-bit NF4): skipped, bitsandbytes is not installed")
        elif time.perf_counter() - start > args.budget:
            print("QLoRA (4-bit NF4): skipped (past the budget)")
        else:
            r = run(folder, out, "wd1-full-4bit", "wd1", "full", size, args, ["load_in_4bit=true"])
            print(f"QLoRA wd1 full DACA: step {r['step']:.2f} s, peak {r['peak_gib']:.2f} GiB")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
