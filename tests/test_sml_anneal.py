"""Annealed SML (METHOD.md §3): K falls from ``sml.num_strata`` to 1 over ``sml.anneal_steps``
training steps, the same K for a rollout's current, old and reference log-probs, in both
front-ends."""

import json

import pytest
from test_trainer import _cfg
from test_trl_integration import make_trainer

from daca.core import likelihood
from daca.core.likelihood import annealed_num_strata
from daca.train.config import ConfigError, load_config
from daca.train.trainer import Trainer


def test_k_falls_in_k_equal_phases():
    # K = 4 over T = 60: steps 0-14 K 4, 15-29 K 3, 30-44 K 2, 45 on K 1 (worked out by hand).
    got = [annealed_num_strata(4, 60, t) for t in range(0, 75)]
    assert got == [4] * 15 + [3] * 15 + [2] * 15 + [1] * 30
    # T shorter than K: K 4 over 2 steps is 4, 2, then 1.
    assert [annealed_num_strata(4, 2, t) for t in range(4)] == [4, 2, 1, 1]
    # T = 0 is SML as it was: K at every step; K = 1 stays 1.
    assert {annealed_num_strata(4, 0, t) for t in range(100)} == {4}
    assert {annealed_num_strata(1, 10, t) for t in range(20)} == {1}


@pytest.mark.parametrize("args", [(0, 10, 0), (4, -1, 0), (4, 10, -1)])
def test_bad_schedules_are_refused(args):
    with pytest.raises(ValueError):
        annealed_num_strata(*args)


def test_a_negative_anneal_length_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="sml.anneal_steps must be >= 0"):
        load_config(None, [f"output_dir={tmp_path}", "sml.anneal_steps=-1"])


def _spy_strata(monkeypatch, clock):
    """Record (the front-end's step, K) of every stratified likelihood evaluation."""
    calls = []
    original = likelihood.stratified_logp

    def spy(*args, num_strata, **kwargs):
        calls.append((clock(), num_strata))
        return original(*args, num_strata=num_strata, **kwargs)

    monkeypatch.setattr(likelihood, "stratified_logp", spy)
    return calls


@pytest.mark.parametrize("anneal_steps, want", [(2, [4, 2, 1]), (0, [4, 4, 4])])
def test_the_native_trainer_anneals_k_by_step(
    tiny_model_dir, tmp_path, monkeypatch, anneal_steps, want
):
    """Three Diffu-GRPO steps (μ 2, β > 0): every evaluation of a step (the old policy's for
    iteration 1, the reference's for both, the update's for both) uses that step's K, and the
    step's K is logged."""
    cfg = _cfg(
        tiny_model_dir,
        tmp_path,
        f"anneal{anneal_steps}",
        "method=diffu_grpo",
        "num_iterations=2",
        "max_steps=3",
        "sml.enabled=true",
        "sml.num_strata=4",
        f"sml.anneal_steps={anneal_steps}",
    )
    trainer = Trainer(cfg, progress=False)
    calls = _spy_strata(monkeypatch, lambda: trainer.step)
    trainer.train()
    per_step = {step: {k for s, k in calls if s == step} for step, _ in calls}
    assert [per_step[s] for s in range(3)] == [{k} for k in want]
    assert [sum(s == step for s, _ in calls) for step in range(3)] == [5, 5, 5]
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    logged = [r.get("sml/num_strata") for r in rows if "step" in r]
    assert logged == (want if anneal_steps else [None] * 3)


def test_the_trl_front_end_anneals_k_by_rollout_step(tiny_model_dir, tmp_path, monkeypatch):
    """TRL counts μ optimizer steps per rollout: K follows daca's rollout step, the same for
    the old, reference and current log-probs of a rollout."""
    trainer, rows = make_trainer(
        tiny_model_dir, tmp_path, sml_enabled=True, sml_num_strata=4, sml_anneal_steps=2
    )
    calls = _spy_strata(monkeypatch, trainer._rollout_step)
    trainer.model.train()
    for global_step, want in ((0, 4), (2, 2), (4, 1)):  # rollout steps 0, 1, 2 at μ = 2
        trainer.state.global_step = global_step
        batch = trainer._generate_and_score_completions(rows)
        assert trainer._batches[0].step == global_step // 2
        trainer._step = 0
        trainer.compute_loss(trainer.model, batch)
        assert trainer._metrics["train"]["sml/num_strata"][-1] == want
        assert {k for s, k in calls if s == global_step // 2} == {want}
