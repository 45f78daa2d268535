"""LLaDA and Dream through ``daca.models.load`` on checkpoints shaped like the hub's (``_hub``).

The reference is an oracle written here from the architectures' published descriptions, in
plain torch, reading the weights under the hub's key names straight from the safetensors
files — not transformers' Llama/Qwen2 classes the loader builds on, nor the families' remote
code:

- LLaDA-8B: token embedding; per block x += Attn(RMSNorm(x)), x += SwiGLU(RMSNorm(x)); final
  RMSNorm; untied linear head. RMSNorm normalises in float32, then scales by its weight.
  Attention: multi-head, rotate-half RoPE (θ = ``rope_theta``) on queries and keys, softmax
  over all real keys (no causal mask), no biases. SwiGLU: down(silu(gate(x)) * up(x)).
- Dream-7B: the same with Qwen2's names, biases on q/k/v, grouped key/value heads, θ = 1e6;
  its logits at i predict token i + 1, so the core's logits are Dream's shifted right by one
  (``logits[:, 0]`` repeats Dream's row 0).

With left padding, positions count from a row's first real token and padding is masked as a
key, so a padded row's real positions have the logits of the row run alone.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from _hub import (
    DREAM_SPECIALS,
    LLADA_SPECIALS,
    imported_python,
    read_weights,
    write_dream,
    write_llada,
)

from daca.core.modeling import forward_logits
from daca.core.sampler import generate
from daca.models import load

FAMILIES = ("llada", "dream")
WRITERS = {"llada": write_llada, "dream": write_dream}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {f: WRITERS[f](tmp_path_factory.mktemp(f"hub-{f}"), seed=1) for f in FAMILIES}


@pytest.fixture(scope="module")
def loaded(folders):
    torch.set_num_threads(1)
    return {f: load(str(folders[f])) for f in FAMILIES}


def config_of(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


# ------------------------------------------------------------------------------ the oracle
@dataclass
class Arch:
    """What the oracle needs of a family: sizes from config.json and the hub's key names."""

    family: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    eps: float
    theta: float

    @classmethod
    def of(cls, config: dict) -> Arch:
        if config["model_type"] == "llada":
            return cls(
                "llada",
                config["n_layers"],
                config["n_heads"],
                config["n_kv_heads"],
                config["rms_norm_eps"],
                config["rope_theta"],
            )
        return cls(
            "dream",
            config["num_hidden_layers"],
            config["num_attention_heads"],
            config["num_key_value_heads"],
            config["rms_norm_eps"],
            config["rope_theta"],
        )

    def embedding(self, w):
        return w[
            "model.transformer.wte.weight"
            if self.family == "llada"
            else "model.embed_tokens.weight"
        ]

    def final(self, w):
        """(final norm weight, head weight)."""
        if self.family == "llada":
            return w["model.transformer.ln_f.weight"], w["model.transformer.ff_out.weight"]
        return w["model.norm.weight"], w["lm_head.weight"]

    def block(self, w, i: int) -> dict:
        """Block i's tensors; q/k/v biases are None where the family has none."""
        if self.family == "llada":
            b = f"model.transformer.blocks.{i}."
            return {
                "attn_norm": w[b + "attn_norm.weight"],
                "ff_norm": w[b + "ff_norm.weight"],
                "q": w[b + "q_proj.weight"],
                "k": w[b + "k_proj.weight"],
                "v": w[b + "v_proj.weight"],
                "o": w[b + "attn_out.weight"],
                "q_bias": None,
                "k_bias": None,
                "v_bias": None,
                "gate": w[b + "ff_proj.weight"],
                "up": w[b + "up_proj.weight"],
                "down": w[b + "ff_out.weight"],
            }
        b = f"model.layers.{i}."
        return {
            "attn_norm": w[b + "input_layernorm.weight"],
            "ff_norm": w[b + "post_attention_layernorm.weight"],
            "q": w[b + "self_attn.q_proj.weight"],
            "k": w[b + "self_attn.k_proj.weight"],
            "v": w[b + "self_attn.v_proj.weight"],
            "o": w[b + "self_attn.o_proj.weight"],
            "q_bias": w[b + "self_attn.q_proj.bias"],
            "k_bias": w[b + "self_attn.k_proj.bias"],
            "v_bias": w[b + "self_attn.v_proj.bias"],
            "gate": w[b + "mlp.gate_proj.weight"],
            "up": w[b + "mlp.up_proj.weight"],
            "down": w[b + "mlp.down_proj.weight"],
        }


def rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x, positions, theta):
    """Rotate-half RoPE: x [B, H, T, D], positions [B, T]; pairs (j, j + D/2) share a frequency."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions[:, None, :, None].float() * inv_freq  # [B, 1, T, D/2]
    angles = torch.cat([angles, angles], dim=-1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * angles.cos() + rotated * angles.sin()


def attention(x, p, arch: Arch, positions, key_mask):
    """Bidirectional multi-head attention over x [B, T, C]; key_mask [B, T] True = real."""
    B, T, C = x.shape
    D = C // arch.n_heads
    q = F.linear(x, p["q"], p["q_bias"]).view(B, T, arch.n_heads, D).transpose(1, 2)
    k = F.linear(x, p["k"], p["k_bias"]).view(B, T, arch.n_kv_heads, D).transpose(1, 2)
    v = F.linear(x, p["v"], p["v_bias"]).view(B, T, arch.n_kv_heads, D).transpose(1, 2)
    q, k = rope(q, positions, arch.theta), rope(k, positions, arch.theta)
    group = arch.n_heads // arch.n_kv_heads  # query head h reads key/value head h // group
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    out = scores.softmax(-1) @ v  # [B, H, T, D]
    return F.linear(out.transpose(1, 2).reshape(B, T, C), p["o"])


def block(x, p, arch: Arch, positions, key_mask):
    x = x + attention(rms_norm(x, p["attn_norm"], arch.eps), p, arch, positions, key_mask)
    h = rms_norm(x, p["ff_norm"], arch.eps)
    return x + F.linear(F.silu(F.linear(h, p["gate"])) * F.linear(h, p["up"]), p["down"])


def oracle_logits(weights, arch: Arch, input_ids, attention_mask=None, positions=None):
    """Logits [B, T, V] with logits[:, i] predicting token i (Dream's shift undone).

    attention_mask [B, T] (1 = real token) masks padding as a key; positions default to
    counting from each row's first real token.
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    key_mask = attention_mask.bool()
    if positions is None:
        positions = (attention_mask.long().cumsum(1) - 1).clamp_min(0)
    x = arch.embedding(weights)[input_ids]
    for i in range(arch.n_layers):
        x = block(x, arch.block(weights, i), arch, positions, key_mask)
    norm, head = arch.final(weights)
    logits = F.linear(rms_norm(x, norm, arch.eps), head)
    if arch.family == "dream":
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    return logits


# ----------------------------------------------------------------------------------- inputs
def random_ids(bundle, shape, seed):
    """Token ids over the whole vocabulary, a quarter of them the mask token."""
    gen = torch.Generator().manual_seed(seed)
    vocab = bundle.model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, shape, generator=gen)
    masked = torch.rand(shape, generator=gen) < 0.25
    return ids.masked_fill(masked, bundle.mask_id)


def left_pad(rows: list[list[int]], pad_id: int):
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row) :] = torch.tensor(row)
        mask[r, width - len(row) :] = 1
    return ids, mask


# ------------------------------------------------------------------------ oracle agreement
@pytest.mark.parametrize("family", FAMILIES)
def test_first_block_matches_the_oracle_block(family, folders, loaded):
    bundle, folder = loaded[family], folders[family]
    arch, weights = Arch.of(config_of(folder)), read_weights(folder)
    seen = {}

    def keep_input(module, args, kwargs):
        seen["in"] = args[0] if args else kwargs["hidden_states"]

    def keep_output(module, args, output):
        seen["out"] = output[0] if isinstance(output, tuple) else output

    layer = bundle.model.model.layers[0]
    hooks = [
        layer.register_forward_pre_hook(keep_input, with_kwargs=True),
        layer.register_forward_hook(keep_output),
    ]
    ids = random_ids(bundle, (2, 11), seed=3)
    try:
        with torch.no_grad():
            forward_logits(bundle.model, ids)
    finally:
        for hook in hooks:
            hook.remove()
    # The block's input is the embedding row of each token.
    torch.testing.assert_close(seen["in"], arch.embedding(weights)[ids], atol=0, rtol=0)
    positions = torch.arange(11).expand(2, -1)
    want = block(seen["in"], arch.block(weights, 0), arch, positions, torch.ones(2, 11).bool())
    torch.testing.assert_close(seen["out"], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_the_oracle(family, folders, loaded):
    bundle, folder = loaded[family], folders[family]
    arch, weights = Arch.of(config_of(folder)), read_weights(folder)
    ids = random_ids(bundle, (2, 13), seed=4)
    with torch.no_grad():
        got = forward_logits(bundle.model, ids).float()
    want = oracle_logits(weights, arch, ids)
    assert got.shape == (2, 13, config_of(folder)["vocab_size"])
    assert want.std() > 0.5  # logits that vary: agreement below is not agreement on zeros
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_of_the_last_positions_match_the_oracle_and_skip_the_prompts_head(
    family, folders, loaded
):
    """``last=k`` (a completion's logits): the head runs on k rows (Dream: k + 1, its shift),
    and they are the oracle's last k, left padding included; with ``stop``, those before it."""
    bundle, folder = loaded[family], folders[family]
    arch, weights = Arch.of(config_of(folder)), read_weights(folder)
    rows = []
    hook = bundle.model.get_output_embeddings().register_forward_hook(
        lambda module, args, output: rows.append(args[0].shape[1])
    )
    ids, mask = left_pad([random_ids(bundle, (1, n), n)[0].tolist() for n in (13, 9)], 0)
    try:
        with torch.no_grad():
            got = forward_logits(bundle.model, ids, mask, last=4).float()
            block = forward_logits(bundle.model, ids, mask, last=9, stop=8).float()
    finally:
        hook.remove()
    assert rows == [4 + (family == "dream"), 4 + (family == "dream")]
    want = oracle_logits(weights, arch, ids, mask)
    torch.testing.assert_close(got, want[:, -4:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(block, want[:, 4:8], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="last must be in 1..13"):
        forward_logits(bundle.model, ids, mask, last=14)
    with pytest.raises(ValueError, match="stop must be in 5..13"):
        forward_logits(bundle.model, ids, mask, last=9, stop=4)


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_logits_match_the_oracle_and_each_row_alone(family, folders, loaded):
    bundle, folder = loaded[family], folders[family]
    arch, weights = Arch.of(config_of(folder)), read_weights(folder)
    assert not bundle.ignores_attention_mask  # the mask does it, not length bucketing
    long, short = random_ids(bundle, (1, 12), 5)[0].tolist(), random_ids(bundle, (1, 5), 6)[0]
    ids, mask = left_pad([long, short.tolist()], bundle.pad_id)
    with torch.no_grad():
        batch = forward_logits(bundle.model, ids, mask).float()
        alone = forward_logits(bundle.model, short[None]).float()
    # Dream's row at a row's first real token is that of the position before it: not a row's own.
    first = 1 if family == "dream" else 0
    real = slice(7 + first, None)
    torch.testing.assert_close(batch[1, real], alone[0, first:], atol=1e-5, rtol=1e-5)
    want = oracle_logits(weights, arch, ids, mask)
    torch.testing.assert_close(batch[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch[1, real], want[1, real], atol=1e-5, rtol=1e-5)
    # Attending to the padding would move the short row's logits far beyond the tolerance.
    # (Where positions start does not matter to exact arithmetic: RoPE scores are relative.)
    attends_padding = oracle_logits(weights, arch, ids, torch.ones_like(ids))
    assert (attends_padding[1, real] - alone[0, first:]).abs().max() > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_on_a_left_padded_batch_equals_each_prompt_alone(family, loaded):
    bundle = loaded[family]
    texts = ["12+34=", "What is seven times eight? Answer: "]
    rows = [bundle.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert len(rows[0]) != len(rows[1])
    ids, mask = left_pad(rows, bundle.pad_id)
    kw = dict(mask_id=bundle.mask_id, gen_length=8, steps=8, block_length=4, temperature=0.0)
    with torch.no_grad():
        batch = generate(bundle.model, ids, mask, **kw).completion_ids
        for r, row in enumerate(rows):
            alone = generate(bundle.model, torch.tensor([row]), None, **kw).completion_ids
            assert batch[r].tolist() == alone[0].tolist()


# ------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("family", FAMILIES)
def test_save_and_reload_keeps_logits_hub_keys_and_config(family, folders, loaded, tmp_path):
    from daca.models import save_pretrained

    bundle, folder = loaded[family], folders[family]
    hub_keys = set(read_weights(folder))
    save_pretrained(bundle, tmp_path / "full")
    bundle.model.save_pretrained(tmp_path / "model-only")
    for saved in (tmp_path / "full", tmp_path / "model-only"):
        assert set(read_weights(saved)) == hub_keys
        written, original = config_of(saved), config_of(folder)
        for key in set(original) - {"transformers_version", "torch_dtype"}:
            assert written.get(key) == original[key], key
    assert (tmp_path / "full" / "daca.json").is_file()
    again = load(str(tmp_path / "full"))
    assert (again.family, again.mask_id, again.eos_ids, again.pad_id) == (
        bundle.family,
        bundle.mask_id,
        bundle.eos_ids,
        bundle.pad_id,
    )
    ids = random_ids(bundle, (2, 9), seed=7)
    with torch.no_grad():
        assert torch.equal(forward_logits(again.model, ids), forward_logits(bundle.model, ids))
    saved_weights = read_weights(tmp_path / "full")
    for key, tensor in read_weights(folder).items():
        assert torch.equal(saved_weights[key], tensor), key


# --------------------------------------------------------------------- ids and remote code
def test_special_ids_are_those_of_the_hub_checkpoints(loaded):
    llada, dream = loaded["llada"], loaded["dream"]
    assert (llada.family, dream.family) == ("llada", "dream")
    assert llada.mask_id == LLADA_SPECIALS["<|mdm_mask|>"] == 126336
    assert llada.pad_id == 126081 and llada.eos_ids[0] == 126081
    assert LLADA_SPECIALS["<|eot_id|>"] in llada.eos_ids  # Instruct turns end with <|eot_id|>
    assert dream.mask_id == DREAM_SPECIALS["<|mask|>"] == 151666
    assert dream.pad_id == 151643 and dream.eos_ids[0] == 151643
    assert DREAM_SPECIALS["<|im_end|>"] in dream.eos_ids


@pytest.mark.parametrize(("family", "mask_id"), [("llada", 126335), ("dream", 151660)])
def test_the_mask_id_is_read_from_the_checkpoint(family, mask_id, tmp_path):
    folder = WRITERS[family](tmp_path, mask_token_id=mask_id, shards=1)
    bundle = load(str(folder))
    assert bundle.mask_id == mask_id
    assert bundle.tokenizer.convert_ids_to_tokens(mask_id) in ("<|mdm_mask|>", "<|mask|>")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("trust", [None, False, True])
def test_the_checkpoints_python_files_are_never_imported(family, trust, tmp_path):
    folder = WRITERS[family](tmp_path, shards=1)
    kwargs = {} if trust is None else {"trust_remote_code": trust}
    bundle = load(str(folder), **kwargs)
    assert bundle.family == family
    assert imported_python(folder) == []
    assert not [
        name
        for name in sys.modules
        if "modeling_llada" in name
        or "modeling_dream" in name
        or "configuration_llada" in name
        or "configuration_dream" in name
    ]


def test_dream_tokenizer_named_as_on_the_hub_loads_without_its_code(tmp_path):
    folder = write_dream(tmp_path, shards=1, hub_tokenizer_class=True)
    bundle = load(str(folder))
    assert imported_python(folder) == []
    assert (bundle.mask_id, bundle.pad_id, bundle.eos_ids[0]) == (151666, 151643, 151643)
    text = "<|im_start|>user\n12+34=<|im_end|>"
    ids = bundle.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == DREAM_SPECIALS["<|im_start|>"] and ids[-1] == DREAM_SPECIALS["<|im_end|>"]
    assert bundle.tokenizer.decode(ids) == text
