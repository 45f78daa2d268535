"""End-to-end runs of the trainer on a tiny random model (a few steps each)."""

import json

import pytest
import torch
from _tasks import sudoku_rows_task

from daca.tasks import register_task
from daca.tasks.rewards import RewardError, score_rewards
from daca.train.config import load_config
from daca.train.trainer import Trainer

register_task("ones", lambda: sudoku_rows_task("ones"))


def _cfg(model_dir, out, name, *overrides):
    base = [
        f"model={model_dir}",
        f"output_dir={out}",
        f"name={name}",
        "task=ones",
        "weight_decay=0.0",
        "per_device_train_batch_size=12",
        "num_generations=6",
        "train_size=40",
        "eval_size=8",
        "eval_every=0",
        "max_steps=2",
        "save_rollouts_every=1",
        "tensorboard=false",
        "generation.steps=4",
        "generation.gen_length=16",
        "generation.block_length=8",
        "dps.stride=1",
        "learning_rate=1e-3",
    ]
    return load_config(None, base + list(overrides))


def _params(trainer):
    model = trainer.acc.unwrap_model(trainer.model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _drop_times(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


@pytest.mark.parametrize(
    "overrides",
    [
        ["method=wd1"],
        ["method=wd1", "sml.enabled=true", "sml.eta=0.5"],
        ["method=diffu_grpo", "num_iterations=2", "beta=0.04", "sml.enabled=true"],
        ["method=gdpo", "num_iterations=2", "dps.last_step=measured", "dps.scope=block"],
    ],
    ids=["wd1", "wd1-sml", "diffu_grpo-sml-kl", "gdpo-dps-measured"],
)
def test_methods_train_and_change_parameters(tiny_model_dir, tmp_path, overrides):
    cfg = _cfg(tiny_model_dir, tmp_path, "run", *overrides)
    trainer = Trainer(cfg, progress=False)
    before = _params(trainer)
    summary = trainer.train()
    after = _params(trainer)
    assert summary["steps"] == 2
    assert any(not torch.equal(before[k], after[k]) for k in before)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(v == v for v in r.values()), r  # no NaN
        assert "dps/multiplier_std" in r and "loss" in r
    assert (tmp_path / "run" / "curves.png").is_file()


def test_parallel_decoding_trains_and_logs_the_steps_it_took(tiny_model_dir, tmp_path):
    """rollout_steps is the budget T without a threshold; at τ = 0 each block of the two is
    committed whole at its first step, so every completion takes 2 steps of 4 (docs/rollouts.md)."""
    for name, extra, steps in (
        ("full", [], 4.0),
        ("parallel", ["generation.parallel_threshold=0.0"], 2.0),
    ):
        Trainer(_cfg(tiny_model_dir, tmp_path, name, "method=wd1", *extra), progress=False).train()
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        assert [r["rollout_steps"] for r in rows] == [steps, steps]
        assert all(v == v for r in rows for v in r.values())  # the DPS trace of T_b = 2 too


def test_lambda_zero_reproduces_base_method(tiny_model_dir, tmp_path):
    """DPS with λ = 0 must give exactly the base method's updates (METHOD.md §2)."""
    common = ["method=diffu_grpo", "num_iterations=2"]
    a = Trainer(_cfg(tiny_model_dir, tmp_path, "a", *common, "dps.enabled=false"), progress=False)
    a.train()
    b = Trainer(_cfg(tiny_model_dir, tmp_path, "b", *common, "dps.lam=0.0"), progress=False)
    b.train()
    pa, pb = _params(a), _params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    c = Trainer(_cfg(tiny_model_dir, tmp_path, "c", *common, "dps.lam=2.0"), progress=False)
    c.train()
    pc = _params(c)
    assert any(not torch.equal(pa[k], pc[k]) for k in pa)


def test_resume_continues_exactly(tiny_model_dir, tmp_path):
    over = ["method=diffu_grpo", "num_iterations=2", "beta=0.04", "save_every=3"]
    straight = Trainer(
        _cfg(tiny_model_dir, tmp_path, "straight", *over, "max_steps=6"), progress=False
    )
    straight.train()
    first = Trainer(_cfg(tiny_model_dir, tmp_path, "split", *over, "max_steps=3"), progress=False)
    first.train()
    resumed = Trainer(
        _cfg(tiny_model_dir, tmp_path, "split", *over, "max_steps=6"), resume=True, progress=False
    )
    assert resumed.step == 3
    resumed.train()
    ps, pr = _params(straight), _params(resumed)
    assert all(torch.equal(ps[k], pr[k]) for k in ps)
    rows_s = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").open()]
    rows_r = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").open()]
    assert _drop_times(rows_s) == _drop_times(rows_r)


def test_existing_run_is_not_overwritten(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, tmp_path, "once", "max_steps=1")
    Trainer(cfg, progress=False).train()
    with pytest.raises(FileExistsError, match="--resume"):
        Trainer(cfg, progress=False)


def test_reward_error_names_function_and_example():
    def fine(prompts, completions, **kw):
        return [1.0] * len(completions)

    def broken(prompts, completions, **kw):
        return [1.0 / (c != "bad") for c in completions]

    with pytest.raises(RewardError, match=r"broken failed on example 1 .*'bad'"):
        score_rewards([fine, broken], [1.0, 1.0], ["p", "q"], ["ok", "bad"], {})
    per, total, errors = score_rewards(
        [fine, broken], [1.0, 0.5], ["p", "q"], ["ok", "bad"], {}, on_error="zero"
    )
    assert errors == 1
    assert total.tolist() == [1.5, 1.0]
    assert per.tolist() == [[1.0, 1.0], [1.0, 0.0]]


def test_rollout_records_for_inspect(tiny_model_dir, tmp_path):
    Trainer(_cfg(tiny_model_dir, tmp_path, "rec", "dps.lam=0.5"), progress=False).train()
    rec = json.loads((tmp_path / "rec" / "rollouts" / "step-0000002.json").read_text())
    G, L = 6, 16
    assert len(rec["tokens"]) == G and all(len(t) == L for t in rec["tokens"])
    # Each multiplier is 1 + λ·δ̄ of its token's birth interval (stride 1: interval = birth).
    for b in range(G):
        for n in range(L):
            j = rec["birth_step"][b][n]
            expected = 1 + 0.5 * rec["norm_deltas"][b][j]
            assert abs(rec["multipliers"][b][n] - expected) < 1e-5


def test_lora_trains_only_the_adapter_and_uses_the_base_as_reference(tiny_model_dir, tmp_path):
    cfg = _cfg(
        tiny_model_dir,
        tmp_path,
        "lora",
        "method=diffu_grpo",
        "num_iterations=2",
        "beta=0.04",
        "lora.enabled=true",
        "lora.r=4",
        "lora.alpha=8",
        "lora.dropout=0.0",
    )
    trainer = Trainer(cfg, progress=False)
    assert trainer.ref_model is None  # the reference is the adapter-disabled base, no copy
    before = _params(trainer)
    trainer.train()
    after = _params(trainer)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)
    rows = [json.loads(x) for x in (tmp_path / "lora" / "metrics.jsonl").open()]
    assert all(r["kl"] >= 0 for r in rows) and rows[-1]["kl"] > 0  # the policy left its base
    saved = tmp_path / "lora" / "checkpoints" / "step-0000002" / "model"
    assert (saved / "adapter_model.safetensors").is_file()
