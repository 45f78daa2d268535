"""Resuming a ``DACAGRPOTrainer`` run from a checkpoint replays the uninterrupted run's
rollouts and updates: the sampler's and the masks' generators are seeded from the step
(``daca.train.seeds``), and TRL restores the weights, the optimizer, the data order and the
global RNG (docs/trl.md, "Resuming")."""

import pytest
import torch
from conftest import CPU_TRL

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from daca.integrations.trl import DACAGRPOConfig, DACAGRPOTrainer  # noqa: E402
from daca.tasks.sudoku import generate_puzzles  # noqa: E402

G, PROMPTS, L = 3, 2, 16


def ones_reward(prompts, completions, **kwargs):
    return [c.count("1") / L for c in completions]


def run(model_dir, out, max_steps, resume=False) -> tuple[list, dict]:
    """Train to ``max_steps`` (checkpoints every 2 steps): the completions of each rollout, and
    the logged loss of each step."""
    rows = generate_puzzles(4 * PROMPTS, seed=1)
    data = datasets.Dataset.from_list([{"prompt": f"{r['puzzle']}=", **r} for r in rows])
    args = DACAGRPOConfig(
        output_dir=str(out),
        **CPU_TRL,
        method="diffu_grpo",
        save_strategy="steps",
        save_steps=2,
        per_device_train_batch_size=G * PROMPTS,
        num_generations=G,
        num_iterations=2,  # a rollout every 2 steps: checkpoints fall on rollouts
        beta=0.04,
        learning_rate=1e-2,
        lr_scheduler_type="constant",  # the split run's schedule must not depend on max_steps
        p_mask_prompt=0.3,
        gen_length=L,
        steps=8,
        block_length=8,
        temperature=1.0,
        dps_stride=2,
        max_steps=max_steps,
        logging_steps=1,
        seed=3,
    )
    trainer = DACAGRPOTrainer(
        str(model_dir), reward_funcs=ones_reward, args=args, train_dataset=data
    )
    rollouts = []
    generate = trainer._generate_single_turn

    def recorded(*a, **kw):
        out = generate(*a, **kw)
        rollouts.append(trainer.last_rollout.completion_ids.clone())
        return out

    trainer._generate_single_turn = recorded
    trainer.train(resume_from_checkpoint=resume or None)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    return rollouts, losses


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """(the straight run's rollouts, the resumed run's), resumed at step 2 of 4."""
    tmp = tmp_path_factory.mktemp("trl-resume")
    straight = run(tiny_model_dir, tmp / "straight", max_steps=4)
    run(tiny_model_dir, tmp / "split", max_steps=2)
    resumed = run(tiny_model_dir, tmp / "split", max_steps=4, resume=True)
    assert len(straight[0]) == 2 and len(resumed[0]) == 1  # rollouts at steps 0 and 2
    return straight, resumed


def test_resumed_run_draws_the_uninterrupted_runs_random_numbers(runs):
    """The same masks after the resume: the resumed steps' losses are the uninterrupted run's,
    to the bit, and another step draws other numbers."""
    (_, straight), (_, resumed) = runs
    assert sorted(resumed) == [1, 2, 3, 4]  # steps 1-2 from the checkpoint's log, 3-4 run again
    assert all(resumed[step] == straight[step] for step in (3, 4))
    assert straight[1] != straight[3]


def test_resumed_run_replays_the_uninterrupted_rollouts(runs):
    (straight, _), (resumed, _) = runs
    assert torch.equal(straight[1], resumed[0])
    assert not torch.equal(straight[0], straight[1])  # another step, other draws
