"""One rank of the 2-process trainer test (tests/test_distributed.py), started by
``accelerate launch``. It runs ``daca.train`` for a few steps and writes what each rank saw to
``OUT/run{i}_rank{r}.pt``: final parameters, the prompts it drew, the deltas DPS normalised and
its own local deltas, the per-step metrics and the summary.

Usage: accelerate launch --config_file configs/accelerate/cpu_2proc.yaml
       tests/_distributed_worker.py OUT key=value ... [:: key=value ...]
(each '::'-separated list of overrides is one run, named run0, run1, ...)
"""

import sys
from pathlib import Path

import torch
from _tasks import sudoku_rows_task

from daca import dps
from daca.tasks import register_task
from daca.train.config import load_config
from daca.train.trainer import Trainer


def main(out: Path, runs: list[list[str]]) -> None:
    torch.set_num_threads(1)
    register_task("ones", lambda: sudoku_rows_task("ones"))
    record: dict[str, list] = {}

    # Spy on what the trainer hands to DPS and which prompts it draws (same calls, same results).
    normalize, progress_deltas = dps.normalize, dps.progress_deltas

    def spy_normalize(deltas, *args, **kw):
        record["normalized_input"].append(deltas.detach().cpu().clone())
        return normalize(deltas, *args, **kw)

    def spy_progress_deltas(*args, **kw):
        deltas = progress_deltas(*args, **kw)
        record["local_deltas"].append(deltas.detach().cpu().clone())
        return deltas

    dps.normalize, dps.progress_deltas = spy_normalize, spy_progress_deltas
    prompts_for = Trainer._prompts_for

    def spy_prompts_for(self, step, micro):
        rows = prompts_for(self, step, micro)
        record["prompts"].append([str(sorted(r.items())) for r in rows])
        return rows

    Trainer._prompts_for = spy_prompts_for

    for i, overrides in enumerate(runs):
        record.update(prompts=[], normalized_input=[], local_deltas=[])
        trainer = Trainer(load_config(None, [*overrides, f"name=run{i}"]), progress=False)
        model = trainer.acc.unwrap_model(trainer.model)
        before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        summary = trainer.train()
        torch.save(
            {
                "rank": trainer.rank,
                "world": trainer.world,
                "before": before,
                "after": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                "summary": summary,
                "history": trainer.history,
                **record,
            },
            out / f"run{i}_rank{trainer.rank}.pt",
        )
    trainer.acc.wait_for_everyone()
    trainer.acc.end_training()


def _split(args: list[str]) -> list[list[str]]:
    """Override lists separated by '::', one trainer run each (one launch, several runs)."""
    runs = [[]]
    for a in args:
        if a == "::":
            runs.append([])
        else:
            runs[-1].append(a)
    return runs


if __name__ == "__main__":
    main(Path(sys.argv[1]), _split(sys.argv[2:]))
