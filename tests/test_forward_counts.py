"""Forward passes counted: DPS and ``last_step="measured"`` add none to a rollout (METHOD.md §2),
and the native trainer runs no likelihood view whose result it throws away."""

import pytest
import torch
from conftest import random_mlm
from test_trainer import _cfg

from daca import dps
from daca.core.sampler import generate
from daca.train.trainer import Trainer

MASK = 31  # mask id of the random ModernBERT (vocab 32)


class Counting:
    """The model, with every call's batch size recorded."""

    def __init__(self, model):
        self.model, self.rows = model, []

    def __call__(self, input_ids, attention_mask=None):
        self.rows.append(input_ids.shape[0])
        return self.model(input_ids, attention_mask=attention_mask)


@pytest.fixture(scope="module")
def mlm():
    return random_mlm(32, seed=0)


def _prompts(B=3, P=4):
    return torch.randint(1, 31, (B, P), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("cfg_scale", [0.0, 1.0])
@pytest.mark.parametrize("stride", [None, 1, 3, 5])
def test_dps_recording_adds_no_forward(mlm, stride, cfg_scale):
    """T steps run exactly T forwards of B rows (2B with classifier-free guidance), with or
    without the DPS trace, at every stride; stride 5 of T = 6 puts r_m = 5 = T-1 (the measured
    mode's fallback), stride 3 leaves a last interval to measure."""
    B, steps = 3, 6
    model = Counting(mlm)
    with torch.no_grad():
        out = generate(
            model,
            _prompts(B),
            mask_id=MASK,
            gen_length=12,
            steps=steps,
            block_length=6,
            temperature=1.0,
            cfg_scale=cfg_scale,
            generator=torch.Generator().manual_seed(1),
            dps_stride=stride,
        )
    width = 2 * B if cfg_scale > 0 else B
    assert model.rows == [width] * steps
    if stride is None:
        return
    # every last-step mode, "measured" included, works from what was recorded: no model call
    for mode in dps.LAST_STEP_MODES:
        mult = dps.rollout_multipliers(out, lam=0.5, last_step=mode)
        assert mult.shape == (B, 12) and torch.isfinite(mult).all()
    assert model.rows == [width] * steps
    assert out.last_logp is not None and out.last_mask.any()


def _trainer_forward_rows(tiny_model_dir, tmp_path, name, *overrides):
    trainer = Trainer(
        _cfg(tiny_model_dir, tmp_path, name, "max_steps=1", *overrides), progress=False
    )
    rows = []
    model = trainer.acc.unwrap_model(trainer.model)
    model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(
            (args[0] if args else kwargs["input_ids"]).shape[0]
        ),
        with_kwargs=True,
    )
    trainer.train()
    return rows


def test_wd1_with_sml_eta_zero_runs_no_sml_forward(tiny_model_dir, tmp_path):
    """wd1 uses the SML likelihood only through η·log p^SML: with η = 0 the K stratified views
    are dead work and must not run (same forwards as without SML)."""
    plain = _trainer_forward_rows(tiny_model_dir, tmp_path, "plain", "method=wd1")
    eta0 = _trainer_forward_rows(
        tiny_model_dir, tmp_path, "eta0", "method=wd1", "sml.enabled=true", "sml.eta=0.0"
    )
    with_sml = _trainer_forward_rows(
        tiny_model_dir, tmp_path, "sml", "method=wd1", "sml.enabled=true", "sml.eta=0.5"
    )
    assert sum(with_sml) > sum(plain)  # the counter sees the SML views when they count
    assert eta0 == plain
