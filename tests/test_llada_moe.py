"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B-Base / -Instruct) run natively on tiny hub-layout
checkpoints (tests/_hub_moe.py): logits against a plain-torch re-statement of its modeling code
(not the transformers classes daca builds on), left padding, the block KV cache, a LoRA and a
4-bit QLoRA step reaching the experts, save/reload in the hub layout, the mask id read off the
tokenizer, left-padded generation equal to each prompt alone, ``daca eval``, and the
one-line refusal of what daca does not run."""

import json

import pytest
import torch
from _hub import read_weights
from _hub_moe import write_llada_moe
from _oracle import config_of, rms, rope, swiglu, token_ids
from conftest import (
    assert_batch_generates_each_prompt_alone,
    assert_moe_tokenizer_ids_and_no_remote_code,
    assert_the_plan_counts_the_adapters_peft_builds,
    lora_adapted,
    lora_sgd_step,
    one_error_line,
)

from daca.cli import main
from daca.core.block_cache import BlockCache
from daca.core.modeling import forward_logits
from daca.core.sampler import generate
from daca.models import load, save_pretrained
from daca.models.families import model_shape

# Variants: plain (every layer MoE, untied), bias_dense (router bias, first layer dense),
# tied (a tied head).
VARIANTS = {
    "plain": {},
    "bias_dense": dict(expert_bias=True, moe_layer_freq=[0, 1]),
    "tied": dict(tied=True),
}
TOL = dict(atol=2e-5, rtol=2e-5)  # fp32, tiny widths


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {
        v: write_llada_moe(tmp_path_factory.mktemp(v), seed=2, **kw) for v, kw in VARIANTS.items()
    }


@pytest.fixture(scope="module")
def loaded(folders):
    torch.set_num_threads(1)
    return {v: load(str(folders[v])) for v in VARIANTS}


# ------------------------------------------------------------------ the oracle (plain torch)


def _moe(x, w, b, c):
    """softmax router (+ expert bias) -> top k, weights not renormalised -> weighted experts."""
    probs = torch.softmax(x @ w[b + "mlp.gate.weight"].T, -1)
    if c["moe_router_enable_expert_bias"]:
        probs = probs + w[b + "mlp.expert_bias"]
    top, idx = probs.topk(c["num_experts_per_tok"], -1)
    out = torch.zeros_like(x)
    for j in range(c["num_experts"]):
        weight = (top * (idx == j)).sum(-1, keepdim=True)  # 0 where j is not chosen
        out = out + weight * swiglu(x, w, f"{b}mlp.experts.{j}.")
    return out


def oracle_logits(w, c, ids, attention_mask=None):
    """LLaDA-MoE's forward as its modeling code computes it, positions from the first real
    token of each row, keys masked where ``attention_mask`` is 0."""
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    H, K, eps = c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
    D = c["hidden_size"] // H
    x = w["model.embed_tokens.weight"][ids]
    B, T, _ = x.shape
    bias = torch.zeros(B, 1, 1, T).masked_fill(mask[:, None, None, :] == 0, float("-inf"))
    for i, kind in enumerate(c["moe_layer_freq"]):
        b = f"model.layers.{i}."
        h = rms(x, w[b + "input_layernorm.weight"], eps)
        q, k, v = ((h @ w[f"{b}self_attn.{n}_proj.weight"].T).view(B, T, -1, D) for n in "qkv")
        q = rms(q, w[b + "self_attn.q_norm.weight"], eps).transpose(1, 2)
        k = rms(k, w[b + "self_attn.k_norm.weight"], eps).transpose(1, 2)
        v = v.transpose(1, 2)
        q, k = rope(q, positions, c["rope_theta"]), rope(k, positions, c["rope_theta"])
        k, v = k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / D**0.5 + bias, -1) @ v
        x = x + att.transpose(1, 2).reshape(B, T, H * D) @ w[b + "self_attn.o_proj.weight"].T
        h = rms(x, w[b + "post_attention_layernorm.weight"], eps)
        x = x + (_moe(h, w, b, c) if kind else swiglu(h, w, b + "mlp."))
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return rms(x, w["model.norm.weight"], eps) @ head.T


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_the_oracle(variant, folders, loaded):
    bundle = loaded[variant]
    assert type(bundle.model).__name__ == "LLaDAMoEForDiffusionLM" and bundle.family == "llada-moe"
    ids = token_ids((2, 9))
    with torch.no_grad():
        got = bundle.model(ids).logits
    want = oracle_logits(read_weights(folders[variant]), config_of(folders[variant]), ids)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("variant", VARIANTS)
def test_left_padded_logits_match_the_oracle_and_each_row_alone(variant, folders, loaded):
    model = loaded[variant].model
    pad = loaded[variant].pad_id
    rows = [token_ids((1, 5), 1)[0], token_ids((1, 8), 2)[0]]
    ids = torch.full((2, 8), pad)
    mask = torch.zeros(2, 8, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, 8 - len(row) :], mask[r, 8 - len(row) :] = row, 1
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        for r, row in enumerate(rows):
            alone = model(row[None]).logits[0]
            torch.testing.assert_close(batch[r, 8 - len(row) :], alone, **TOL)
    want = oracle_logits(read_weights(folders[variant]), config_of(folders[variant]), ids, mask)
    torch.testing.assert_close(batch[mask.bool()], want[mask.bool()], **TOL)


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_cached_block_step_equals_the_full_forward(mode, loaded):
    """The block KV cache is exact on LLaDA-MoE (its class takes transformers' caches)."""
    bundle = loaded["bias_dense"]
    model, mask_id = bundle.model, bundle.mask_id
    ids, attn = torch.full((2, 5), bundle.pad_id), torch.zeros(2, 5, dtype=torch.long)
    ids[0, 2:], attn[0, 2:] = token_ids((3,), 3), 1
    ids[1], attn[1] = token_ids((5,), 4), 1
    P, L, bl = 5, 8, 4
    x = torch.cat([ids, token_ids((2, L), 5)], 1)
    x[:, P + 3 :: 2] = mask_id
    attn = torch.cat([attn, torch.ones(2, L, dtype=torch.long)], 1)
    with torch.no_grad():
        full = model(x, attention_mask=attn).logits
        for c in range(L // bl):
            lo, hi = c * bl, (c + 1) * bl
            cache = BlockCache(model, mode, attn, P, P + L)
            torch.testing.assert_close(cache.refresh(x, lo, hi, L), full[:, P + lo :], **TOL)
            step = cache.block(x, lo, hi)
            torch.testing.assert_close(step, full[:, P + lo : P + hi], **TOL)


def test_batched_generation_with_the_dual_cache_refreshed_every_step_equals_none(loaded):
    bundle = loaded["plain"]
    ids, mask = torch.full((2, 6), bundle.pad_id), torch.zeros(2, 6, dtype=torch.long)
    ids[0, 2:], mask[0, 2:] = token_ids((4,), 6), 1
    ids[1], mask[1] = token_ids((6,), 7), 1
    kw = dict(mask_id=bundle.mask_id, gen_length=8, steps=4, block_length=4, temperature=0.8)
    runs = [
        generate(bundle.model, ids, mask, generator=torch.Generator().manual_seed(5), **kw, **c)
        for c in ({}, {"cache": "dual", "refresh_every": 1})
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[1].forwards == {"full": 4, "block": 0}


def test_a_lora_step_trains_attention_and_every_expert_it_routes_to(folders):
    """LoRA reaches q/k/v/o and each expert's gate/up/down projections (the router and norms
    stay frozen), and one step changes the logits."""
    bundle = load(str(folders["plain"]))
    model = lora_adapted(bundle)
    ids = token_ids((2, 16))
    with torch.no_grad():
        before = forward_logits(model.eval(), ids)
    hit = lora_sgd_step(model, ids)
    experts = {n for n in hit if ".mlp.experts." in n}
    assert {n.rsplit(".", 1)[-1] for n in hit} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert len(experts) == 2 * 4 * 3  # 32 tokens pick 2 of 4 experts a layer: all are hit
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in trainable)
    with torch.no_grad():
        assert (forward_logits(model.eval(), ids) - before).abs().max() > 1e-3


def test_a_4bit_qlora_step_quantises_the_experts_and_trains_them(folders, tmp_path):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from daca.models.loading import load_4bit
    from daca.models.quant import prepare_for_training

    # bitsandbytes packs 4-bit weights in blocks of 64: widths of 64.
    folder = write_llada_moe(tmp_path / "w64", hidden_size=64, expert_size=64, seed=4)
    bundle = load_4bit(str(folder), device="cpu", dtype=torch.float32)
    four_bit = [n for n, m in bundle.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 2 * (4 + 4 * 3)  # 2 layers x (q, k, v, o + 4 experts x 3)
    bundle.model = prepare_for_training(bundle.model)
    hit = lora_sgd_step(lora_adapted(bundle), token_ids((2, 16)))
    assert {n for n in hit if ".mlp.experts." in n} and {n for n in hit if "q_proj" in n}


def test_save_and_reload_keeps_logits_hub_keys_and_config(folders, loaded, tmp_path):
    bundle = loaded["bias_dense"]
    out = save_pretrained(bundle, tmp_path / "saved")
    assert set(read_weights(out)) == set(read_weights(folders["bias_dense"]))  # hub names
    saved, original = config_of(out), config_of(folders["bias_dense"])
    assert {k: saved[k] for k in original if k != "torch_dtype"} == {
        k: v for k, v in original.items() if k != "torch_dtype"
    }
    ids = token_ids((1, 7))
    with torch.no_grad():
        torch.testing.assert_close(load(str(out)).model(ids).logits, bundle.model(ids).logits)


def test_special_ids_are_read_off_the_checkpoint_and_its_code_never_runs(folders, loaded):
    assert_moe_tokenizer_ids_and_no_remote_code(folders["plain"], loaded["plain"])


def test_the_mask_id_is_read_from_the_checkpoint(tmp_path):
    """The tokenizer's <|mask|> moved off 156895 (the id dllm's code passes): followed."""
    bundle = load(str(write_llada_moe(tmp_path, seed=2, mask_token_id=156990, shards=1)))
    assert bundle.mask_id == 156990
    assert bundle.tokenizer.convert_ids_to_tokens(156990) == "<|mask|>"


def test_generation_on_a_left_padded_batch_equals_each_prompt_alone(loaded):
    """Routing is per token, so a row's tokens, experts and completion do not depend on the
    other rows or on the padding in front of it."""
    rows = [token_ids((4,), 11).tolist(), token_ids((7,), 12).tolist()]
    assert_batch_generates_each_prompt_alone(loaded["bias_dense"], rows)


def test_model_type_lladamoe_loads_as_llada_moe(folders, tmp_path):
    """dllm's README has users rewrite model_type to "lladamoe": the same family."""
    folder = write_llada_moe(tmp_path / "renamed", seed=2)
    config = config_of(folder) | {"model_type": "lladamoe"}
    (folder / "config.json").write_text(json.dumps(config))
    ids = token_ids((1, 6))
    with torch.no_grad():
        got = load(str(folder)).model(ids).logits
    torch.testing.assert_close(got, oracle_logits(read_weights(folder), config, ids), **TOL)


def test_daca_eval_runs_the_checkpoint(folders, tmp_path):
    out = tmp_path / "eval.jsonl"
    code = main(["eval", "--task", "sudoku", "--model", str(folders["plain"]), "--limit", "2",
                 "--device", "cpu", "--out", str(out)])  # fmt: skip
    assert code == 0 and len(out.read_text().splitlines()) == 2


def test_the_memory_plan_counts_active_and_total_parameters(folders):
    shape, _ = model_shape(str(folders["plain"]))
    c = config_of(folders["plain"])
    d, f, E, k = c["hidden_size"], c["expert_intermediate_size"], c["num_experts"], 2
    experts = 2 * E * 3 * d * f  # 2 layers
    assert shape.layers == 2 and shape.mlp == k * f
    assert shape.parameters - shape.active == experts * (E - k) // E
    assert len(shape.linears) == 2 * (4 + E * 3)


def test_the_memory_plan_counts_the_adapters_peft_builds(folders):
    """Attention and every expert (the family's targets); a routed expert's adapters see
    top k / experts of the tokens."""
    shape = assert_the_plan_counts_the_adapters_peft_builds(folders["plain"])
    E = config_of(folders["plain"])["num_experts"]
    assert {seen for _, seen in shape.adapted()} == {1.0, 2 / E}


@pytest.mark.parametrize(
    "change, said",
    [
        ({"shared_expert_intermediate_size": 32}, "shared_expert_intermediate_size=32"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"qk_layernorm": False}, "qk_layernorm=False"),
        ({"moe_layer_freq": [1]}, "moe_layer_freq"),
        ({"model_type": "Dream", "num_experts": 4}, "mixture of experts"),  # MoE, dense family
    ],
)
def test_what_daca_does_not_run_is_one_line_before_any_weight_loads(change, said, tmp_path, capsys):
    folder = write_llada_moe(tmp_path / "m", seed=2)
    (folder / "config.json").write_text(json.dumps(config_of(folder) | change))
    for shard in folder.glob("*.safetensors"):
        shard.write_bytes(b"not weights: reading them would fail otherwise")
    code = main(["eval", "--task", "sudoku", "--model", str(folder), "--limit", "2",
                 "--device", "cpu", "--out", str(tmp_path / "e.jsonl")])  # fmt: skip
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and said in line and "llada-moe" in line
