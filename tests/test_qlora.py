"""The paper's QLoRA path (4-bit NF4 base, LoRA adapter; METHOD.md §5) on a CPU, through
bitsandbytes' CPU backend, on tiny hub-layout LLaDA, Dream and A2D Qwen3, Qwen2 and Llama
checkpoints: 4-bit layers, exact gradients, the paper recipe trained, checkpointed, resumed
exactly, evaluated and exported."""

import json
from pathlib import Path

import pytest
import torch
from _hub import write_dream, write_llada
from _hub_a2d import write_a2d_llama, write_a2d_qwen2, write_a2d_qwen3
from _hub_llada2 import write_llada2
from _hub_moe import write_llada_moe
from safetensors.torch import load_file, save_file

from daca.cli import main
from daca.core.modeling import forward_logits
from daca.train.config import load_config
from daca.train.trainer import Trainer

bnb = pytest.importorskip("bitsandbytes")

ROOT = Path(__file__).resolve().parent.parent
# bitsandbytes packs 4-bit weights in blocks of 64: widths of 64 are the smallest that quantise
# like an 8B model's (all of whose widths are multiples of 64).
WRITERS = {
    "llada": lambda p: write_llada(p, d_model=64, mlp_hidden_size=128),
    "dream": lambda p: write_dream(p, hidden_size=64, intermediate_size=128),
    "a2d-qwen3": lambda p: write_a2d_qwen3(p, hidden_size=64, intermediate_size=128),
    "a2d-qwen2": lambda p: write_a2d_qwen2(p, hidden_size=64, intermediate_size=128),
    # an explicit head width of 16, as Qwen3's: query and key/value widths 64 and 32
    "a2d-llama": lambda p: write_a2d_llama(p, hidden_size=64, intermediate_size=128, head_dim=16),
    # every layer a mixture of 4 experts of width 64, top 2
    "llada-moe": lambda p: write_llada_moe(p, hidden_size=64, expert_size=64),
    # the first layer dense, then 4 experts of width 64 and a shared one; attention blocks of 8
    "llada2": lambda p: write_llada2(p, hidden_size=64, expert_size=64, dense_size=128),
}
# The paper recipe with only the model size and the lengths shrunk (and the batch with them).
SHRUNK = [
    "device=cpu",
    "per_device_train_batch_size=2",
    "num_generations=2",
    "train_size=8",
    "eval_size=2",
    "eval_every=0",
    "save_every=1",
    "save_rollouts_every=0",
    "tensorboard=false",
    "generation.gen_length=8",
    "generation.steps=4",
    "generation.block_length=8",
    "dps.stride=1",
    "lora.r=8",
    # μ 1, not the recipe's 12: on a CPU without native bf16 matmul (AVX2 only) each bf16
    # update falls back to torch's reference gemm (2 to 3 s here, 12 of them a step); more
    # updates per rollout are tested in fp32 (test_trainer, test_lora_resume).
    "num_iterations=1",
]


@pytest.fixture(scope="module", params=sorted(WRITERS))
def hub_model(request, tmp_path_factory):
    return WRITERS[request.param](tmp_path_factory.mktemp(request.param))


def _linear4bit(model) -> int:
    return sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())


def _projections(folder) -> int:
    """The projections 4-bit loading quantises, from config.json: per layer q, k, v, o and a
    gate, up and down for the MLP or for each expert of a mixture (whose router stays full
    precision)."""
    c = json.loads((Path(folder) / "config.json").read_text())
    layers = c.get("num_hidden_layers") or c["n_layers"]
    if c["model_type"] == "llada2_moe":  # fused q/k/v and dense; dense layers, then experts
        dense = c["first_k_dense_replace"]
        experts = c["num_experts"] + (1 if c["num_shared_experts"] else 0)
        return layers * 2 + 3 * (dense + (layers - dense) * experts)
    return layers * (4 + 3 * c.get("num_experts", 1))


def test_4bit_load_on_cpu_has_linear4bit_layers(hub_model):
    from daca.models.loading import load_4bit

    for dtype in (torch.bfloat16, torch.float32):
        bundle = load_4bit(str(hub_model), device="cpu", dtype=dtype)
        assert _linear4bit(bundle.model) == _projections(hub_model)
        logits = forward_logits(bundle.model, torch.randint(0, 300, (2, 6)))
        assert logits.shape[:2] == (2, 6) and torch.isfinite(logits).all()


def test_an_inference_forward_leaves_the_lora_gradients_unchanged(hub_model):
    """A rollout (eval mode, no gradients) must not switch bitsandbytes to its CPU inference
    kernel, which has no backward: the gradients after one equal those without."""
    from peft import LoraConfig, get_peft_model

    from daca.models.families import lora_targets
    from daca.models.loading import load_4bit
    from daca.models.quant import prepare_for_training

    ids = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(0))
    grads = []
    for rollout_first in (False, True):
        bundle = load_4bit(str(hub_model), device="cpu", dtype=torch.float32)
        model = prepare_for_training(bundle.model)
        if rollout_first:
            with torch.no_grad():
                forward_logits(model.eval(), ids)
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, target_modules=lora_targets(bundle)))
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B = 0 at init would hide the base layers' input gradients
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(1))
        model.train()
        forward_logits(model, ids).logsumexp(-1).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * _projections(hub_model)
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
    assert all(g.abs().sum() > 0 for g in grads[0].values())


def _trainer(model_dir, out, name, *overrides, resume=False):
    cfg = load_config(
        ROOT / "configs/paper/countdown.yaml",
        [f"model={model_dir}", f"output_dir={out}", f"name={name}", *SHRUNK, *overrides],
    )
    assert cfg.load_in_4bit and cfg.lora.enabled and cfg.bf16  # kept from the recipe
    return Trainer(cfg, resume=resume, progress=False)


def _adapter(trainer) -> dict:
    model = trainer.acc.unwrap_model(trainer.model)
    return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}


def _metrics(run_dir) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


@pytest.mark.slow
def test_paper_recipe_in_4bit_trains_resumes_exactly_evaluates_and_exports(
    hub_model, tmp_path, capsys
):
    straight = _trainer(hub_model, tmp_path, "straight", "max_steps=2")
    assert _linear4bit(straight.model) == _projections(hub_model)
    straight.train()
    _trainer(hub_model, tmp_path, "split", "max_steps=1").train()
    resumed = _trainer(hub_model, tmp_path, "split", "max_steps=2", resume=True)
    assert resumed.step == 1 and _linear4bit(resumed.model) == _projections(hub_model)
    resumed.train()
    a, b = _adapter(straight), _adapter(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _metrics(tmp_path / "straight") == _metrics(tmp_path / "split")

    checkpoint = tmp_path / "split" / "checkpoints" / "step-0000002" / "model"
    assert json.loads((checkpoint / "daca.json").read_text())["base_in_4bit"] is True
    out = tmp_path / "eval.jsonl"
    code = main(["eval", "--task", "countdown", "--model", str(checkpoint), "--limit", "2",
                 "--device", "cpu", "--out", str(out)])  # fmt: skip
    assert code == 0 and len(out.read_text().splitlines()) == 2

    from daca.models import load

    # Two steps of a random model earn (nearly) no reward, hence no update: give the adapter
    # seeded random weights, so that a merge that lost or doubled it would show.
    adapter = checkpoint / "adapter_model.safetensors"
    weights, noise = load_file(adapter), torch.Generator().manual_seed(2)
    save_file({k: torch.randn(v.shape, generator=noise) * 0.1 for k, v in weights.items()}, adapter)
    on_4bit = load(str(checkpoint))  # the adapter on the NF4 base it was trained on
    assert _linear4bit(on_4bit.model) == _projections(hub_model)
    assert main(["export", str(tmp_path / "split"), "--out", str(tmp_path / "merged"),
                 "--merge-lora"]) == 0  # fmt: skip
    merged = load(str(tmp_path / "merged"))  # the adapter merged into the fp32 base
    unmerged = load(str(checkpoint), base_in_4bit=False)  # the adapter on the fp32 base
    base = load(str(hub_model))
    assert _linear4bit(merged.model) == 0 and not hasattr(merged.model, "peft_config")
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        q, m, u, full = (
            forward_logits(x.model.eval(), ids).float() for x in (on_4bit, merged, unmerged, base)
        )
    assert (u - full).abs().mean() > 0.1 * full.std()  # the adapter changes the logits
    assert torch.allclose(m, u, atol=1e-4, rtol=1e-4)  # the merge is the adapter, exactly
    # Stated tolerance: the merged model differs from adapter-on-4-bit by the base's own NF4
    # error (these random widths quantise coarsely: about a third of the logits' std), at most
    # 1.25 times what the 4-bit base differs from the full one by (measured: 0.8 to 0.95 times).
    from daca.models.loading import load_4bit

    base_4bit = load_4bit(str(hub_model), device="cpu", dtype=torch.float32)
    with torch.no_grad():
        nf4_error = (forward_logits(base_4bit.model.eval(), ids).float() - full).abs().mean()
    assert (m - q).abs().mean() <= 1.25 * nf4_error
    assert (m - q).abs().mean() < 0.5 * (u - full).abs().mean()  # far below the adapter's effect
