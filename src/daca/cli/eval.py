"""``daca eval``: a model's metric on a task (``daca sample`` shares its generation options).

Defaults follow the paper's evaluation protocol (temperature 0, steps = gen_length / 2,
block 32); the tiny model's own settings (L 16, 8 steps, one block) when it is the model.
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import fields, replace
from pathlib import Path

from daca.cli import preflight
from daca.train.config import REWARD_TIMEOUT, GenerationConfig


def add_generation_arguments(p) -> None:
    p.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (the shipped model of the task), a local folder or a hub name",
    )
    p.add_argument("--task", required=True, help="task name (sudoku, countdown, gsm8k, ...)")
    p.add_argument("--data-file", help="local data file in the task's format")
    p.add_argument("--split", default="test")
    p.add_argument("--gen-length", type=int)
    p.add_argument("--steps", type=int, help="default gen_length / 2")
    p.add_argument("--block-length", type=int, help="default 32 (tiny model: its own)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--cache",
        choices=("none", "prefix", "dual"),
        help="block KV cache (docs/rollouts.md); default the model's setting, else none",
    )
    p.add_argument(
        "--refresh-every",
        type=int,
        help="with --cache, also refresh the cache at every N-th step of a block",
    )
    p.add_argument(
        "--parallel-threshold",
        type=float,
        help="commit every masked block position more confident than this (e.g. 0.9)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="default: cuda when a GPU is available, else cpu")


def _generation(args, bundle) -> GenerationConfig:
    meta = bundle.meta.get("generation")
    if meta:  # a model written by daca: the settings it was trained with
        known = {f.name for f in fields(GenerationConfig)}
        base = GenerationConfig(**{k: v for k, v in meta.items() if k in known})
    else:
        base = GenerationConfig(gen_length=256, steps=128, block_length=32)
    gen_length = args.gen_length or base.gen_length
    steps = args.steps or (base.steps if not args.gen_length else gen_length // 2)
    block = args.block_length or min(base.block_length, gen_length)
    given = {  # the flags given on the command line; the rest stays the model's
        "cache": args.cache,
        "refresh_every": args.refresh_every,
        "parallel_threshold": args.parallel_threshold,
    }
    return replace(
        base,
        gen_length=gen_length,
        steps=steps,
        block_length=block,
        temperature=args.temperature,
        **{k: v for k, v in given.items() if v is not None},
    )


def add_arguments(p) -> None:
    add_generation_arguments(p)
    p.add_argument("--limit", type=int, help="first N examples only")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--reward-timeout",
        type=float,
        default=REWARD_TIMEOUT,
        help="seconds the scoring of one batch may take; examples still running then score 0 "
        "(logged)",
    )
    p.add_argument("--out", help="JSONL file of (prompt, completion, score); default beside cwd")


def checked_task_and_rows(args, limit: int | None):
    """The task and its rows, with every flag that can be wrong checked before the model
    loads (each failure: one line naming the flag, exit 2)."""
    task = preflight.check_task(args.task)
    preflight.check_model(args.model)
    preflight.check_model_does_task(args.model, task)
    rows = preflight.load_rows(
        task,
        split=args.split,
        path=args.data_file,
        limit=limit,
        seed=args.seed,
        flag="--data-file",
        task_flag="--task",
    )
    preflight.check_sandbox(task)
    return task, rows


def model_and_generation(args):
    """The model on ``args.device`` (resolved here: the default probes CUDA) and the
    generation settings."""
    import torch

    from daca.models.loading import load, tiny_for_task

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if str(args.device).startswith("cuda") else None
    bundle = load(tiny_for_task(args.model, args.task), device=args.device, dtype=dtype)
    return bundle, _generation(args, bundle)


def errors_as_messages(run):
    """A bad model folder, data file or setting: one line and exit code 2, no traceback."""

    @functools.wraps(run)
    def wrapped(args) -> int:
        from daca.tasks.sandbox import SandboxUnavailable

        try:
            return run(args)
        except (preflight.UsageError, OSError, ValueError, SandboxUnavailable) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return wrapped


@errors_as_messages
def run(args) -> int:
    import torch

    from daca.train.evaluation import evaluate

    out = Path(args.out or f"eval-{args.task}.jsonl")
    preflight.check_output_file(str(out))
    task, rows = checked_task_and_rows(args, args.limit)
    bundle, gen = model_and_generation(args)
    gen_rng = torch.Generator(device=args.device).manual_seed(args.seed)
    res = evaluate(
        bundle,
        task,
        rows,
        gen,
        batch_size=args.batch_size,
        temperature=args.temperature,
        generator=gen_rng,
        progress=True,
        reward_timeout=args.reward_timeout,
    )
    with out.open("w") as fh:
        for p, c, s in zip(res.prompts, res.completions, res.scores, strict=True):
            fh.write(json.dumps({"prompt": p, "completion": c, "score": s}) + "\n")
    print(
        f"{args.task}: {res.mean:.4f} ± {res.ci95:.4f} (95 % interval, n={len(res.scores)}, "
        f"L={gen.gen_length}, steps={gen.steps}, block={gen.block_length}, "
        f"temperature={args.temperature}, cache={gen.cache}, refresh_every={gen.refresh_every}, "
        f"parallel_threshold={gen.parallel_threshold}, mean steps "
        f"{sum(res.steps) / max(len(res.steps), 1):.2f}); per-example lines in {out}"
    )
    return 0
