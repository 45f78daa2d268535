"""DACA inside TRL's GRPOTrainer (daca.integrations.trl), on the random tiny model (CPU)."""

import dataclasses

import pytest
import torch
from conftest import CPU_TRL

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from daca.core.dps import rollout_multipliers  # noqa: E402
from daca.integrations.trl import (  # noqa: E402
    DACAGRPOConfig,
    DACAGRPOTrainer,
    left_pad,
)
from daca.models.loading import (  # noqa: E402
    LoadedModel,
    load,
)
from daca.tasks.sudoku import generate_puzzles  # noqa: E402

G, PROMPTS, L = 3, 2, 16  # the conftest tiny model reads 36 positions


def ones_reward(prompts, completions, **kwargs):
    """A reward with spread on a random model: the fraction of '1' characters."""
    return [c.count("1") / L for c in completions]


def make_trainer(model_dir, tmp_path, **overrides):
    rows = generate_puzzles(PROMPTS, seed=1)
    data = datasets.Dataset.from_list([{"prompt": f"{r['puzzle']}=", **r} for r in rows])
    kw = dict(
        output_dir=str(tmp_path / "out"),
        **CPU_TRL,
        method="diffu_grpo",  # a policy ratio, clipping and a KL: every part of the update
        save_strategy="no",
        per_device_train_batch_size=G * PROMPTS,
        num_generations=G,
        num_iterations=2,
        beta=0.04,
        epsilon=0.2,
        scale_rewards="none",
        p_mask_prompt=0.3,
        gen_length=L,
        steps=8,
        block_length=8,
        temperature=1.0,
        dps_stride=2,
        max_steps=2,
        logging_steps=1,
        seed=3,
    )
    kw.update(overrides)
    model = model_dir if isinstance(model_dir, LoadedModel) else str(model_dir)
    trainer = DACAGRPOTrainer(
        model, reward_funcs=ones_reward, args=DACAGRPOConfig(**kw), train_dataset=data
    )
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop
    batch_rows = [data[i] for i in range(PROMPTS) for _ in range(G)]  # TRL's RepeatSampler order
    return trainer, batch_rows


def group_advantages(trainer):
    """r - mean_group(r) of the last rollout, recomputed from its decoded completions."""
    tok = trainer.processing_class
    texts = []
    for row in trainer.last_rollout.completion_ids.tolist():
        cut = row.index(tok.eos_token_id) if tok.eos_token_id in row else len(row)
        texts.append(tok.decode(row[:cut], skip_special_tokens=True))
    r = torch.tensor(ones_reward(None, texts))
    return r - r.view(-1, G).mean(1).repeat_interleave(G)


def spy_on_loss(trainer) -> list[dict]:
    """The inputs of every call of the method's loss (``daca.train.methods``), recorded."""
    calls = []
    method = trainer.daca_method

    def loss(cfg, logp, **kw):
        calls.append({k: v for k, v in kw.items() if torch.is_tensor(v)} | {"logp": logp})
        return method.loss(cfg, logp, **kw)

    trainer.daca_method = dataclasses.replace(method, loss=loss)
    return calls


def test_dps_multipliers_and_advantages_reach_the_loss(tiny_model_dir, tmp_path):
    trainer, rows = make_trainer(
        tiny_model_dir, tmp_path, dps_lam=0.5, dps_norm_axis="per_step", sml_enabled=True
    )
    calls = spy_on_loss(trainer)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows)
    mult = rollout_multipliers(trainer.last_rollout, lam=0.5, norm_axis="per_step")
    assert not torch.allclose(mult, torch.ones_like(mult))
    trainer.compute_loss(trainer.model, batch)
    (call,) = calls
    assert torch.equal(call["token_multipliers"], mult)  # one micro-batch: the step's DPS
    adv = group_advantages(trainer)
    assert adv.abs().sum() > 0
    torch.testing.assert_close(call["advantages"], adv, rtol=0, atol=1e-6)


@pytest.mark.parametrize("sml", [False, True])
def test_same_masks_for_current_old_and_reference(tiny_model_dir, tmp_path, sml):
    trainer, rows = make_trainer(tiny_model_dir, tmp_path, sml_enabled=sml, sml_num_strata=4)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows)
    old, ref = trainer._batches[0].old_logp, trainer._batches[0].ref_logp
    assert len(old) == 1 and len(ref) == 2  # iteration 0's old log-probs are the update's own
    assert not torch.equal(ref[0], ref[1])  # each inner iteration has its own masks
    for k in (0, 1):
        trainer._step = k  # unchanged weights: ratio 1 and KL 0 exactly iff the masks match
        trainer.compute_loss(trainer.model, batch)
        metrics = trainer._metrics["train"]
        assert metrics["kl"][-1] == 0.0 and metrics["ratio_mean"][-1] == 1.0


def test_completions_come_from_the_diffusion_sampler(tiny_model_dir, tmp_path):
    trainer, rows = make_trainer(tiny_model_dir, tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("model.generate must not be called")

    trainer.model.generate = refuse
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows)
    completion = trainer.last_rollout.completion_ids
    is_eos = completion == trainer._tokenizer.eos_token_id
    up_to_eos = (is_eos.long().cumsum(1) - is_eos.long()) == 0
    (step_batch,) = trainer._batches
    assert torch.equal(step_batch.completion_ids, completion)  # full length, as sampled
    assert torch.equal(step_batch.completion_mask, up_to_eos)  # the loss mask
    for row, ids, keep in zip(batch["completion_ids"], completion, up_to_eos, strict=True):
        assert row[: int(keep.sum())].tolist() == ids[keep].tolist()  # TRL's: cut after EOS


def test_training_runs_both_inner_iterations(tiny_model_dir, tmp_path, monkeypatch):
    trainer, _ = make_trainer(tiny_model_dir, tmp_path, sml_enabled=True, max_steps=2)
    used = []
    original = DACAGRPOTrainer._compute_loss

    def spy(self, model, inputs):
        used.append(self._iteration())
        return original(self, model, inputs)

    monkeypatch.setattr(DACAGRPOTrainer, "_compute_loss", spy)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert used == [0, 1]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert any(
        not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True)
    )
    trainer.save_model(str(tmp_path / "saved"))
    saved = load(str(tmp_path / "saved"))  # daca.json written beside it: compact prompts
    assert (saved.family, saved.prompt_format) == ("llada", "compact")
    ids = torch.randint(2, 20, (2, 9))
    torch.testing.assert_close(saved.model(ids).logits, trainer.model(ids).logits)


def test_left_pad():
    ids, mask = left_pad([[5, 6], [7]], 4, 0)
    assert ids.tolist() == [[0, 0, 5, 6], [0, 0, 0, 7]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    with pytest.raises(ValueError, match="prompt_width"):
        left_pad([[1, 2, 3]], 2, 0)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"remasking": "sideways"}, "remasking"),
        ({"gen_length": 16, "block_length": 5}, "not a multiple of block_length=5"),
        ({"gen_length": 16, "block_length": 8, "steps": 3}, "divisible"),
        ({"dps_norm_axis": "row"}, "dps_norm_axis"),
        ({"p_mask_prompt": 1.5}, "p_mask_prompt"),
        ({"sml_enabled": True, "sml_num_strata": 17, "gen_length": 16}, "sml_num_strata"),
        ({"mask_truncated_completions": True}, "mask_truncated_completions"),
        ({"dps_stride": 8, "steps": 8}, "dps_stride=8 >= steps=8"),
        ({"steps_per_generation": 2}, "DPS normalises over the trajectories of one optimizer"),
        ({"dps_credit": "oracle"}, "control of `daca train`"),
    ],
)
def test_config_rejects_bad_values(tmp_path, bad, match):
    kw = dict(output_dir=str(tmp_path), **CPU_TRL, method="wd1")
    with pytest.raises(ValueError, match=match):
        DACAGRPOConfig(**kw, **bad)


def test_reference_model_is_loaded_through_daca(tiny_model_dir, tmp_path):
    """beta > 0 without PEFT: TRL loads the reference from the policy's folder, through
    daca.models.load (transformers' Auto classes do not know LLaDA's config)."""
    trainer, _ = make_trainer(str(tiny_model_dir), tmp_path, beta=0.04)
    ref, policy = trainer.ref_model, trainer.model
    assert type(ref) is type(policy) and ref is not policy
    for (name, a), (_, b) in zip(
        ref.state_dict().items(), policy.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"method": "grpo"}, "coupled_grpo"),  # the message names the registry's methods
        ({"method": "diffu_grpo", "loss_type": "grpo"}, "loss_type"),
        ({"method": "diffu_grpo", "epsilon_high": 0.3}, "epsilon_high"),
        ({"method": "diffu_grpo", "top_entropy_quantile": 0.5}, "top_entropy_quantile"),
        ({"method": "diffu_grpo", "scale_rewards": "batch"}, "scale_rewards"),
        ({"method": "wd1", "beta": 0.04}, "beta=0"),
        ({"method": "gdpo", "quadrature": "simpson"}, "quadrature"),
        ({"method": "diffu_grpo", "p_mask_prompt": 1.0}, "p_mask_prompt"),  # daca's [0, 1)
        (  # a micro-batch of whole groups (TRL asks it only of the generation batch)
            {"method": "wd1", "per_device_train_batch_size": 3, "num_generations": 2}
            | {"gradient_accumulation_steps": 2},
            "not a multiple of num_generations",
        ),
        ({"method": None}, "needs method="),  # TRL's own loss is retired (docs/trl.md)
    ],
)
def test_method_config_rejects_what_would_not_apply(tmp_path, bad, match):
    kw = dict(output_dir=str(tmp_path), **CPU_TRL)
    with pytest.raises(ValueError, match=match):
        DACAGRPOConfig(**kw, **bad)


def test_method_fields_are_daca_train_fields(tmp_path):
    """psi and quadrature are TrainConfig's fields (default and help), and train_config() is
    the daca train config of the flat fields."""
    import dataclasses

    from daca.train.config import TrainConfig

    ours = {f.name: f for f in dataclasses.fields(DACAGRPOConfig)}
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("psi", "quadrature", "p_mask_prompt"):
            assert (ours[f.name].default, ours[f.name].metadata) == (f.default, f.metadata)
    args = DACAGRPOConfig(
        output_dir=str(tmp_path), **CPU_TRL, method="wd1", psi=2.0, sml_enabled=True, sml_eta=0.3,
        num_generations=3, per_device_train_batch_size=6, dps_lam=0.25, scale_rewards="none",
    )  # fmt: skip
    cfg = args.train_config()
    assert (cfg.method, cfg.psi, cfg.sml.eta, cfg.dps.lam) == ("wd1", 2.0, 0.3, 0.25)
    assert (cfg.num_generations, cfg.per_device_train_batch_size, cfg.scale_rewards) == (
        3,
        6,
        "none",
    )


def test_method_mode_evaluates(tiny_model_dir, tmp_path):
    """TRL's evaluation with method=: one micro-batch, the method's loss and its metrics."""
    trainer, _ = make_trainer(
        tiny_model_dir, tmp_path, method="wd1", num_iterations=1, beta=0.0, sml_enabled=True,
        sml_eta=0.5, per_device_eval_batch_size=G * PROMPTS,
    )  # fmt: skip
    metrics = trainer.evaluate(trainer.train_dataset)
    assert torch.isfinite(torch.tensor(metrics["eval_loss"])) and metrics["eval_loss"] != 0
    assert {"eval_sml_logp_mean", "eval_logp_mean", "eval_dps/multiplier_std"} <= set(metrics)
