"""Native-family checkpoints in the hub's layout (LLaDA, Dream, dllm's A2D Qwen3, Qwen2 and
Llama, LLaDA-MoE, LLaDA 2.x), trained end to end as a user would.

Each family (tests/_hub.py: real config keys, vocabulary sizes and special ids, poisoned
``*.py`` files) goes through ``daca train`` with LoRA and gradient checkpointing for 2 steps; the
checkpoint it leaves is a model ``daca eval`` accepts and ``daca export --merge-lora`` turns
into the merged model, in the family's hub layout. Through TRL: one step with PEFT and TRL's
default gradient checkpointing, and one with ``beta > 0`` and no PEFT (TRL's reference model is
loaded through daca).
"""

import json

import pytest
import torch
from _hub import imported_python, write_dream, write_llada
from _hub_a2d import write_a2d_llama, write_a2d_qwen2, write_a2d_qwen3
from _hub_llada2 import write_llada2
from _hub_moe import write_llada_moe

from daca.cli import main
from daca.core.modeling import forward_logits
from daca.models import load
from daca.models.families import FAMILIES
from daca.tasks import Task, get_task, register_task
from daca.train.config import load_config
from daca.train.trainer import Trainer

WRITERS = {
    "llada": write_llada,
    "dream": write_dream,
    "a2d-qwen3": write_a2d_qwen3,
    "a2d-qwen2": write_a2d_qwen2,
    "a2d-llama": write_a2d_llama,
    "llada-moe": write_llada_moe,
    "llada2": write_llada2,  # attention blocks of 8: the completions below are one block
}
# The first attention weight of each family's hub layout.
FIRST_KEY = {
    "llada": "model.transformer.blocks.0.q_proj.weight",
    "llada2": "model.layers.0.attention.query_key_value.weight",
}


def ones(prompts, completions, **kw):
    """A reward a random model can move: distinct characters per completion token."""
    return [len(set(c)) / 8 for c in completions]


def writes_only_known_tokens(model, tokenizer):
    """A forward hook that keeps a random model off the embedding rows the (byte-level) test
    tokenizer does not cover, as a trained model keeps off them; returns its handle."""
    bias = torch.zeros(model.config.vocab_size)
    bias[len(tokenizer) :] = -1e4
    return model.lm_head.register_forward_hook(lambda module, args, out: out + bias)


def short_task() -> Task:
    """Sudoku rows behind a short chat prompt: the real vocabularies make every forward cost
    ~130k logits a position, so prompts stay a few tokens long."""
    sudoku = get_task("sudoku")
    return Task(
        name="short",
        load=sudoku.load,
        chat_prompt=lambda row: row["puzzle"][:6],
        reward_funcs=[ones],
        score=lambda completions, **kw: ones(None, completions),
        columns=sudoku.columns,
    )


register_task("short", short_task)


@pytest.fixture(scope="module")
def hub_dirs(tmp_path_factory):
    return {f: write(tmp_path_factory.mktemp(f), seed=3) for f, write in WRITERS.items()}


def some_ids(bundle, n=2, length=7):
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, 5000, (n, length), generator=g)


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_lora_training_leaves_a_checkpoint_that_evaluates_and_exports(family, hub_dirs, tmp_path):
    folder = hub_dirs[family]
    cfg = load_config(
        None,
        [
            f"model={folder}",
            f"output_dir={tmp_path}",
            "name=run",
            "task=short",
            "method=wd1",
            "per_device_train_batch_size=4",
            "num_generations=2",
            "train_size=8",
            "eval_size=2",
            "eval_batch_size=2",
            "eval_every=0",
            "max_steps=2",
            "tensorboard=false",
            "generation.gen_length=8",
            "generation.steps=4",
            "generation.block_length=8",
            "generation.temperature=1.0",
            "learning_rate=1e-2",
            "lora.enabled=true",
            "lora.r=4",
            "lora.dropout=0.0",
            "gradient_checkpointing=true",
        ],
    )
    trainer = Trainer(cfg, progress=False)
    peft = trainer.acc.unwrap_model(trainer.model)
    assert peft.get_base_model().is_activation_checkpointing
    # The adapters sit on the family's projection names, every one of them.
    names = {n.split(".")[-2] for n, _ in peft.named_modules() if n.endswith(".lora_A")}
    assert names == set(FAMILIES[family].lora_targets)
    hook = writes_only_known_tokens(peft.get_base_model(), trainer.bundle.tokenizer)
    trainer.train()
    hook.remove()
    assert any(h["reward_std"] > 0 for h in trainer.history)
    lora_b = [p for n, p in peft.named_parameters() if "lora_B" in n]
    assert any(p.abs().sum() > 0 for p in lora_b)  # the adapter moved off its zero start

    checkpoint = tmp_path / "run" / "checkpoints" / "step-0000002" / "model"
    assert (checkpoint / "adapter_config.json").is_file()
    assert json.loads((checkpoint / "daca.json").read_text())["base_model"] == str(folder)
    saved = load(str(checkpoint))
    ids = some_ids(saved)
    peft.eval()
    torch.testing.assert_close(forward_logits(saved.model, ids), forward_logits(peft, ids))

    out = tmp_path / "eval.jsonl"
    assert main(["eval", "--model", str(checkpoint), "--task", "short", "--limit", "2",
                 "--out", str(out)]) == 0  # fmt: skip
    assert len(out.read_text().splitlines()) == 2

    merged_dir = tmp_path / "merged"
    assert main(["export", str(tmp_path / "run"), "--out", str(merged_dir), "--merge-lora"]) == 0
    merged = load(str(merged_dir))
    assert not hasattr(merged.model, "peft_config")
    torch.testing.assert_close(
        forward_logits(merged.model, ids), forward_logits(saved.model, ids), atol=1e-4, rtol=1e-4
    )
    hub = json.loads((merged_dir / "config.json").read_text())
    assert hub["model_type"] == json.loads((folder / "config.json").read_text())["model_type"]
    index = merged_dir / "model.safetensors"
    from safetensors import safe_open

    keys = set(safe_open(str(index), "pt").keys())
    assert FIRST_KEY.get(family, "model.layers.0.self_attn.q_proj.weight") in keys
    assert imported_python(folder) == []


def test_export_refuses_a_run_without_checkpoints(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "m")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


# ----------------------------------------------------------------------------- TRL
@pytest.mark.parametrize("setting", ["peft", "reference"])
@pytest.mark.parametrize("family", sorted(WRITERS))
def test_one_trl_step(family, setting, hub_dirs, tmp_path):
    """PEFT with TRL's default gradient checkpointing; or beta > 0 without PEFT, where TRL
    loads a reference model from the policy's folder (through daca.models.load)."""
    datasets = pytest.importorskip("datasets")
    from daca.integrations.trl import DACAGRPOConfig, DACAGRPOTrainer

    rows = get_task("sudoku").load("train", limit=2, seed=0)
    data = datasets.Dataset.from_list([{"prompt": r["puzzle"][:6]} for r in rows])
    kw = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        method="diffu_grpo",  # a ratio: beta > 0 needs the reference
        save_strategy="no",
        per_device_train_batch_size=4,
        num_generations=2,
        gen_length=8,
        steps=4,
        block_length=8,
        dps_stride=2,  # below steps: a stride of 4 records a single step (refused)
        max_steps=1,
        logging_steps=1,
        seed=0,
    )
    extra = {}
    if setting == "peft":
        from peft import LoraConfig

        # d1's q and v (LLaDA 2.x stores them in one fused projection)
        targets = ["query_key_value"] if family == "llada2" else ["q_proj", "v_proj"]
        extra["peft_config"] = LoraConfig(r=4, target_modules=targets)
        kw["beta"] = 0.0
    else:
        kw.update(beta=0.04, activation_checkpointing=False)
    trainer = DACAGRPOTrainer(
        str(hub_dirs[family]),
        reward_funcs=ones,
        args=DACAGRPOConfig(**kw),
        train_dataset=data,
        **extra,
    )
    if setting == "reference":
        ref, policy = trainer.ref_model, trainer.model
        assert type(ref) is type(policy) and ref is not policy
    trainer.train()
    if setting == "peft":
        assert trainer.args.activation_checkpointing  # TRL's default, left on
        assert trainer.model.get_base_model().is_activation_checkpointing
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 1 and torch.isfinite(torch.tensor(losses)).all()
    assert imported_python(hub_dirs[family]) == []
