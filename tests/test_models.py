"""Other masked LMs through ``daca.models`` (LLaDA and Dream: tests/test_native_families.py).

- a transformers-native masked LM saved to a folder and loaded by path;
- a model that ignores the attention mask: detected on load and run in length buckets;
- gradient checkpointing, model shapes for the memory estimate;
- the 4-bit path: its error without a GPU and its BitsAndBytesConfig wiring.
"""

import copy
import importlib.util
import json
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import random_mlm
from transformers import ModernBertForMaskedLM

from daca.core.likelihood import mean_field_logp
from daca.core.modeling import forward_logits
from daca.core.sampler import generate
from daca.models.families import (
    enable_gradient_checkpointing,
    model_shape,
    shape_from_config,
)
from daca.models.loading import LoadedModel, load
from daca.models.padding import (
    adapt,
    bucketed_forward,
    forward_adapters,
    install_forward_adapter,
    left_padding_changes_logits,
)
from daca.models.tiny import build_model, build_tokenizer, tiny_config

PAD, MASK = 0, 1


@pytest.fixture(autouse=True)
def _one_thread():
    # Models this small gain nothing from a second thread, and on a shared, loaded CPU the
    # threads' synchronisation makes each forward ~100x slower.
    torch.set_num_threads(1)


def context_mlm(seed=0):
    """A random ModernBERT whose logits depend on the context (larger initial weights than the
    default 0.02, with which a random model barely looks at other tokens)."""
    cfg = tiny_config(32, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    cfg.initializer_range = 0.2
    return build_model(cfg, seed=seed)


class IgnoresMask(torch.nn.Module):
    """A masked LM whose forward drops ``attention_mask``, like older LLaDA copies."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None):
        return self.inner(input_ids)


def left_padded(rows, pad=PAD):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = torch.tensor(r)
        mask[b, width - len(r) :] = 1
    return ids, mask


ROWS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 5, 9, 7, 6], [4]]
GEN = dict(mask_id=MASK, gen_length=8, steps=4, block_length=4, temperature=0.0)


def bundle_of(model, family="mlm"):
    return LoadedModel(model, None, MASK, family, eos_ids=(2,), pad_id=PAD)


# ----------------------------------------------------------------------------- native MLM folder
def save_mlm(path, model):
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def test_native_masked_lm_loads_by_path_unchanged(tmp_path):
    model = context_mlm()
    save_mlm(tmp_path, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # it respects the mask: no padding warning
        bundle = load(str(tmp_path))
    tok = build_tokenizer()
    assert (bundle.family, bundle.mask_id, bundle.pad_id) == ("mlm", tok.mask_token_id, PAD)
    assert bundle.eos_ids == (tok.eos_token_id,) and not bundle.ignores_attention_mask
    assert forward_adapters(bundle.model) == []
    ids, mask = left_padded(ROWS)
    torch.testing.assert_close(
        forward_logits(bundle.model, ids, mask), forward_logits(model, ids, mask)
    )


def test_ignored_attention_mask_is_detected_on_load_and_bucketed(tmp_path, monkeypatch):
    save_mlm(tmp_path, context_mlm())
    ids, mask = left_padded(ROWS)
    want = forward_logits(load(str(tmp_path)).model, ids, mask)  # respects the mask
    original = ModernBertForMaskedLM.forward

    def forward_without_mask(self, input_ids=None, attention_mask=None, **kw):
        return original(self, input_ids=input_ids, **kw)

    monkeypatch.setattr(ModernBertForMaskedLM, "forward", forward_without_mask)
    with pytest.warns(UserWarning, match="left padding changes this model's logits"):
        bundle = load(str(tmp_path))
    assert bundle.ignores_attention_mask
    assert forward_adapters(bundle.model) == ["bucketed_forward"]
    # Bucketed, the mask-ignoring model gives what the mask-respecting one gave.
    got = forward_logits(bundle.model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)
    assert torch.all(got[~real] == 0)


# ----------------------------------------------------------------------------- bucketing
def test_padding_detection_tells_the_two_apart():
    model = context_mlm()
    probe = [5, 6, 7, 8, 9, 10, MASK, MASK]
    assert not left_padding_changes_logits(model, probe, PAD)
    assert left_padding_changes_logits(IgnoresMask(model), probe, PAD)


def test_bucketed_generation_equals_per_row_generation():
    ignoring = IgnoresMask(context_mlm())
    ids, mask = left_padded(ROWS)
    gen = dict(GEN, dps_stride=1)
    # Unadapted, the padding leaks into the logits of the shorter prompts.
    per_row_logits = forward_logits(ignoring, torch.tensor([ROWS[0]]))
    leaked = forward_logits(ignoring, ids, mask)[0, ids.shape[1] - len(ROWS[0]) :]
    assert not torch.allclose(leaked, per_row_logits[0], atol=1e-3)

    with pytest.warns(UserWarning, match="separate batches"):
        bundle = adapt(bundle_of(ignoring))
    assert bundle.ignores_attention_mask
    out = generate(bundle.model, ids, mask, **gen)
    for b, row in enumerate(ROWS):
        alone = generate(bundle.model, torch.tensor([row]), None, **gen)
        assert torch.equal(out.completion_ids[b], alone.completion_ids[0])
        assert torch.equal(out.birth_step[b], alone.birth_step[0])
        torch.testing.assert_close(out.progress_logp[b], alone.progress_logp[0])


def test_bucketed_likelihood_and_gradients_equal_per_row():
    ignoring = IgnoresMask(context_mlm())
    assert install_forward_adapter(ignoring, bucketed_forward)
    assert not install_forward_adapter(ignoring, bucketed_forward)  # idempotent
    ids, mask = left_padded(ROWS)
    completion = torch.randint(3, 20, (len(ROWS), 6), generator=torch.Generator().manual_seed(0))
    lp = mean_field_logp(ignoring, ids, completion, mask_id=MASK, attention_mask=mask)
    lp.sum().backward()
    batched = [p.grad.clone() for p in ignoring.parameters()]
    ignoring.zero_grad()
    total = 0
    for b, row in enumerate(ROWS):
        alone = mean_field_logp(ignoring, torch.tensor([row]), completion[b : b + 1], mask_id=MASK)
        torch.testing.assert_close(lp[b], alone[0], atol=1e-5, rtol=1e-5)
        total = total + alone.sum()
    total.backward()
    for g, p in zip(batched, ignoring.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)


def test_bucketed_forward_only_removes_left_padding():
    model = random_mlm()
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="left padding only"):
        bucketed_forward(model, ids, attention_mask=torch.tensor([[1, 1, 0, 1]]))


def test_bucketed_forward_keeps_the_positions_asked_for():
    """``logits_to_keep`` through the bucketed forward: k the last k rows of the full result,
    a tensor those positions, where they reach into a short row's padding too."""

    def inner(input_ids, logits_to_keep=0, **kwargs):  # a head that keeps as transformers' does
        logits = F.one_hot(input_ids, 30).float().cumsum(1)
        if isinstance(logits_to_keep, torch.Tensor):
            return logits[:, logits_to_keep]
        return logits[:, -logits_to_keep:] if logits_to_keep else logits

    ids, mask = left_padded(ROWS)
    full = bucketed_forward(inner, ids, mask).logits
    assert full.shape[1] == ids.shape[1] and len(set(mask.sum(1).tolist())) > 1
    for keep in (2, int(mask.sum(1).min()) + 1, ids.shape[1], ids.shape[1] + 3):
        got = bucketed_forward(inner, ids, mask, logits_to_keep=keep).logits
        assert torch.equal(got, full[:, -keep:])
    for a, b in ((1, 4), (0, 4), (3, 5), (4, 5)):  # pads 2, 0, 0, 4: windows across them
        positions = torch.arange(a, b)
        got = bucketed_forward(inner, ids, mask, logits_to_keep=positions).logits
        assert torch.equal(got, full[:, a:b])


def test_adapted_model_deep_copies_to_its_own_forward():
    model = IgnoresMask(context_mlm())
    install_forward_adapter(model, bucketed_forward)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    ids, mask = left_padded(ROWS[:2])
    assert forward_adapters(twin) == ["bucketed_forward"]
    assert not torch.allclose(forward_logits(twin, ids, mask), forward_logits(model, ids, mask))


def test_native_gradient_checkpointing_keeps_gradients():
    ids, mask = left_padded(ROWS)
    completion = torch.tensor([[5, 6]] * len(ROWS))
    grads = []
    for checkpointed in (False, True):
        model = context_mlm().train()
        if checkpointed:
            enable_gradient_checkpointing(model)
            assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        mean_field_logp(model, ids, completion, mask_id=MASK, attention_mask=mask).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_shape_of_a_local_llada_copy_is_read_from_its_config(tmp_path):
    llada_config = {
        "model_type": "llada", "d_model": 4096, "n_layers": 32, "n_heads": 32,
        "n_kv_heads": 32, "mlp_hidden_size": 12288, "vocab_size": 126464,
        "embedding_size": 126464, "weight_tying": False,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(llada_config))
    shape, source = model_shape(str(tmp_path))
    assert source == "config.json"
    assert model_shape("GSAI-ML/LLaDA-8B-Instruct") == (shape, "built-in config.json")
    # 32 layers of q, k, v, o (4096²), three 4096 x 12288 MLP matrices and two RMSNorm weights,
    # the final norm, an untied 126464-row embedding and head; a rank-128 adapter on all seven
    # projections: 128 (4·8192 + 3·16384) per layer.
    assert shape.linears == (
        (4096, 4096), (4096, 4096), (4096, 4096), (4096, 4096),
        (4096, 12288), (4096, 12288), (12288, 4096),
    ) * 32  # fmt: skip
    assert (shape.hidden, shape.layers, shape.vocab, shape.mlp) == (4096, 32, 126464, 12288)
    linear = 32 * (4 * 4096**2 + 3 * 4096 * 12288)
    assert shape.linear_parameters == linear
    assert shape.parameters == linear + 32 * 2 * 4096 + 4096 + 2 * 126464 * 4096
    assert shape.parameters == 8_015_581_184
    assert shape.lora_parameters(128) == 32 * 128 * (4 * 8192 + 3 * 16384) == 335_544_320
    with pytest.raises(LookupError, match="unknown model"):
        model_shape("nobody/no-such-model-xyz")


def test_dream_7b_shape_from_its_built_in_config():
    shape, source = model_shape("Dream-org/Dream-v0-Instruct-7B")
    assert source == "built-in config.json"
    # Qwen2: q, o 3584²; k, v 3584 x 512 (4 KV heads of 128); q/k/v biases; 28 layers.
    per_layer = 2 * 3584**2 + 2 * 3584 * 512 + 3 * 3584 * 18944
    biases_norms = 3584 + 2 * 512 + 2 * 3584
    assert shape.linear_parameters == 28 * per_layer
    assert shape.parameters == 28 * (per_layer + biases_norms) + 3584 + 2 * 152064 * 3584
    assert shape.parameters == 7_615_616_512  # Qwen2.5-7B's published 7.61 B


@pytest.mark.parametrize("tied", [False, True])
def test_shape_read_off_the_meta_module_equals_a_hand_count(tied):
    d, layers, heads, mlp, vocab = 8, 2, 4, 12, 20
    llada = {
        "model_type": "llada", "d_model": d, "n_layers": layers, "n_heads": heads,
        "n_kv_heads": heads, "mlp_hidden_size": mlp, "embedding_size": vocab,
        "vocab_size": vocab, "weight_tying": tied,
    }  # fmt: skip
    dream = {
        "model_type": "Dream", "hidden_size": d, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": 2, "intermediate_size": mlp,
        "vocab_size": vocab, "tie_word_embeddings": tied,
    }  # fmt: skip
    head = 1 if tied else 2  # embedding, and the output head unless it is the embedding
    # LLaDA: q, k, v, o of 8 x 8, gate/up 8 x 12, down 12 x 8, two norms a layer, a final norm.
    got = shape_from_config(llada)
    assert got.linears == (((8, 8),) * 4 + ((8, 12), (8, 12), (12, 8))) * layers
    assert got.parameters == layers * (4 * 64 + 3 * 96 + 2 * d) + d + head * vocab * d
    assert got.lora_parameters(2) == layers * 2 * (4 * 16 + 3 * 20)
    assert (got.hidden, got.layers, got.vocab, got.mlp) == (d, layers, vocab, mlp)
    # Dream: 2 KV heads of size 2, so k and v are 8 x 4 with biases (q too: 8 + 4 + 4).
    got = shape_from_config(dream)
    assert got.linears == (((8, 8), (8, 4), (8, 4), (8, 8)) + ((8, 12), (8, 12), (12, 8))) * 2
    per_layer = 2 * 64 + 2 * 32 + 3 * 96 + (8 + 4 + 4) + 2 * d
    assert got.parameters == layers * per_layer + d + head * vocab * d
    assert got.other_parameters == got.parameters - layers * (2 * 64 + 2 * 32 + 3 * 96)
    # LLaDA and Dream run their head on the completion's rows alone; a masked LM on every row.
    bert = {
        "model_type": "modernbert", "hidden_size": d, "num_hidden_layers": layers,
        "num_attention_heads": heads, "intermediate_size": mlp, "vocab_size": vocab,
        "pad_token_id": 0,
    }  # fmt: skip
    assert shape_from_config(llada).head_on_completion and got.head_on_completion
    assert not shape_from_config(bert).head_on_completion


@pytest.mark.parametrize(
    "name",
    [
        "Dream-org/Dream-Coder-v0-Instruct-7B",
        "apple/DiffuCoder-7B-Instruct",
        "apple/DiffuCoder-7B-cpGRPO",
    ],
)
def test_dream_coder_and_diffucoder_have_dream_7b_s_built_in_shape(name):
    """Both are Dream's architecture at Qwen2.5-7B's widths (Dream-Coder from Qwen2.5-Coder-7B,
    which has Qwen2.5-7B's shape): a dry run of their hub names downloads nothing."""
    shape, source = model_shape(name)
    assert source == "built-in config.json"
    assert shape == model_shape("Dream-org/Dream-v0-Instruct-7B")[0]


def test_tiny_a2d_shapes_from_their_built_in_configs():
    """dllm-hub's A2D Qwen3-0.6B and Qwen2.5-Coder-0.5B: the AR models' published sizes
    (Qwen3-0.6B: 0.44 B without the tied embedding)."""
    shape, source = model_shape("dllm-hub/Qwen3-0.6B-diffusion-mdlm-v0.1")
    assert source == "built-in config.json"
    # q 1024 -> 16 x 128, k/v 1024 -> 8 x 128, o back; per-head q/k norms of 128; 28 layers.
    attention = 1024 * 2048 * 2 + 1024 * 1024 * 2
    per_layer = attention + 3 * 1024 * 3072 + 2 * 128 + 2 * 1024
    assert shape.parameters == 28 * per_layer + 1024 + 151936 * 1024 == 596_049_920
    shape, _ = model_shape("dllm-hub/Qwen2.5-Coder-0.5B-Instruct-diffusion-mdlm-v0.1")
    # Qwen2: q/o 896², k/v 896 x 128 (2 KV heads of 64), q/k/v biases; 24 layers.
    per_layer = 2 * 896**2 + 2 * 896 * 128 + (896 + 2 * 128) + 3 * 896 * 4864 + 2 * 896
    assert shape.parameters == 24 * per_layer + 896 + 151936 * 896 == 494_032_768


def test_llada2_mini_and_llada_moe_shapes_from_their_built_in_configs():
    """inclusionAI/LLaDA2.0-mini (the card's 16 B, 1.4 B active) and LLaDA-MoE-7B-A1B (7 B),
    counted by hand from their config fields."""
    shape, source = model_shape("inclusionAI/LLaDA2.0-mini")
    assert source == "built-in config.json" and shape.block_causal
    embeddings = 2 * 157184 * 2048  # untied
    # Fused q/k/v (16 + 2 * 4 heads of 128), dense 2048², q/k norms of 128, two layer norms.
    attention = 2048 * 3072 + 2048**2 + 2 * 128 + 2 * 2048
    dense_mlp = 3 * 2048 * 5120  # layer 0 (first_k_dense_replace 1)
    experts, shared, router = 256 * 3 * 2048 * 512, 3 * 2048 * 512, 256 * 2048
    total = embeddings + 20 * attention + dense_mlp + 19 * (experts + shared + router) + 2048
    assert shape.parameters == total == 16_255_638_528
    assert shape.active == total - 19 * experts * (256 - 8) // 256 == 1_432_968_192
    assert shape.expert_share == 8 / 256
    # The recipe's LoRA (attention, layer 0's MLP, the shared experts) at r 128.
    recipe = ["query_key_value", "dense", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    recipe += [f"shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    lora = 20 * (2048 + 3072 + 2 * 2048) + 3 * (2048 + 5120) + 19 * 3 * (2048 + 512)
    assert shape.lora_parameters(128, recipe) == 128 * lora == 45_023_232

    shape, source = model_shape("inclusionAI/LLaDA-MoE-7B-A1B-Instruct")
    assert source == "built-in config.json" and not shape.block_causal
    # 16 layers: q/k/v/o 2048², q/k norms of 128, two norms, a router and 64 experts of 1024.
    experts = 64 * 3 * 2048 * 1024
    per_layer = 4 * 2048**2 + 2 * 128 + 2 * 2048 + 64 * 2048 + experts
    assert shape.parameters == embeddings + 16 * per_layer + 2048 == 7_356_880_896
    assert shape.active == shape.parameters - 16 * experts * 56 // 64 == 1_719_736_320


def test_a2d_qwen3_shape_read_off_the_meta_module_equals_a_hand_count():
    """A2D Qwen3: an explicit head width (q: 8 -> 4 heads of 6 = 24), per-head q/k norms of 6,
    no biases, a tied head."""
    d, layers, mlp, vocab = 8, 2, 12, 20
    a2d = {
        "model_type": "a2d-qwen3", "hidden_size": d, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6,
        "intermediate_size": mlp, "vocab_size": vocab, "tie_word_embeddings": True,
    }  # fmt: skip
    got = shape_from_config(a2d)
    attention = ((8, 24), (8, 12), (8, 12), (24, 8))
    assert got.linears == (attention + ((8, 12), (8, 12), (12, 8))) * layers
    per_layer = 8 * 24 * 2 + 8 * 12 * 2 + 3 * 8 * 12 + 2 * 6 + 2 * d
    assert got.parameters == layers * per_layer + d + vocab * d
    assert got.head_on_completion  # transformers' Qwen3ForCausalLM takes logits_to_keep


# ----------------------------------------------------------------------------- 4-bit
def test_4bit_error_names_what_is_missing(monkeypatch):
    """The error is kept only where bitsandbytes is missing or has no backend for the device."""
    from daca.models import loading, quant

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "bitsandbytes" else real_find_spec(name, *a),
    )
    with pytest.raises(RuntimeError, match="pip install bitsandbytes"):
        loading.load_4bit("GSAI-ML/LLaDA-8B-Instruct", device="cpu")
    monkeypatch.setattr(importlib.util, "find_spec", real_find_spec)
    pytest.importorskip("bitsandbytes")
    quant.check_4bit_support("cpu")  # bitsandbytes >= 0.50 runs NF4 on the CPU
    import bitsandbytes.functional

    def no_kernel(*args, **kwargs):
        raise NotImplementedError("no kernel registered for this device")

    monkeypatch.setattr(bitsandbytes.functional, "quantize_4bit", no_kernel)
    with pytest.raises(RuntimeError, match="has no 4-bit NF4 backend for device cpu"):
        loading.load_4bit("GSAI-ML/LLaDA-8B-Instruct", device="cpu")


def test_4bit_config_wiring(monkeypatch):
    from daca.models import loading, quant

    calls = {}
    monkeypatch.setattr(quant, "check_4bit_support", lambda device: None)
    monkeypatch.setattr(quant, "keep_training_layout", lambda model: None)
    loaded = types.SimpleNamespace(model=None)
    monkeypatch.setattr(loading, "load", lambda name, **kw: calls.update(name=name, **kw) or loaded)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    loading.load_4bit("some/model", device="cuda:1")
    q = calls["quantization_config"]
    assert (calls["name"], calls["device"], calls["dtype"]) == (
        "some/model",
        "cuda:1",
        torch.bfloat16,
    )
    assert q.load_in_4bit and not q.load_in_8bit
    assert (q.bnb_4bit_quant_type, q.bnb_4bit_use_double_quant) == ("nf4", True)
    assert q.bnb_4bit_compute_dtype == torch.bfloat16 and q.bnb_4bit_quant_storage == torch.uint8
    loading.load_4bit("some/model", device="cpu", dtype=torch.float32)  # fp32 compute on a CPU
    assert calls["quantization_config"].bnb_4bit_compute_dtype == torch.float32
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # FSDP shards bf16-stored 4-bit weights
    assert quant.bnb_config().bnb_4bit_quant_storage == torch.bfloat16
