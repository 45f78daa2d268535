"""Train the shipped tiny masked diffusion LM on 4x4 Sudoku with TRL's GRPOTrainer + DACA.

    pip install 'daca-grpo[trl]'
    python examples/trl_sudoku.py                 # a few steps on the CPU
    python examples/trl_sudoku.py --steps 50 --lam 0   # d1's Diffu-GRPO without DPS

The trainer is TRL's (data, rewards, optimizer loop, logging); each micro-batch is computed as
``daca train`` computes it (``daca.integrations.trl``): the diffusion sampler, Diffu-GRPO's
mean-field / SML log-probs, group advantages and clipped loss, and the DPS per-token multipliers.
Held-out accuracy (temperature 0) is printed before and after.
"""

from __future__ import annotations

import argparse
import time

import torch
from datasets import Dataset

from daca.integrations.trl import DACAGRPOConfig, DACAGRPOTrainer
from daca.models.loading import load
from daca.tasks import get_task
from daca.train.config import GenerationConfig
from daca.train.evaluation import evaluate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="'tiny' (shipped) or a model folder")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (x6 completions)")
    p.add_argument("--eval-size", type=int, default=48, help="held-out puzzles")
    p.add_argument("--lam", type=float, default=0.5, help="DPS strength lambda (0: no DPS)")
    p.add_argument(
        "--sml", action="store_true", help="SML-enriched log-probs (METHOD.md §3: hurts Sudoku)"
    )
    p.add_argument("--output-dir", default="runs/trl-sudoku")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(2)

    bundle = load(args.model)
    task = get_task("sudoku")
    rows = task.load("train", limit=max(64, args.prompts * args.steps), seed=args.seed)
    train = Dataset.from_list([{"prompt": task.compact_prompt(r), **r} for r in rows])
    held_out = task.load("test", limit=args.eval_size, seed=args.seed)
    gen = GenerationConfig(gen_length=16, steps=8, block_length=16)

    config = DACAGRPOConfig(
        output_dir=args.output_dir,
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=args.seed,
        max_steps=args.steps,
        learning_rate=1e-4,
        per_device_train_batch_size=6 * args.prompts,
        num_generations=6,
        num_iterations=2,  # mu inner updates per rollout, each with its own likelihood masks
        epsilon=0.5,
        beta=0.0,
        method="diffu_grpo",  # d1's loss: its mean over the batch's completion tokens
        scale_rewards="none",  # A = r - mean(r), as the reference codes
        gen_length=gen.gen_length,
        steps=gen.steps,
        block_length=gen.block_length,
        temperature=0.9,
        dps_enabled=True,
        dps_lam=args.lam,
        dps_stride=2,
        sml_enabled=args.sml,
        sml_num_strata=4,
    )
    # The loaded bundle supplies the tokenizer, mask id, end-of-sequence ids and prompt width.
    trainer = DACAGRPOTrainer(
        bundle, reward_funcs=task.reward_funcs, args=config, train_dataset=train
    )

    before = evaluate(bundle, task, held_out, gen).mean
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = evaluate(bundle, task, held_out, gen).mean

    keys = ("reward", "loss", "entropy", "dps/multiplier_min", "dps/multiplier_max")
    for log in trainer.state.log_history:
        if "loss" in log:
            cells = (f"{k} {log[k]:.4f}" if k in log else f"{k} -" for k in keys)
            print(f"step {log['step']:3d}  " + "  ".join(cells))
    print(f"{args.steps} steps in {seconds:.1f} s")
    print(f"held-out cell accuracy ({len(held_out)} puzzles): {before:.3f} -> {after:.3f}")


if __name__ == "__main__":
    main()
