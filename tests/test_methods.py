"""The base-method registry (daca.train.methods), coupled-GRPO through the trainer, and the DPS step
shared by ``daca train`` and the TRL front-end (dps.step_multipliers)."""

import json
import typing
from types import SimpleNamespace

import pytest
import torch
from _tasks import sudoku_rows_task
from conftest import random_mlm
from test_trainer import _cfg as _trainer_cfg

from daca import dps, generate
from daca.tasks import register_task
from daca.tools import compare
from daca.tools.memory import estimate
from daca.train.config import ConfigError, TrainConfig, load_config
from daca.train.methods import METHODS
from daca.train.rollout import RolloutBatch
from daca.train.trainer import Trainer

register_task("ones", lambda: sudoku_rows_task("ones"))
G = 6


def _cfg(model_dir, out, name, *overrides):
    """test_trainer's short run, with a smaller held-out set."""
    return _trainer_cfg(model_dir, out, name, "eval_size=4", *overrides)


# ----------------------------------------------------------------- the registry
def test_config_compare_and_memory_read_the_registry():
    method_type = typing.get_type_hints(TrainConfig)["method"]
    assert typing.get_args(method_type) == tuple(METHODS)
    expected_beta = {"diffu_grpo": 0.04, "wd1": 0.0, "gdpo": 0.0, "coupled_grpo": 0.01}
    expected_mu = {"diffu_grpo": 2, "wd1": 1, "gdpo": 2, "coupled_grpo": 2}
    for name, beta in expected_beta.items():
        assert load_config(None, [f"method={name}"]).beta == beta
        assert f"num_iterations={expected_mu[name]}" in compare.METHOD_OVERRIDES[name]
    assert {n for n, m in METHODS.items() if not m.ratio} == {"wd1"}
    assert METHODS["coupled_grpo"].baseline == "leave_one_out"
    with pytest.raises(ConfigError, match="coupled_grpo"):  # the message names the choices
        load_config(None, ["method=grpo"])
    # --dry-run: GDPO stacks its 3 quadrature views, coupled-GRPO 1 + 2 = 3 views and scores
    # every token twice (the full mask, then once per pair), the mean-field estimate once.
    rows = {}
    for name in METHODS:
        est = estimate(load_config(None, [f"method={name}"]))
        rows[name] = est.update["log-softmax rows + gradients (fp32)"]
        views = 3 if name in ("gdpo", "coupled_grpo") else 1
        assert f"activations ({views} forward" in " ".join(est.update)
    assert rows["coupled_grpo"] == 2 * rows["wd1"] == 2 * rows["diffu_grpo"]
    assert rows["gdpo"] == 1.5 * rows["wd1"]


def test_quick_grid_runs_every_registered_method():
    from daca.cli.compare import grid_methods

    assert grid_methods(None, quick=True) == list(METHODS)
    assert "coupled_grpo" in grid_methods(None, quick=True)
    assert grid_methods(None, quick=False) == ["diffu_grpo", "wd1", "gdpo"]
    assert grid_methods("wd1, gdpo", quick=True) == ["wd1", "gdpo"]


def test_compare_variants_are_the_config_switches(tmp_path):
    for name, overrides in compare.VARIANTS.items():
        cfg = load_config(None, overrides)
        plain = load_config(None, [f"variant={name}"])
        assert (cfg.dps.enabled, cfg.sml.enabled) == (plain.dps.enabled, plain.sml.enabled)
    assert load_config(None, compare.VARIANTS["sml"]).sml.enabled
    assert not load_config(None, compare.VARIANTS["sml"]).dps.enabled


# ----------------------------------------------------------------- coupled-GRPO, end to end
@pytest.mark.parametrize("variant", ["base", "dps", "sml", "daca"])
def test_coupled_grpo_trains_with_every_variant(tiny_model_dir, tmp_path, variant):
    cfg = _cfg(
        tiny_model_dir,
        tmp_path,
        variant,
        "method=coupled_grpo",
        "num_iterations=2",
        f"variant={variant}",
    )
    trainer = Trainer(cfg, progress=False)
    assert trainer.ref_model is not None  # β = 0.01: a frozen reference
    model = trainer.acc.unwrap_model(trainer.model)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    history = trainer.history
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert ("dps/multiplier_std" in history[0]) == (variant in ("dps", "daca"))
    assert "kl" in history[0]
    # Leave-one-out advantages: A_g = G/(G-1) (r_g - mean r), read from the recorded rollout.
    record = json.loads((trainer.run_dir / "rollouts" / "step-0000001.json").read_text())
    r = torch.tensor(record["rewards"], dtype=torch.float64)
    expected = G / (G - 1) * (r - r.mean())
    torch.testing.assert_close(torch.tensor(record["advantages"], dtype=torch.float64), expected)


# ----------------------------------------------------------------- the shared DPS step
def _rollout(seed: int, batch: int = 3, parallel: float | None = None):
    model = random_mlm(vocab_size=32, seed=0)
    prompt = torch.randint(0, 30, (batch, 4), generator=torch.Generator().manual_seed(seed))
    return generate(
        model, prompt, mask_id=31, gen_length=8, steps=8, block_length=4, temperature=0.9,
        generator=torch.Generator().manual_seed(seed + 1), dps_stride=2,
        parallel_threshold=parallel,
    )  # fmt: skip


def _cat(*rollouts):
    """The rollouts as one batch (same recorded steps)."""
    keys = ("progress_logp", "progress_mask", "birth_step", "last_logp", "last_mask")
    joined = {k: torch.cat([getattr(r, k) for r in rollouts]) for k in keys}
    steps = torch.cat([r.steps_taken for r in rollouts])
    first = rollouts[0]
    return SimpleNamespace(
        **joined, recorded_steps=first.recorded_steps, num_steps=first.num_steps, steps_taken=steps
    )


def test_one_rollout_on_one_process_is_rollout_multipliers():
    out = _rollout(0)
    for mode in dps.LAST_STEP_MODES:
        (mult,), (normed,), metrics = dps.step_multipliers(
            [out], lam=0.5, last_step=mode, norm_axis="per_step"
        )
        assert torch.equal(mult, dps.rollout_multipliers(out, lam=0.5, last_step=mode))
        deltas = dps.progress_deltas(
            out.progress_logp, out.progress_mask, mode, last_logp=out.last_logp,
            last_mask=out.last_mask, recorded_steps=out.recorded_steps, num_steps=out.num_steps,
        )  # fmt: skip
        assert torch.equal(normed, dps.normalize(deltas))
        assert metrics["dps/delta_std"] == pytest.approx(deltas.double().std(correction=0).item())
        assert metrics["dps/multiplier_max"] == mult.max().item()


def test_micro_batches_are_normalised_together():
    """The step's z-score runs over every micro-batch's trajectories (METHOD.md §2)."""
    a, b = _rollout(0), _rollout(5)
    mults, _, metrics = dps.step_multipliers([a, b], lam=0.5)
    whole = dps.rollout_multipliers(_cat(a, b), lam=0.5)
    assert torch.equal(torch.cat(mults), whole)
    assert not torch.equal(mults[0], dps.rollout_multipliers(a, lam=0.5))  # not per micro-batch
    assert metrics["dps/multiplier_std"] == pytest.approx(whole.double().std(correction=0).item())


def test_injected_gather_gives_every_process_the_global_step():
    """Two processes simulated by a gather that returns both processes' rows in rank order:
    each keeps its own rows of the one-process result on all rows, and logs the same metrics."""
    a, b = _rollout(0), _rollout(5)
    union, _, union_metrics = dps.step_multipliers([a, b], lam=0.5, clamp_min=0.0)
    local = {0: a, 1: b}
    deltas = {r: dps.progress_deltas(
        local[r].progress_logp, local[r].progress_mask, recorded_steps=local[r].recorded_steps,
        num_steps=local[r].steps_taken,
    ) for r in (0, 1)}  # fmt: skip
    for rank in (0, 1):
        calls = iter([deltas[1 - rank], union[1 - rank].flatten()])  # the other's rows

        def gather(t, rank=rank, calls=calls):
            other = next(calls)
            return torch.cat([t, other] if rank == 0 else [other, t])

        (mult,), _, metrics = dps.step_multipliers(
            [local[rank]], lam=0.5, clamp_min=0.0, gather=gather, rank=rank
        )
        assert torch.equal(mult, union[rank])
        assert metrics == union_metrics


def test_rows_of_different_lengths_leave_nan_out_of_the_metrics():
    out = _rollout(3, batch=4, parallel=0.03)  # steps taken: 5, 3, 2, 5
    assert len(set(out.steps_taken.tolist())) > 1  # rows took different numbers of steps
    _, (normed,), metrics = dps.step_multipliers([out], lam=0.5)
    deltas = dps.progress_deltas(
        out.progress_logp, out.progress_mask, recorded_steps=out.recorded_steps,
        num_steps=out.steps_taken,
    )  # fmt: skip
    assert deltas.isnan().any() and normed.isnan().any()
    real = deltas[~deltas.isnan()].double()
    assert metrics["dps/delta_mean"] == pytest.approx(real.mean().item())
    assert metrics["dps/delta_std"] == pytest.approx(real.std(correction=0).item())
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


def test_native_and_trl_front_ends_give_identical_multipliers(tiny_model_dir, tmp_path):
    """The TRL front-end's rollout, through the TRL trainer's DPS and the native trainer's DPS
    step with the same settings: identical multipliers and metrics."""
    pytest.importorskip("trl")
    from test_trl_integration import make_trainer

    trl_trainer, rows = make_trainer(
        tiny_model_dir, tmp_path, dps_lam=0.5, dps_last_step="measured", dps_clamp_min=0.0
    )
    trl_trainer.model.train()
    trl_trainer._generate_and_score_completions(rows)
    out = trl_trainer.last_rollout
    trl_mult = trl_trainer._batches[0].multipliers
    native = Trainer(
        _cfg(tiny_model_dir, tmp_path, "native", "dps.lam=0.5", "dps.last_step=measured",
             "dps.clamp_min=0.0", "dps.stride=2"),
        progress=False,
    )  # fmt: skip
    batch = RolloutBatch(
        prompt_ids=out.sequences[:, : out.prompt_length],
        prompt_mask=torch.ones_like(out.sequences[:, : out.prompt_length]),
        completion_ids=out.completion_ids,
        completion_mask=torch.ones_like(out.completion_ids, dtype=torch.bool),
        rewards=torch.zeros(len(out.completion_ids)),
        advantages=torch.zeros(len(out.completion_ids)),
        rollout=out,
    )
    _, stats = native._dps_step([batch])
    assert not torch.allclose(trl_mult, torch.ones_like(trl_mult))
    assert torch.equal(batch.multipliers, trl_mult)
    logged = {k: v[-1] for k, v in trl_trainer._metrics["train"].items() if k.startswith("dps/")}
    assert logged == stats
