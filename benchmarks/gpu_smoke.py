"""GPU smoke test: a few real training steps of a random LLaDA-shaped model through the trainer.

The model is a random LLaDA-8B-shaped model of ~1.2 B parameters: LLaDA's architecture (a Llama
block: RMSNorm, RoPE θ 5e5, SwiGLU, no bias, untied head, bidirectional), its vocabulary (126464)
and special ids, its head size (128) and MLP ratio (3), at hidden 2048 and 12 layers. It is
written in LLaDA's hub layout (``model_type`` "llada", LLaDA's key names, through
``daca.models.native``) and loaded by the trainer through ``daca.models.load`` exactly as
LLaDA-8B is (a GPU machine here cannot download LLaDA). bf16, LoRA r 128 on q … down_proj,
gradient checkpointing, 4x4 Sudoku prompts (the tokenizer is the tiny models' character one)
left padded to 200 tokens with the attention mask, so that each rollout forward has the
reference codes' prompt budget.

Each base method runs as base and as full DACA (DPS + SML) at L = 256, 128 denoising steps,
blocks of 32, G = 6; the script prints per run the median step time, the rollout's share of it
and the peak GPU memory, and per method the overhead ratios: DPS = rollout time full / base
(recording the trace is the only difference there), SML = update time full / base. With
bitsandbytes installed, one more run loads the base model in 4-bit NF4 (QLoRA). Sized for
< 5 minutes on one H100/H200; runs past ``--budget`` seconds are skipped.

    python benchmarks/gpu_smoke.py            # on a GPU (see gpu_smoke.sh)
    python benchmarks/gpu_smoke.py --tiny     # the same code paths on a CPU in seconds
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from daca.models.native import LLaDAForDiffusionLM, llama_config
from daca.models.tiny import build_tokenizer, save_tiny, tiny_llada_config
from daca.train.config import load_config
from daca.train.trainer import Trainer

# LLaDA-8B-Instruct's vocabulary and special ids (<|mdm_mask|>; <|endoftext|> as EOS and pad,
# and <|eot_id|>, which LLaDA's tokenizer adds and the character tokenizer here lacks): the
# rollout's logits, sampling and end-of-text handling run at the real scale and ids.
LLADA_VOCAB = dict(vocab_size=126464, embedding_size=126464, mask_token_id=126336,
                   eos_token_id=[126081, 126348], pad_token_id=126081)  # fmt: skip
# --tiny: a vocabulary of 256 with the special ids past the tokenizer's 23 characters, as above.
TINY_VOCAB = dict(vocab_size=256, embedding_size=256, mask_token_id=255,
                  eos_token_id=[254, 253], pad_token_id=254)  # fmt: skip
GPU = dict(hidden=2048, layers=12, heads=16, mlp=6144, prompt_width=200, vocab=LLADA_VOCAB,
           gen_length=256, steps=128, block_length=32)  # fmt: skip
TINY = dict(hidden=64, layers=2, heads=2, mlp=192, prompt_width=24, vocab=TINY_VOCAB,
            gen_length=16, steps=8, block_length=8)  # fmt: skip
RATIO_BETA = {"diffu_grpo": 0.04, "gdpo": 0.0, "wd1": 0.0}


def save_random_model(folder: Path, size: dict, dtype: torch.dtype, device: str) -> int:
    """A random LLaDA-8B-shaped model in LLaDA's hub layout (``save_tiny``: hub key names and
    config.json, the tokenizer, a ``daca.json`` of compact prompts left padded to
    ``prompt_width``); its parameters. Initialised on ``device`` (a GPU initialises a billion
    parameters in a moment); the seed fixes the weights without touching the global RNG."""
    tokenizer = build_tokenizer()
    hub = tiny_llada_config(
        tokenizer,
        hidden_size=size["hidden"],
        num_layers=size["layers"],
        num_heads=size["heads"],
        intermediate_size=size["mlp"],
        max_positions=4096,  # LLaDA-8B's max_sequence_length
    )
    hub.update(size["vocab"], rope_theta=500000.0)
    cuda = list(range(torch.cuda.device_count())) if device != "cpu" else []
    with torch.random.fork_rng(devices=cuda), torch.device(device):
        torch.manual_seed(0)
        model = LLaDAForDiffusionLM(llama_config(hub)).to(dtype)
    save_tiny(folder, model, tokenizer, prompt_width=size["prompt_width"])
    n = sum(p.numel() for p in model.parameters())
    del model
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
        f"device={'cuda' if cuda else 'cpu'}",  # LoRA targets: LLaDA's default, q … down_proj
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


def cached_rollout(folder: Path, size: dict, args) -> None:
    """Rollout time with the block KV cache (docs/rollouts.md): ``cache`` none vs dual, without
    and with the DPS trace (s = 4), 6 prompts of the model's width, the run's L and steps."""
    from daca.core.sampler import generate
    from daca.models import load

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    bundle = load(str(folder), device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(0)
    prompt = torch.randint(4, 20, (6, size["prompt_width"]), generator=g, device=device)
    gen = dict(
        gen_length=size["gen_length"], steps=size["steps"], block_length=size["block_length"]
    )
    times = {}
    for cache in ("none", "dual"):
        for stride in (None, 4):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = generate(bundle.model, prompt, mask_id=bundle.mask_id, cache=cache,
                           dps_stride=stride, **gen)  # fmt: skip
            if device == "cuda":
                torch.cuda.synchronize()
            times[cache, stride] = time.perf_counter() - t0
            f = out.forwards
            took = times[cache, stride]
            print(f"  rollout cache={cache:5s} dps_stride={stride}: {took:6.2f} s "
                  f"(forwards {f['full']} full / {f['block']} block)")  # fmt: skip
    for stride in (None, 4):
        ratio = times["none", stride] / times["dual", stride]
        print(f"  dual vs none, dps_stride={stride}: {ratio:.2f}x")
    del bundle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (code check)")
    ap.add_argument("--steps", type=int, default=4, help="training steps per run (first = warm-up)")
    ap.add_argument("--mu", type=int, default=2, help="μ of the ratio methods (paper: 8-12)")
    ap.add_argument("--methods", default="diffu_grpo,wd1,gdpo")
    ap.add_argument("--budget", type=float, default=270.0, help="skip runs after this many s")
    ap.add_argument("--no-cache-rollout", action="store_true", help="skip the cached rollout")
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
            f"random LLaDA-8B-shaped model (LLaDA hub layout): {n / 1e6:,.1f} M parameters, "
            f"vocab {size['vocab']['vocab_size']}, d {size['hidden']} x {size['layers']} layers, "
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
        if not args.no_cache_rollout:
            print("rollout with the block KV cache (6 prompts):")
            cached_rollout(folder, size, args)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
