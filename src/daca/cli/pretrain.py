"""``daca pretrain``: train the embedded tiny masked diffusion LM from scratch."""

from __future__ import annotations

import sys

from daca.tools.pretrain_config import PretrainConfig

# Tasks with a compact prompt for the tiny model ("mix" is sudoku and countdown together).
PRETRAIN_TASKS = ("sudoku", "countdown", "countdown-public", "sudoku-trace", "countdown-trace")


def add_arguments(p) -> None:
    d = PretrainConfig()
    p.add_argument(
        "--task",
        choices=[*PRETRAIN_TASKS, "mix"],
        default=d.task,
    )
    p.add_argument("--out", default=d.out, help="output model folder")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-steps", type=int, default=d.max_steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--learning-rate", type=float, default=d.learning_rate)
    p.add_argument(
        "--warmup-steps", type=int, default=d.warmup_steps, help="linear learning-rate warmup"
    )
    p.add_argument("--grad-clip", type=float, help="clip the gradient norm to this")
    p.add_argument(
        "--block-noise",
        type=float,
        default=d.block_noise,
        help="fraction of examples noised as the block sampler sees them (earlier blocks "
        "clean, later ones masked)",
    )
    p.add_argument(
        "--hide-answer-steps",
        type=int,
        default=d.hide_answer_steps,
        help="for this many first steps the answer is always masked and out of the loss "
        "(the reasoning is learned first)",
    )
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-size", type=int, default=d.eval_size)
    p.add_argument(
        "--target-accuracy",
        type=float,
        default=d.target_accuracy,
        help="stop once the held-out metric of --stop-task reaches this (negative: never)",
    )
    p.add_argument("--stop-task", default=d.stop_task)
    p.add_argument("--train-size", type=int, default=d.train_size, help="examples per task")
    p.add_argument("--max-minutes", type=float, help="stop and save after this wall time")
    p.add_argument("--init-from", help="a saved tiny model to continue training (same task)")
    p.add_argument(
        "--also-eval", nargs="*", default=[], help="tasks measured on the final model only"
    )
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--num-heads", type=int, default=d.num_heads)
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    p.add_argument("--gen-length", type=int, default=d.gen_length, help="completion tokens L")
    p.add_argument("--steps", type=int, default=d.steps, help="denoising steps (paper: L/2)")
    p.add_argument("--block-length", type=int, default=d.block_length)


def run(args) -> int:
    from daca.tools.pretrain import pretrain
    from daca.train.interrupts import Interrupted

    cfg = PretrainConfig(
        task=args.task,
        out=args.out,
        seed=args.seed,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        grad_clip=args.grad_clip,
        block_noise=args.block_noise,
        hide_answer_steps=args.hide_answer_steps,
        eval_every=args.eval_every,
        eval_size=args.eval_size,
        target_accuracy=None if args.target_accuracy < 0 else args.target_accuracy,
        stop_task=args.stop_task,
        train_size=args.train_size,
        max_minutes=args.max_minutes,
        init_from=args.init_from,
        also_eval=tuple(args.also_eval),
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
        gen_length=args.gen_length,
        steps=args.steps,
        block_length=args.block_length,
    )
    try:
        pretrain(cfg)
    except Interrupted as e:
        print(e, file=sys.stderr)
        return e.exit_code
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # while the data is prepared: nothing trained yet
        print("interrupted before the first step: nothing to save", file=sys.stderr)
        return 130
    return 0
