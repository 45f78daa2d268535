"""The settings of `daca pretrain` (``daca.tools.pretrain``), apart so that the command's
help reads its defaults without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PretrainConfig:
    task: str = "sudoku"  # sudoku | countdown | sudoku-trace | countdown-trace | mix
    out: str = "runs/pretrain-tiny"
    seed: int = 0
    max_steps: int = 1500
    batch_size: int = 128
    learning_rate: float = 1e-3
    warmup_steps: int = 0  # linear warmup of the learning rate from 0 over this many steps
    grad_clip: float | None = None  # clip the gradient's global norm to this
    block_noise: float = 0.0  # fraction of examples noised block by block, as the sampler sees
    hide_answer_steps: int = 0  # first steps: the answer always masked, out of the loss
    eval_every: int = 5
    eval_size: int = 200
    target_accuracy: float | None = 0.40  # stop once the stopping task's held-out metric >= this
    stop_task: str = "sudoku"  # which task's metric the stopping rule reads (mix: sudoku)
    train_size: int = 4000  # generated training examples per task
    max_minutes: float | None = None  # stop (and save) after this much wall time
    init_from: str | None = None  # continue from a saved tiny model (its steps and history)
    also_eval: tuple[str, ...] = ()  # tasks measured on the final model only (held_out)
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 256
    gen_length: int = 16
    steps: int = 8
    block_length: int = 16
