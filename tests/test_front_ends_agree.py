"""One method, two front-ends: a step of ``daca train``'s ``Trainer`` and of
``DACAGRPOTrainer(method=...)`` on the same tiny model, prompts and settings draws the same
rollouts and computes the same DPS multipliers, advantages, log-probs and losses in every inner
iteration, hence the same updates: both call the same step functions (``daca.train.rollout``,
``daca.train.seeds``, ``daca.train.update``)."""

import dataclasses

import pytest
import torch
from conftest import CPU_TRL
from test_trainer import _cfg

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from daca.integrations.trl import (  # noqa: E402
    SECTIONS,
    TRAIN_FIELDS,
    DACAGRPOConfig,
    DACAGRPOTrainer,
)
from daca.tasks.prompts import prompt_texts  # noqa: E402
from daca.train.methods import METHODS  # noqa: E402
from daca.train.trainer import Trainer  # noqa: E402


def _spy_loss(trainer_method, calls: list):
    """The registry entry with its loss recording its inputs and result."""

    def loss(cfg, logp, **kw):
        out, metrics = trainer_method.loss(cfg, logp, **kw)
        kept = {k: v.detach().clone() for k, v in kw.items() if torch.is_tensor(v)}
        calls.append({"logp": logp.detach().clone(), **kept, "loss": out.detach(), **metrics})
        return out, metrics

    return dataclasses.replace(trainer_method, loss=loss)


def _trl_args(cfg, out) -> DACAGRPOConfig:
    """The native run's settings as a DACAGRPOConfig: the sections flattened, the method's and
    the optimizer's fields, one rollout of μ optimizer steps."""
    flat = {
        prefix + k: v
        for name, (prefix, _) in SECTIONS.items()
        for k, v in dataclasses.asdict(getattr(cfg, name)).items()
    }
    same = {name: getattr(cfg, name) for name in TRAIN_FIELDS}
    for name in ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "max_grad_norm"):
        same[name] = getattr(cfg, name)
    mu = cfg.num_iterations
    return DACAGRPOConfig(
        output_dir=str(out),
        **CPU_TRL,
        save_strategy="no",
        logging_steps=1,
        shuffle_dataset=False,  # the prompts in the native step's order
        optim="adamw_torch",  # the native trainer's torch.optim.AdamW
        lr_scheduler_type="constant",  # the native schedule without warm-up
        max_steps=mu,
        **same,
        **flat,
    )


@pytest.mark.parametrize(
    ("method", "gas", "extra"),
    [(m, gas, ()) for m in METHODS for gas in (1, 2)]
    + [("gdpo", 2, ("dps.center=sequence",))],  # the masks reach DPS in both front-ends
)
def test_native_and_trl_steps_are_identical(tiny_model_dir, tmp_path, method, gas, extra):
    """Every registered method, DPS and SML on: two prompts of G = 6 per step, in one
    micro-batch or in two (gradient accumulation 2)."""
    mu = 2  # wd1 too: μ updates per rollout, each with its own masks
    cfg = _cfg(
        tiny_model_dir,
        tmp_path,
        "native",
        f"method={method}",
        f"num_iterations={mu}",
        f"per_device_train_batch_size={12 // gas}",
        f"gradient_accumulation_steps={gas}",
        "eval_size=4",
        "dps.lam=1.0",
        "sml.enabled=true",
        "sml.eta=0.5",
        *extra,
    )
    native = Trainer(cfg, progress=False)
    rows = [r for m in range(gas) for r in native._prompts_for(0, m)]  # the step's, in order
    texts = prompt_texts(native.bundle, native.task, rows)
    data = datasets.Dataset.from_list(
        [{**r, "prompt": t} for r, t in zip(rows, texts, strict=True)]
    )
    args = _trl_args(native.cfg, tmp_path / "trl")
    made = args.train_config()
    for name in (*TRAIN_FIELDS, *SECTIONS):
        assert getattr(made, name) == getattr(native.cfg, name), name
    trl = DACAGRPOTrainer(
        str(tiny_model_dir), reward_funcs=native.task.reward_funcs, args=args, train_dataset=data
    )

    native_calls, trl_calls, native_batches = [], [], []
    native.method = _spy_loss(native.method, native_calls)
    trl.daca_method = _spy_loss(trl.daca_method, trl_calls)
    make_rollout = native._make_rollout

    def recorded(step, micro):
        batch, stats = make_rollout(step, micro)
        native_batches.append(batch)
        return batch, stats

    native._make_rollout = recorded
    # TRL first: accelerate's gradient-accumulation count is process-wide, and the native step
    # sets it to its own (HF's trainer leaves it at 1 and scales the loss itself).
    trl.train()
    native.train_step()

    native_ids = torch.cat([b.completion_ids for b in native_batches])
    trl_ids = torch.cat([r.completion_ids for r in trl.last_rollouts])
    assert torch.equal(native_ids, trl_ids)
    assert len(native_calls) == len(trl_calls) == mu * gas  # one per micro-batch and iteration
    for call, (a, b) in enumerate(zip(native_calls, trl_calls, strict=True)):
        assert a.keys() == b.keys(), call
        assert not torch.allclose(a["token_multipliers"], torch.ones_like(a["token_multipliers"]))
        assert a["advantages"].abs().sum() > 0
        compared = ("token_multipliers", "advantages", "completion_mask", "old_logp", "ref_logp")
        for key in (*compared, "sml_logp"):
            if key in a:
                assert torch.equal(a[key], b[key]), (call, key)
        assert torch.equal(a["logp"], b["logp"]), call
        assert a["loss"].item() != 0
        assert torch.equal(a["loss"], b["loss"]), call
    # The same updates: the weights after the step agree.
    after = trl.accelerator.unwrap_model(trl.model).state_dict()
    for name, value in native.acc.unwrap_model(native.model).state_dict().items():
        assert torch.equal(after[name], value), name
    # The loss's metrics reach TRL's log.
    logged = set().union(*(h.keys() for h in trl.state.log_history))
    assert {k for k, v in native_calls[0].items() if not torch.is_tensor(v)} <= logged
