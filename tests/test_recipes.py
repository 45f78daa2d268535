"""Shipped recipes resolve and validate in ``daca train --dry-run``; the paper's recipes hold
METHOD.md §5's settings, the overrides their headers document are valid, and the memory
estimate matches numbers worked out by hand."""

import re
from pathlib import Path

import pytest
import torch
from conftest import random_mlm

from daca.cli import main
from daca.core.sampler import generate
from daca.models.families import family_of
from daca.models.native_llada2 import ATTENTION_BLOCK
from daca.tools.memory import NF4_BYTES, dps_trace_rows, estimate
from daca.train.config import load_config, published_differences

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if p.parent.name != "accelerate")
PAPER = sorted((ROOT / "configs" / "paper").glob("*.yaml"))
BENCHMARKS = {"gsm8k", "math500", "countdown", "sudoku", "mbpp", "humaneval", "json_schema"}


def header_overrides(path: Path) -> dict[str, list[str]]:
    """Label -> overrides of each comment line of a recipe that lists ``key=value`` overrides
    (the command lines excepted)."""
    found = {}
    for line in path.read_text().splitlines():
        overrides = [t for t in line[1:].split() if re.fullmatch(r"[a-z_.0-9]+=\S+", t)]
        if line.startswith("#") and overrides and "daca.cli" not in line:
            label = re.sub(r"\s+", " ", line[1:].split(overrides[0])[0]).strip()
            found[label.removeprefix("base method ").removeprefix("DACA variant ")] = overrides
    return found


def test_one_paper_recipe_per_benchmark():
    assert {p.stem for p in PAPER} == BENCHMARKS


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_recipe_dry_run(path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "effective batch" in out
    if "paper" in path.parts:
        assert "estimated GPU memory per device" in out and "unavailable" not in out


def test_paper_recipe_effective_batch_on_eight_processes(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert main(["train", "--config", str(ROOT / "configs/paper/gsm8k.yaml"), "--dry-run"]) == 0
    # 6 completions = 1 prompt per process and micro-batch, x 8 processes x 2 accumulated.
    assert (
        "effective batch 16 prompts x 6 = 96 completions per step over 8" in capsys.readouterr().out
    )


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_paper_recipe_settings_and_documented_overrides(path):
    cfg = load_config(path)
    g = cfg.generation
    assert cfg.model == "GSAI-ML/LLaDA-8B-Instruct" and cfg.task == path.stem
    assert (cfg.bf16, cfg.load_in_4bit, cfg.lora.enabled) == (True, True, True)
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout) == (128, 64, 0.05)
    assert (cfg.learning_rate, cfg.adam_beta1, cfg.adam_beta2) == (3e-6, 0.9, 0.99)
    assert (cfg.weight_decay, cfg.max_grad_norm, cfg.gradient_accumulation_steps) == (0.1, 0.2, 2)
    assert (cfg.num_generations, g.gen_length, g.steps, g.block_length) == (6, 256, 128, 32)
    assert g.temperature == 0.9
    assert (cfg.method, cfg.dps.enabled, cfg.sml.enabled) == ("wd1", True, False)

    found = header_overrides(path)
    # μ: the reference codes' rollout reuse (wd1's run scripts: 12, Sudoku 8), for wd1 too.
    mu = 8 if path.stem == "sudoku" else 12
    assert cfg.num_iterations == mu and cfg.name == f"llada-{path.stem}-wd1-dps"
    # A one-word method= takes the method's published settings (published_settings: true).
    want = {
        "Diffu-GRPO": dict(method="diffu_grpo", num_iterations=mu, beta=0.04, learning_rate=3e-6),
        "GDPO": dict(method="gdpo", num_iterations=mu, learning_rate=3e-7, beta=0.0),
        "coupled-GRPO": dict(
            method="coupled_grpo", num_iterations=2, learning_rate=1e-6, beta=0.01
        ),
        "base": {"dps.enabled": False, "sml.enabled": False},
        "+SML": {"dps.enabled": False, "sml.enabled": True},
        "full DACA": {"dps.enabled": True, "sml.enabled": True},
    }
    assert want.keys() <= found.keys()
    for label, expected in want.items():
        cfg = load_config(path, found[label])
        for key, value in expected.items():
            section, _, name = key.rpartition(".")
            assert getattr(getattr(cfg, section) if section else cfg, name) == value, label


# The family recipes (configs/paper/families): the settings of each family's own RL code
# (dllm ca17675's GRPO examples for LLaDA and A2D, ml-diffucoder's config_coupled_code.yaml),
# as (G, completions per device, accumulation, μ, β, ε, p_mask_prompt), (L, steps, block,
# temperature), and the base method its code runs.
FAMILY_SOURCES = {
    "a2d-qwen3-gsm8k": ((6, 6, 2, 12, 0.04, 0.5, 0.15), (256, 128, 32, 1.0), "diffu_grpo"),
    "llada-moe-gsm8k": ((6, 6, 2, 12, 0.04, 0.5, 0.15), (256, 128, 32, 1.0), "diffu_grpo"),
    "llada2-mini-gsm8k": ((6, 6, 2, 12, 0.04, 0.5, 0.15), (256, 256, 32, 1.0), "diffu_grpo"),
    # 5 a device x 2 accumulated there = 10 a device in one micro-batch here (whole groups).
    "diffucoder-mbpp": ((10, 10, 1, 2, 0.01, 0.5, 0.0), (256, 256, 256, 1.0), "coupled_grpo"),
}
FAMILY_RECIPES = sorted((ROOT / "configs" / "paper" / "families").glob("*.yaml"))


def test_one_recipe_per_new_family():
    assert {p.stem for p in FAMILY_RECIPES} == FAMILY_SOURCES.keys()
    families = {family_of(*_model_type(load_config(p).model)) for p in FAMILY_RECIPES}
    assert families == {"a2d-qwen3", "llada-moe", "llada2", "dream"}


def _model_type(name: str) -> tuple[str, dict]:
    from daca.models.families import _config_of

    config, source = _config_of(name)
    assert source == "built-in config.json"  # a dry run of the recipe downloads nothing
    return config["model_type"], config


@pytest.mark.parametrize("path", FAMILY_RECIPES, ids=lambda p: p.stem)
def test_family_recipe_settings_and_documented_overrides(path):
    cfg = load_config(path)
    g = cfg.generation
    batch, decoding, method = FAMILY_SOURCES[path.stem]
    got = (cfg.num_generations, cfg.per_device_train_batch_size)
    got += (cfg.gradient_accumulation_steps, cfg.num_iterations, cfg.beta, cfg.epsilon)
    assert got + (cfg.p_mask_prompt,) == batch
    assert (g.gen_length, g.steps, g.block_length, g.temperature) == decoding
    assert (cfg.method, cfg.dps.enabled, cfg.sml.enabled) == (method, True, False)
    assert published_differences(cfg) == []  # the method's published lr and β (and μ)
    # The paper's QLoRA rank and optimizer beside the family's batch (A2D: no 4-bit, as dllm).
    assert (cfg.lora.enabled, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout) == (True, 128, 64, 0.05)
    assert (cfg.load_in_4bit, cfg.bf16) == (not path.stem.startswith("a2d"), True)
    assert (cfg.weight_decay, cfg.max_grad_norm, cfg.adam_beta2) == (0.1, 0.2, 0.99)
    # About 32 recorded DPS steps, as the paper's stride 4 of 128.
    assert g.steps // cfg.dps.stride == 32
    if path.stem.startswith("llada2"):  # the model's attention block, which the sampler needs
        assert g.block_length == ATTENTION_BLOCK and g.parallel_threshold == 0.95
    found = header_overrides(path)
    for label, expected in {
        "base": {"dps.enabled": False, "sml.enabled": False},
        "full DACA": {"dps.enabled": True, "sml.enabled": True},
        "wd1": dict(method="wd1", beta=0.0, learning_rate=3e-6),
    }.items():
        cfg = load_config(path, found[label])
        for key, value in expected.items():
            section, _, name = key.rpartition(".")
            assert getattr(getattr(cfg, section) if section else cfg, name) == value, label
    for overrides in found.values():  # every other override line validates
        load_config(path, overrides)


def test_memory_estimate_of_the_gsm8k_recipe_by_hand():
    est = estimate(load_config(ROOT / "configs/paper/gsm8k.yaml"))
    # The LLaDA module built on the meta device: projections, embedding + head, RMSNorm weights.
    linear, embeddings = 32 * (4 * 4096**2 + 3 * 4096 * 12288), 2 * 126464 * 4096
    norms = 32 * 2 * 4096 + 4096
    assert est.source == "built-in config.json"
    assert est.parameters == linear + embeddings + norms == 8_015_581_184
    assert est.resident["weights (4-bit NF4, embeddings fp32)"] == pytest.approx(
        linear * NF4_BYTES + (embeddings + norms) * 4  # fp32: prepare_model_for_kbit_training
    )
    assert est.trainable == 335_544_320
    assert est.resident["LoRA r=128 + gradients + AdamW (fp32)"] == 335_544_320 * 16
    # Peak held rows per sequence, L (T + s - 1)^2 / (4 s T) = 256 * 131^2 / 2048 = 2145.125,
    # each a bf16 row of the vocabulary plus its float32 logsumexp; 6 sequences per device.
    assert dps_trace_rows(256, 128, 32, 4, "all") == 2145.125
    trace = est.rollout["DPS trace (peak, scope all, s=4)"]
    assert trace == 6 * 2145.125 * (126464 * 2 + 4)
    # block scope: k = 16 steps per block, 32 (16 + 2 * 4 - 1)^2 / (4 * 4 * 16) = 66.125 rows
    assert dps_trace_rows(256, 128, 32, 4, "block") == 66.125
    # The first step of a block: its 6 x 32 logits rows copied (bf16), then the float64
    # Gumbel-max over them (4 float64 tensors of their size at its peak).
    candidates = est.rollout["candidates of one block (float64 Gumbel-max)"]
    assert candidates == 6 * 32 * 126464 * (2 + 32)
    # The head runs on the 256 completion positions at most (logits_to_keep), not the 512 of
    # prompt ++ completion: bf16 logits of 6 sequences. A rollout step keeps the block's rows, to
    # the last block a recorded DPS step traces: every later block for scope all (256, as wd1's
    # one forward), the next one for block (16 steps a block, s 4), the block alone without DPS.
    assert est.rollout["rollout logits (one denoising step)"] == 6 * 256 * 126464 * 2
    for overrides, step_rows in ((["dps.scope=block"], 64), (["dps.enabled=false"], 32)):
        other = estimate(load_config(ROOT / "configs/paper/gsm8k.yaml", overrides))
        assert other.rollout["rollout logits (one denoising step)"] == 6 * step_rows * 126464 * 2
    assert est.update["logits of the largest stacked forward"] == 6 * 256 * 126464 * 2
    # LoRA's dropout copies of the projections' inputs and rank-r outputs: in the one layer that
    # gradient checkpointing recomputes, 6 hidden- and 1 MLP-sized inputs + 7 r per token.
    undropped = estimate(load_config(ROOT / "configs/paper/gsm8k.yaml", ["lora.dropout=0"]))
    (key,) = (k for k in est.update if k.startswith("activations"))
    assert est.update[key] - undropped.update[key] == pytest.approx(
        6 * 512 * 2 * (6 * 4096 + 12288)
    )
    full = estimate(load_config(ROOT / "configs/paper/gsm8k.yaml", ["sml.enabled=true"]))
    assert "SML views (K=4: activations + rows)" in full.update
    assert full.peak > est.peak


@pytest.mark.parametrize("scope", ["all", "block"])
def test_trace_estimate_matches_the_recorders_measured_peak(scope):
    torch.set_num_threads(1)
    V, B, L, T, bl, s = 32, 2, 32, 16, 8, 2
    ids = torch.randint(3, V, (B, 4), generator=torch.Generator().manual_seed(0))
    out = generate(
        random_mlm(vocab_size=V), ids, None, mask_id=1, gen_length=L, steps=T,
        block_length=bl, temperature=0.9, generator=torch.Generator().manual_seed(1),
        dps_stride=s, dps_scope=scope,
    )  # fmt: skip
    estimated = B * dps_trace_rows(L, T, bl, s, scope) * (V * 4 + 4)
    assert 0.8 < out.trace_peak_bytes / estimated < 1.5


def test_unknown_model_dry_run_still_succeeds(capsys):
    assert main(["train", "--dry-run", "model=nobody/no-such-model-xyz"]) == 0
    assert "memory estimate unavailable: unknown model" in capsys.readouterr().out


def test_run_name_and_published_settings_follow_the_overrides(capsys, monkeypatch):
    gsm8k = ROOT / "configs/paper/gsm8k.yaml"
    cfg = load_config(gsm8k, ["method=gdpo", "variant=daca"])
    assert cfg.name == "llada-gsm8k-gdpo-daca" and (cfg.learning_rate, cfg.beta) == (3e-7, 0.0)
    assert load_config(gsm8k, ["task=math500", "dps.enabled=false"]).name == (
        "llada-math500-wd1-base"
    )
    assert load_config(gsm8k, ["name=mine", "method=gdpo"]).name == "mine"
    # The command line wins over the published value, and the dry-run names the difference.
    cfg = load_config(gsm8k, ["method=gdpo", "learning_rate=1e-6"])
    assert cfg.learning_rate == 1e-6
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--config", str(gsm8k), "--dry-run", "method=gdpo", "beta=0.1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llada-gsm8k-gdpo-dps:")
    assert "differs from gdpo's published settings: beta=0.1 (published: 0.0)" in out
    # Without published_settings (the default), a recipe's values stay; the dry-run says so.
    cfg = load_config(None, ["method=gdpo"])
    assert cfg.name == "tiny-sudoku-gdpo-dps" and cfg.learning_rate == 3e-5
