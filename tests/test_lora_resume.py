"""Resume of a LoRA run from accelerate's state: the checkpoint's ``state/`` holds the adapter
only (not the frozen base, 16 GB for an 8B model), and the resumed run, whose LoRA dropout
draws from the global RNG restored with it, equals the uninterrupted one."""

import json

import torch
from _tasks import sudoku_rows_task
from conftest import SMALL_RUN
from safetensors.torch import load_file

from daca.tasks import register_task
from daca.train.config import load_config
from daca.train.trainer import Trainer

register_task("ones", lambda: sudoku_rows_task("ones"))


def _cfg(model_dir, out, name, *overrides):
    return load_config(
        None,
        [
            f"model={model_dir}",
            f"output_dir={out}",
            f"name={name}",
            "task=ones",
            *SMALL_RUN,
            "eval_every=0",
            "save_every=2",
            "method=diffu_grpo",
            "num_iterations=2",
            "learning_rate=1e-2",
            "lora.enabled=true",
            "lora.r=4",
            "lora.alpha=8",
            "lora.dropout=0.5",
            *overrides,
        ],
    )


def _params(trainer) -> dict:
    model = trainer.acc.unwrap_model(trainer.model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _metrics(run_dir) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


def test_lora_resume_from_the_adapter_state_equals_the_straight_run(tiny_model_dir, tmp_path):
    # get_peft_model draws lora_A from the global RNG: the same start for both runs.
    torch.manual_seed(0)
    straight = Trainer(_cfg(tiny_model_dir, tmp_path, "straight", "max_steps=4"), progress=False)
    straight.train()
    torch.manual_seed(0)
    Trainer(_cfg(tiny_model_dir, tmp_path, "split", "max_steps=2"), progress=False).train()
    resumed = Trainer(
        _cfg(tiny_model_dir, tmp_path, "split", "max_steps=4"), resume=True, progress=False
    )
    assert resumed.step == 2
    resumed.train()
    ps, pr = _params(straight), _params(resumed)
    assert ps.keys() == pr.keys() and all(torch.equal(ps[k], pr[k]) for k in ps)
    assert _metrics(tmp_path / "straight") == _metrics(tmp_path / "split")
    state = load_file(
        tmp_path / "split" / "checkpoints" / "step-0000004" / "state" / "model.safetensors"
    )
    assert state and all("lora_" in k for k in state)
