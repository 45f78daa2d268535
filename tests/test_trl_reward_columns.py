"""Under DACAGRPOTrainer every dataset column, ``prompt`` included, reaches reward functions."""

import asyncio

import pytest
from conftest import CPU_TRL

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from daca.integrations.trl import (  # noqa: E402
    DACAGRPOConfig,
    DACAGRPOTrainer,
    with_prompt_column,
)
from daca.tasks.sudoku import generate_puzzles  # noqa: E402

G, PROMPTS, L = 2, 2, 16


def one_step_args(tmp_path, **overrides) -> DACAGRPOConfig:
    """One TRL step of the tiny model on the CPU."""
    kw = dict(
        output_dir=str(tmp_path / "out"),
        **CPU_TRL,
        method="wd1",
        save_strategy="no",
        per_device_train_batch_size=G * PROMPTS,
        num_generations=G,
        gen_length=L,
        steps=8,
        block_length=8,
        max_steps=1,
        seed=3,
    )
    return DACAGRPOConfig(**(kw | overrides))


def test_reward_functions_receive_every_column_including_prompt(tiny_model_dir, tmp_path):
    seen = []

    def recording_reward(prompts, completions, prompt, entry_point, **columns):
        seen.append({"prompts": prompts, "prompt": prompt, "entry_point": entry_point, **columns})
        return [0.0] * len(completions)

    rows = generate_puzzles(PROMPTS, seed=1)
    data = datasets.Dataset.from_list(
        [{"prompt": f"{r['puzzle']}=", "entry_point": f"f{i}", **r} for i, r in enumerate(rows)]
    )
    args = one_step_args(tmp_path)
    trainer = DACAGRPOTrainer(
        str(tiny_model_dir), reward_funcs=recording_reward, args=args, train_dataset=data
    )
    assert trainer.reward_func_names == ["recording_reward"]  # logging keeps the name
    trainer.current_gradient_accumulation_steps = 1
    batch = [data[i] for i in range(PROMPTS) for _ in range(G)]
    trainer._generate_and_score_completions(batch)
    (call,) = seen
    assert call["prompt"] == [r["prompt"] for r in batch] == call["prompts"]
    assert call["entry_point"] == ["f0", "f0", "f1", "f1"]
    assert call["solution"] == [r["solution"] for r in batch]  # the other columns still arrive


def test_prompt_column_wrapper_keeps_async_and_explicit_prompt():
    async def async_reward(prompts, completions, prompt, **kw):
        return [float(p == q) for p, q in zip(prompts, prompt, strict=True)]

    wrapped = with_prompt_column(async_reward)
    assert asyncio.run(wrapped(prompts=["a", "b"], completions=["", ""])) == [1.0, 1.0]

    def reward(prompts, completions, prompt, **kw):
        return prompt

    # A caller that passes ``prompt`` itself keeps its value.
    assert with_prompt_column(reward)(prompts=["a"], completions=[""], prompt=["x"]) == ["x"]


def test_humaneval_trains_through_the_trl_front_end(tiny_model_dir, tmp_path):
    """HumanEval's own rewards (sandboxed tests, which need the ``prompt`` column) in one TRL
    step of the tiny model: every completion is executed and scored, nothing raises."""
    from daca.tasks import get_task

    task = get_task("humaneval")
    from daca.tasks.sandbox import isolation_available

    try:
        isolation_available()
    except Exception as e:  # noqa: BLE001 - no working sandbox here: nothing to execute in
        pytest.skip(f"no sandbox: {e}")
    rows = task.load("test", limit=2)
    data = datasets.Dataset.from_list(rows)  # columns prompt, test, entry_point, ...
    args = one_step_args(tmp_path, logging_steps=1)
    trainer = DACAGRPOTrainer(
        str(tiny_model_dir), reward_funcs=task.reward_funcs, args=args, train_dataset=data
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 1
    names = [f"rewards/{getattr(f, '__name__', '')}/mean" for f in task.reward_funcs]
    assert all(n in logged[0] for n in names), sorted(logged[0])  # both rewards ran and scored
