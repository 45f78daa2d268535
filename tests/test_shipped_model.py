"""The tiny model shipped in the package loads and solves held-out puzzles at the accuracy
recorded beside it (daca.json, produced by `daca pretrain`), within evaluation tolerance."""

import json

import pytest

from daca.config import GenerationConfig
from daca.evaluation import evaluate
from daca.models.loading import TINY_PATH, load
from daca.tasks import get_task


def test_shipped_checkpoint_is_small_and_documented():
    size = sum(f.stat().st_size for f in TINY_PATH.rglob("*") if f.is_file())
    assert size <= 10 * 1024 * 1024
    meta = json.loads((TINY_PATH / "daca.json").read_text())
    assert meta["family"] == "tiny" and meta["parameters"] > 100_000
    # Above chance (a random digit is right 1 time in 4), below perfect: room for RL.
    assert 0.30 <= meta["held_out"]["sudoku"] <= 0.70


META = json.loads((TINY_PATH / "daca.json").read_text())


@pytest.mark.parametrize("task_name", sorted(META["held_out"]))
def test_shipped_checkpoint_reproduces_its_accuracy(task_name):
    meta = META
    bundle = load("tiny")
    model, tokenizer, mask_id = bundle
    assert mask_id == tokenizer.mask_token_id
    task = get_task(task_name)
    rows = task.load(split="test", limit=meta["eval_size"], seed=meta["pretrain"]["seed"])
    gen = GenerationConfig(**{**meta["generation"], "temperature": 0.0})
    result = evaluate(bundle, task, rows, gen, batch_size=200)
    # The same rows at temperature 0: only float-summation order may differ across machines.
    assert result.mean == pytest.approx(meta["held_out"][task_name], abs=0.02)
