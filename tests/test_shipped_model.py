"""The tiny models shipped in the package are miniature LLaDAs in LLaDA's hub layout, load
through LLaDA's path, and solve held-out problems at the accuracy recorded beside them
(daca.json, produced by `daca pretrain`), within evaluation tolerance."""

import json

import pytest
from safetensors import safe_open

from daca.models.loading import SHIPPED, load
from daca.tasks import get_task
from daca.tools.pretrain import step_accuracy
from daca.train.config import GenerationConfig, load_config
from daca.train.evaluation import evaluate

META = {name: json.loads((folder / "daca.json").read_text()) for name, folder in SHIPPED.items()}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_checkpoint_is_small_and_documented(name):
    size = sum(f.stat().st_size for f in SHIPPED[name].rglob("*") if f.is_file())
    assert size <= 10 * 1024 * 1024
    meta = META[name]
    assert (meta["family"], meta["prompt_format"]) == ("llada", "compact")
    assert 100_000 < meta["parameters"] <= 2_000_000
    config = json.loads((SHIPPED[name] / "config.json").read_text())
    assert (config["model_type"], config["block_type"], config["rope"]) == ("llada", "llama", True)
    keys = set(safe_open(str(SHIPPED[name] / "model.safetensors"), "pt").keys())
    assert "model.transformer.blocks.0.attn_out.weight" in keys  # LLaDA's own key names
    assert "model.transformer.ff_out.weight" in keys
    # Above chance, below perfect on the task it is shipped for: room for RL.
    task = meta["pretrain"]["task"]
    assert 0.05 <= meta["held_out"][task] <= 0.70


@pytest.mark.parametrize(
    "name,task_name", [(n, t) for n in sorted(META) for t in sorted(META[n]["held_out"])]
)
def test_shipped_checkpoint_reproduces_its_accuracy(name, task_name):
    meta = META[name]
    bundle = load(name)
    model, tokenizer, mask_id = bundle
    assert mask_id == tokenizer.mask_token_id and bundle.family == "llada"
    assert type(model).__name__ == "LLaDAForDiffusionLM"  # transformers' Llama, no remote code
    task = get_task(task_name)
    rows = task.load(split="test", limit=meta["eval_size"], seed=meta["pretrain"]["seed"])
    gen = GenerationConfig(**{**meta["generation"], "temperature": 0.0})
    result = evaluate(bundle, task, rows, gen, batch_size=200)
    # The same rows at temperature 0: only float-summation order may differ across machines.
    assert result.mean == pytest.approx(meta["held_out"][task_name], abs=0.02)
    if task_name in meta.get("held_out_steps", {}):  # and the reasoning's steps
        right = step_accuracy(task, result.completions, rows)
        assert right == pytest.approx(meta["held_out_steps"][task_name], abs=0.02)


def test_tiny_means_the_shipped_model_of_the_task():
    assert load_config(None, ["task=sudoku"]).model == "tiny"
    assert load_config(None, ["task=countdown"]).model == "tiny-countdown"
    assert load_config(None, ["task=countdown", "model=/some/folder"]).model == "/some/folder"
    assert load_config(None, ["task=sudoku-trace"]).model == "tiny-sudoku-trace"
    assert META["tiny"]["pretrain"]["task"] == "sudoku"
    assert META["tiny-countdown"]["pretrain"]["task"] == "countdown"
    assert META["tiny-sudoku-trace"]["pretrain"]["task"] == "sudoku-trace"
    assert load_config(None, ["task=countdown-trace"]).model == "tiny-countdown-trace"
    assert META["tiny-countdown-trace"]["pretrain"]["task"] == "countdown-trace"


def test_the_trace_model_has_real_partial_skill_in_its_trace_too():
    """Its reasoning's steps are right more often than a uniform digit (0.25): measured on 200
    held-out puzzles, recorded beside the answer's accuracy."""
    meta = META["tiny-sudoku-trace"]
    assert 0.3 <= meta["held_out"]["sudoku-trace"] <= 0.7
    assert 0.25 + 3 * (0.25 * 0.75 / 1000) ** 0.5 < meta["held_out_steps"]["sudoku-trace"] < 0.9
