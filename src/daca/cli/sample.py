"""``daca sample``: show a model's answers on a task's prompts."""

from __future__ import annotations

from daca.cli.eval import (
    add_generation_arguments,
    checked_task_and_rows,
    errors_as_messages,
    model_and_generation,
)


def add_arguments(p) -> None:
    add_generation_arguments(p)
    p.add_argument("-n", type=int, default=4, help="how many examples")


@errors_as_messages
def run(args) -> int:
    import torch

    from daca.train.evaluation import evaluate

    task, rows = checked_task_and_rows(args, args.n)
    bundle, gen = model_and_generation(args)
    gen_rng = torch.Generator(device=args.device).manual_seed(args.seed)
    res = evaluate(bundle, task, rows, gen, temperature=args.temperature, generator=gen_rng)
    for row, prompt, completion, score in zip(
        rows, res.prompts, res.completions, res.scores, strict=True
    ):
        print(f"prompt:     {prompt}")
        if "solution" in row:
            print(f"reference:  {row['solution']}")
        print(f"completion: {completion}")
        print(f"score:      {score:.3f}\n")
    print(f"mean score {res.mean:.3f} over {len(rows)} examples")
    return 0
