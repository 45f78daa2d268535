"""Model families through ``daca.models``: stand-ins for LLaDA, Dream and native masked LMs.

- a transformers-native masked LM saved to a folder and loaded by path;
- a remote-code "LLaDA" written here (model_type llada, trust_remote_code) with the known
  problems of LLaDA's code under transformers 5: a config without ``use_cache``, a
  gradient-checkpointing hook written for transformers 4, and an ignored attention mask;
- a fake Dream (4-D boolean mask in, logits shifted right by one);
- the 4-bit path: its error without a GPU and its BitsAndBytesConfig wiring.
"""

import copy
import importlib.util
import json
import warnings

import pytest
import torch
from conftest import random_mlm
from transformers import ModernBertForMaskedLM
from transformers.modeling_outputs import MaskedLMOutput

from daca.likelihood import mean_field_logp
from daca.modeling import forward_logits
from daca.models.families import (
    LLADA_8B,
    enable_gradient_checkpointing,
    lora_targets,
    model_shape,
    shape_from_config,
)
from daca.models.loading import (
    LoadedModel,
    adapt,
    bucketed_forward,
    forward_adapters,
    install_forward_adapter,
    left_padding_changes_logits,
    load,
)
from daca.models.tiny import build_model, build_tokenizer, tiny_config
from daca.sampler import generate

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


# ----------------------------------------------------------------------------- Dream
class FakeDream(torch.nn.Module):
    """Dream's interface on a masked LM: 4-D boolean mask and position ids in, logits shifted
    right by one out (``logits[:, i]`` predicts token i + 1)."""

    def __init__(self, base):
        super().__init__()
        self.base, self.seen = base, {}

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        if attention_mask is not None:
            assert attention_mask.dtype == torch.bool and attention_mask.dim() == 4
            self.seen = {"mask": attention_mask, "pos": position_ids}
            attention_mask = attention_mask[:, 0, 0, :].long()
        logits = self.base(input_ids, attention_mask=attention_mask).logits
        return MaskedLMOutput(logits=torch.cat([logits[:, 1:], logits[:, -1:]], dim=1))


def test_dream_adapter_unshifts_logits_and_passes_dream_masks():
    base = context_mlm()
    dream = FakeDream(base)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        adapt(bundle_of(dream, family="dream"))
        adapt(bundle_of(dream, family="dream"))
    assert forward_adapters(dream) == ["dream_forward"]
    ids, mask = left_padded(ROWS)
    got = forward_logits(dream, ids, mask)
    torch.testing.assert_close(got[:, 1:], forward_logits(base, ids, mask)[:, 1:])
    real = mask.bool()
    assert torch.equal(dream.seen["mask"], real[:, None, None, :].expand(-1, 1, 5, -1))
    assert dream.seen["pos"].tolist()[0] == [0, 0, 0, 1, 2]  # real tokens count from 0
    out = generate(dream, ids, mask, **GEN, dps_stride=2)
    ref = generate(base, ids, mask, **GEN, dps_stride=2)
    assert torch.equal(out.completion_ids, ref.completion_ids)
    torch.testing.assert_close(out.progress_logp, ref.progress_logp)


# ----------------------------------------------------------------------------- LLaDA
FAKE_LLADA = '''
"""A LLaDA stand-in with the known problems of LLaDA's remote code under transformers 5."""
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class FakeLLaDAConfig(PretrainedConfig):
    model_type = "llada"

    def __init__(self, d_model=16, n_layers=2, n_heads=2, mlp_hidden_size=32,
                 vocab_size=126464, weight_tying=False, **kwargs):
        kwargs.pop("use_cache", None)  # transformers 5 drops it: the config has no use_cache
        super().__init__(**kwargs)
        self.d_model, self.n_layers, self.n_heads = d_model, n_layers, n_heads
        self.mlp_hidden_size, self.vocab_size, self.weight_tying = (
            mlp_hidden_size, vocab_size, weight_tying)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, f = c.d_model, c.mlp_hidden_size
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v_proj, self.attn_out = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.ff_proj, self.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.ff_out = nn.Linear(f, d, bias=False)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        att = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, -1) @ v  # no mask
        x = x + self.attn_out(att)
        return x + self.ff_out(nn.functional.silu(self.ff_proj(x)) * self.up_proj(x))


class Core(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab_size, c.d_model),
            blocks=nn.ModuleList(Block(c) for _ in range(c.n_layers)),
            ff_out=nn.Linear(c.d_model, c.vocab_size, bias=False),
        ))
        self.strategy = None

    def set_activation_checkpointing(self, strategy):
        self.strategy = strategy

    def forward(self, input_ids):
        x = self.transformer.wte(input_ids)
        for block in self.transformer.blocks:
            if self.strategy == "whole_layer" and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.transformer.ff_out(x)


class FakeLLaDAModelLM(PreTrainedModel):
    config_class = FakeLLaDAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True

    def __init__(self, config):
        super().__init__(config)
        self.model = Core(config)

    def _init_weights(self, module):
        pass  # keep torch's default initialisation (context-sensitive at this size)

    def _set_gradient_checkpointing(self, enable=True, gradient_checkpointing_func=None):
        self.model.set_activation_checkpointing("whole_layer" if enable else None)

    def forward(self, input_ids, attention_mask=None, use_cache=None, **kwargs):
        if use_cache is None:
            use_cache = self.config.use_cache  # AttributeError without the loader's fix
        return CausalLMOutputWithPast(logits=self.model(input_ids))
'''


@pytest.fixture(scope="module")
def fake_llada_dir(tmp_path_factory):
    from transformers import AutoConfig, AutoModel

    path = tmp_path_factory.mktemp("fake-llada")
    (path / "modeling_fakellada.py").write_text(FAKE_LLADA)
    auto_map = {
        "AutoConfig": "modeling_fakellada.FakeLLaDAConfig",
        "AutoModel": "modeling_fakellada.FakeLLaDAModelLM",
    }
    (path / "config.json").write_text(json.dumps({"model_type": "llada", "auto_map": auto_map}))
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModel.from_config(config, trust_remote_code=True)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def test_llada_loads_with_its_ids_use_cache_and_bucketing(fake_llada_dir):
    with pytest.warns(UserWarning, match="ignores attention_mask"):
        bundle = load(str(fake_llada_dir))
    assert bundle.family == "llada"
    assert (bundle.mask_id, bundle.eos_ids, bundle.pad_id) == (126336, (126081, 126348), 126081)
    assert bundle.model.config.use_cache is False
    assert bundle.ignores_attention_mask
    ids, mask = left_padded([[5, 6, 7], [8, 9, 10, 11]], pad=bundle.pad_id)
    got = forward_logits(bundle.model, ids, mask)
    alone = forward_logits(bundle.model, ids[:1, 1:])
    torch.testing.assert_close(got[0, 1:], alone[0], atol=1e-5, rtol=1e-5)


def test_llada_gradient_checkpointing_and_lora_targets(fake_llada_dir):
    from peft import LoraConfig, get_peft_model

    with pytest.warns(UserWarning):
        bundle = load(str(fake_llada_dir))
    model = bundle.model
    # transformers 5 passes every_n_layers, which the transformers-4 hook does not take.
    with pytest.raises(TypeError, match="every_n_layers"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    enable_gradient_checkpointing(model)
    assert model.model.strategy == "whole_layer"

    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=lora_targets(bundle)))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in peft.named_parameters() if ".lora_A" in n}
    names = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")
    want = {f"base_model.model.model.transformer.blocks.{i}.{n}" for i in range(2) for n in names}
    assert adapted == want  # every projection of every block, never the output head ff_out
    peft.train()
    ids, mask = left_padded([[5, 6, 7], [8, 9, 10, 11]], pad=bundle.pad_id)
    completion = torch.tensor([[5, 6], [7, 8]])
    lp = mean_field_logp(peft, ids, completion, mask_id=bundle.mask_id, attention_mask=mask)
    lp.sum().backward()
    grads = [p.grad for n, p in peft.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    with peft.disable_adapter():  # the reference policy: the adapter-disabled base
        ref = mean_field_logp(peft, ids, completion, mask_id=bundle.mask_id, attention_mask=mask)
    torch.testing.assert_close(ref, lp.detach())  # lora_B starts at zero


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
    assert shape_from_config(llada_config) == LLADA_8B
    (tmp_path / "config.json").write_text(json.dumps(llada_config))
    assert model_shape(str(tmp_path)) == (LLADA_8B, "config.json")
    assert model_shape("GSAI-ML/LLaDA-8B-Instruct") == (LLADA_8B, "built-in table")
    # 32 layers of q, k, v, o (4096²) and three 4096 x 12288 MLP matrices, untied 126464-row
    # embedding and head; a rank-128 adapter on all seven: 128 (4·8192 + 3·16384) per layer.
    assert LLADA_8B.parameters == 32 * (4 * 4096**2 + 3 * 4096 * 12288) + 2 * 126464 * 4096
    assert LLADA_8B.parameters == 8_015_314_944
    assert LLADA_8B.lora_parameters(128) == 32 * 128 * (4 * 8192 + 3 * 16384) == 335_544_320
    with pytest.raises(LookupError, match="unknown model"):
        model_shape("nobody/no-such-model-xyz")


# ----------------------------------------------------------------------------- 4-bit
def test_4bit_without_gpu_says_a_gpu_is_needed(monkeypatch):
    from daca.models import quant

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        quant.load_4bit("GSAI-ML/LLaDA-8B-Instruct", device="cpu")


def test_4bit_config_wiring(monkeypatch):
    from daca.models import quant

    calls = {}
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "bitsandbytes" else real_find_spec(name, *a),
    )
    monkeypatch.setattr(quant, "load", lambda name, **kw: calls.update(name=name, **kw) or "ok")
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert quant.load_4bit("some/model", device="cuda:1") == "ok"
    q = calls["quantization_config"]
    assert (calls["name"], calls["device"], calls["dtype"]) == (
        "some/model",
        "cuda:1",
        torch.bfloat16,
    )
    assert q.load_in_4bit and not q.load_in_8bit
    assert (q.bnb_4bit_quant_type, q.bnb_4bit_use_double_quant) == ("nf4", True)
    assert q.bnb_4bit_compute_dtype == torch.bfloat16 and q.bnb_4bit_quant_storage == torch.uint8
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # FSDP shards bf16-stored 4-bit weights
    assert quant.bnb_config().bnb_4bit_quant_storage == torch.bfloat16
    # Without bitsandbytes on a GPU machine, the error names the package.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RuntimeError, match="pip install bitsandbytes"):
        quant.load_4bit("some/model", device="cuda")
