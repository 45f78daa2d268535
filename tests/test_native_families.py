"""The native families through ``daca.models.load`` on checkpoints shaped like the hub's
(``_hub``, ``_hub_a2d``): LLaDA, Dream, DiffuCoder (Dream's layout), dllm's A2D Qwen3, Qwen2
and Llama.

The reference is an oracle written here from the architectures' published descriptions, in
plain torch, reading the weights under the hub's key names straight from the safetensors
files — not transformers' Llama/Qwen2/Qwen3 classes the loader builds on, nor the families'
remote code:

- LLaDA-8B: token embedding; per block x += Attn(RMSNorm(x)), x += SwiGLU(RMSNorm(x)); final
  RMSNorm; untied linear head. RMSNorm normalises in float32, then scales by its weight.
  Attention: multi-head, rotate-half RoPE (θ = ``rope_theta``) on queries and keys, softmax
  over all real keys (no causal mask), no biases. SwiGLU: down(silu(gate(x)) * up(x)).
- Dream-7B: the same with Qwen2's names, biases on q/k/v, grouped key/value heads, θ = 1e6;
  its logits at i predict token i + 1, so the core's logits are Dream's shifted right by one
  (``logits[:, 0]`` repeats Dream's row 0). DiffuCoder-7B is Dream's architecture.
- A2D Qwen3 (dllm): Qwen3 with bidirectional attention and no shift: Qwen2's names without
  biases, an explicit head width, each head's query and key RMS-normalised (own weights) before
  RoPE, the head tied to the embedding.
- A2D Qwen2 (dllm): Qwen2 (Dream's block: q/k/v biases) with no shift and a tied head.
- A2D Llama (dllm): Llama 3.2 with bidirectional attention and no shift: Llama's block under
  Qwen2's names, grouped key/value heads, tied head, and RoPE frequencies under Llama 3's
  scaling (low frequencies divided by ``factor``, a linear blend between).

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
    DIFFUCODER_SPECIALS,
    DREAM_SPECIALS,
    LLADA_SPECIALS,
    imported_python,
    read_weights,
    write_diffucoder,
    write_dream,
    write_llada,
)
from _hub_a2d import (
    LLAMA3_SPECIALS,
    QWEN3_SPECIALS,
    QWEN25_SPECIALS,
    write_a2d_llama,
    write_a2d_qwen2,
    write_a2d_qwen3,
)
from conftest import assert_batch_generates_each_prompt_alone, left_pad

from daca.core.modeling import forward_logits
from daca.models import load

# Checkpoint kinds and their writers; FAMILY_OF: the family daca loads a kind as, where the
# kind's name is not the family's.
WRITERS = {
    "llada": write_llada,
    "dream": write_dream,
    "diffucoder": write_diffucoder,
    "a2d-qwen3": write_a2d_qwen3,
    "a2d-qwen2": write_a2d_qwen2,
    "a2d-llama": write_a2d_llama,
}
FAMILIES = tuple(WRITERS)
FAMILY_OF = {"diffucoder": "dream"}


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
    """What the oracle needs of a checkpoint: sizes from config.json and the hub's key names.

    layout: ``llada`` (LLaDA's names), else ``qwen`` (Qwen2/Qwen3/Llama names); shift: logits
    at i predict token i + 1 (Dream); qk_norm: RMSNorm over each head of q and k (Qwen3);
    rope_scaling: Llama 3's frequency scaling, or None."""

    layout: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    theta: float
    shift: bool = False
    qk_norm: bool = False
    tied: bool = False
    rope_scaling: dict | None = None

    @classmethod
    def of(cls, config: dict) -> Arch:
        if config["model_type"] == "llada":
            d, heads = config["d_model"], config["n_heads"]
            return cls("llada", config["n_layers"], heads, config["n_kv_heads"], d // heads,
                       config["rms_norm_eps"], config["rope_theta"])  # fmt: skip
        heads = config["num_attention_heads"]
        return cls(
            "qwen",
            config["num_hidden_layers"],
            heads,
            config["num_key_value_heads"],
            config.get("head_dim") or config["hidden_size"] // heads,
            config["rms_norm_eps"],
            config["rope_theta"],
            shift=config["model_type"] == "Dream",
            qk_norm=config["model_type"] == "a2d-qwen3",
            tied=config["tie_word_embeddings"],
            rope_scaling=config.get("rope_scaling"),
        )

    def embedding(self, w):
        llada = self.layout == "llada"
        return w["model.transformer.wte.weight" if llada else "model.embed_tokens.weight"]

    def final(self, w):
        """(final norm weight, head weight)."""
        if self.layout == "llada":
            return w["model.transformer.ln_f.weight"], w["model.transformer.ff_out.weight"]
        head = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
        return w["model.norm.weight"], w[head]

    def block(self, w, i: int) -> dict:
        """Block i's tensors; biases and q/k norms are None where the family has none."""
        if self.layout == "llada":
            b = f"model.transformer.blocks.{i}."
            names = {"attn_norm": "attn_norm", "ff_norm": "ff_norm", "q": "q_proj",
                     "k": "k_proj", "v": "v_proj", "o": "attn_out", "gate": "ff_proj",
                     "up": "up_proj", "down": "ff_out"}  # fmt: skip
        else:
            b = f"model.layers.{i}."
            names = {"attn_norm": "input_layernorm", "ff_norm": "post_attention_layernorm",
                     "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                     "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                     "down": "mlp.down_proj", "q_bias": "self_attn.q_proj",
                     "k_bias": "self_attn.k_proj", "v_bias": "self_attn.v_proj",
                     "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}  # fmt: skip
        p = {}
        for role in ("attn_norm", "ff_norm", "q", "k", "v", "o", "gate", "up", "down",
                     "q_bias", "k_bias", "v_bias", "q_norm", "k_norm"):  # fmt: skip
            suffix = ".bias" if role.endswith("_bias") else ".weight"
            p[role] = w.get(b + names[role] + suffix) if role in names else None
        return p


def rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def inverse_frequencies(d: int, theta: float, scaling: dict | None):
    """RoPE's frequencies theta^(-2j/d); Llama 3's scaling divides the low ones (wavelength
    above original/low_freq_factor) by ``factor`` and blends linearly in wavelength-inverse
    between that and original/high_freq_factor (Meta's Llama 3.1 release, apply_scaling)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    if not scaling or scaling.get("rope_type") != "llama3":
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    out = []
    for f in inv_freq.tolist():
        wavelength = 2 * math.pi / f
        if wavelength < original / high:
            out.append(f)
        elif wavelength > original / low:
            out.append(f / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out)


def rope(x, positions, arch: Arch):
    """Rotate-half RoPE: x [B, H, T, D], positions [B, T]; pairs (j, j + D/2) share a frequency."""
    d = x.shape[-1]
    inv_freq = inverse_frequencies(d, arch.theta, arch.rope_scaling)
    angles = positions[:, None, :, None].float() * inv_freq  # [B, 1, T, D/2]
    angles = torch.cat([angles, angles], dim=-1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * angles.cos() + rotated * angles.sin()


def attention(x, p, arch: Arch, positions, key_mask):
    """Multi-head attention over x [B, T, C]; key_mask [B, T] True = real (bidirectional), or
    [B, T, T] the keys each query attends (a block-causal pattern)."""
    B, T, _ = x.shape
    D = arch.head_dim
    q = F.linear(x, p["q"], p["q_bias"]).view(B, T, arch.n_heads, D)
    k = F.linear(x, p["k"], p["k_bias"]).view(B, T, arch.n_kv_heads, D)
    v = F.linear(x, p["v"], p["v_bias"]).view(B, T, arch.n_kv_heads, D).transpose(1, 2)
    if arch.qk_norm:  # Qwen3: each head's query and key RMS-normalised before RoPE
        q, k = rms_norm(q, p["q_norm"], arch.eps), rms_norm(k, p["k_norm"], arch.eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    q, k = rope(q, positions, arch), rope(k, positions, arch)
    group = arch.n_heads // arch.n_kv_heads  # query head h reads key/value head h // group
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    keys = key_mask[:, None, None, :] if key_mask.dim() == 2 else key_mask[:, None]
    scores = scores.masked_fill(~keys, float("-inf"))
    out = scores.softmax(-1) @ v  # [B, H, T, D]
    return F.linear(out.transpose(1, 2).reshape(B, T, arch.n_heads * D), p["o"])


def block(x, p, arch: Arch, positions, key_mask):
    x = x + attention(rms_norm(x, p["attn_norm"], arch.eps), p, arch, positions, key_mask)
    h = rms_norm(x, p["ff_norm"], arch.eps)
    return x + F.linear(F.silu(F.linear(h, p["gate"])) * F.linear(h, p["up"]), p["down"])


def oracle_logits(
    weights, arch: Arch, input_ids, attention_mask=None, positions=None, pattern=None
):
    """Logits [B, T, V] with logits[:, i] predicting token i (Dream's shift undone).

    attention_mask [B, T] (1 = real token) masks padding as a key; positions default to
    counting from each row's first real token; ``pattern`` [B, T, T], if given, the keys each
    query attends instead.
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    key_mask = attention_mask.bool() if pattern is None else pattern
    if positions is None:
        positions = (attention_mask.long().cumsum(1) - 1).clamp_min(0)
    x = arch.embedding(weights)[input_ids]
    for i in range(arch.n_layers):
        x = block(x, arch.block(weights, i), arch, positions, key_mask)
    norm, head = arch.final(weights)
    logits = F.linear(rms_norm(x, norm, arch.eps), head)
    if arch.shift:
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
    shift = Arch.of(config_of(folder)).shift
    assert rows == [4 + shift, 4 + shift]
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
    first = 1 if arch.shift else 0
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
    assert_batch_generates_each_prompt_alone(bundle, rows)


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


# What each kind's tokenizer names (the writers' tables): (mask, end tokens, pad token).
SPECIAL_TOKENS = {
    "diffucoder": ("<|mask|>", ("<|endoftext|>", "<|im_end|>", "<|dlm_pad|>"), "<|endoftext|>"),
    "a2d-qwen3": ("<|mask|>", ("<|im_end|>",), "<|endoftext|>"),
    "a2d-qwen2": ("<|mask|>", ("<|im_end|>",), "<|endoftext|>"),
    "a2d-llama": ("<|mask|>", ("<|end_of_text|>", "<|eot_id|>"), "<|end_of_text|>"),
}
SPECIALS_OF = {
    "diffucoder": DREAM_SPECIALS | DIFFUCODER_SPECIALS,
    "a2d-qwen3": QWEN3_SPECIALS,
    "a2d-qwen2": QWEN25_SPECIALS,
    "a2d-llama": LLAMA3_SPECIALS,
}


@pytest.mark.parametrize("family", sorted(SPECIAL_TOKENS))
def test_special_ids_of_the_new_families_are_read_off_their_tokenizers(family, loaded):
    """DiffuCoder's <|dlm_pad|> ends a completion; A2D's <|mask|> is a token dllm added (no
    mask_token_id in config.json), and its ends are the AR model's EOS and end of turn."""
    bundle, specials = loaded[family], SPECIALS_OF[family]
    mask, ends, pad = SPECIAL_TOKENS[family]
    assert bundle.family == FAMILY_OF.get(family, family)
    assert bundle.mask_id == specials[mask]
    assert set(bundle.eos_ids) == {specials[t] for t in ends}
    assert bundle.pad_id == specials[pad]
    assert bundle.mask_id < bundle.model.get_input_embeddings().num_embeddings


@pytest.mark.parametrize(
    ("family", "mask_id"),
    [
        ("llada", 126335),
        ("dream", 151660),
        ("a2d-qwen3", 151660),
        ("a2d-qwen2", 151660),
        ("a2d-llama", 128100),
    ],
)
def test_the_mask_id_is_read_from_the_checkpoint(family, mask_id, tmp_path):
    folder = WRITERS[family](tmp_path, mask_token_id=mask_id, shards=1)
    bundle = load(str(folder))
    assert bundle.mask_id == mask_id
    assert bundle.tokenizer.convert_ids_to_tokens(mask_id) in ("<|mdm_mask|>", "<|mask|>")


def test_a_mask_token_beyond_the_embedding_is_one_error(tmp_path):
    """dllm adds <|mask|> to the Llama 3 tokenizer as id 128256, one past Llama 3's 128256
    embedding rows: without a resized embedding that id indexes nothing."""
    folder = write_a2d_llama(tmp_path, vocab_size=128256)
    with pytest.raises(ValueError, match=r"mask token id 128256 has no row in .* 128256-row"):
        load(str(folder))


def test_a2d_qwen3_prompts_are_rendered_without_thinking(loaded):
    """dllm renders Qwen3's template with enable_thinking=False unless asked: the generation
    prompt ends with an empty think block, as the A2D model was trained."""
    from daca.models.prompts import render_chat

    text = render_chat(loaded["a2d-qwen3"].tokenizer, [{"role": "user", "content": "1+1="}])
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    dream = render_chat(loaded["dream"].tokenizer, [{"role": "user", "content": "1+1="}])
    assert dream.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("trust", [None, False, True])
def test_the_checkpoints_python_files_are_never_imported(family, trust, tmp_path):
    folder = WRITERS[family](tmp_path, shards=1)
    kwargs = {} if trust is None else {"trust_remote_code": trust}
    bundle = load(str(folder), **kwargs)
    assert bundle.family == FAMILY_OF.get(family, family)
    assert imported_python(folder) == []
    from_folder = [
        name
        for name, module in list(sys.modules.items())
        if str(folder) in str(getattr(module, "__file__", None) or "")
        or "modeling_llada" in name
        or "modeling_dream" in name
        or "configuration_llada" in name
        or "configuration_dream" in name
    ]
    assert not from_folder


def test_dream_tokenizer_named_as_on_the_hub_loads_without_its_code(tmp_path):
    folder = write_dream(tmp_path, shards=1, hub_tokenizer_class=True)
    bundle = load(str(folder))
    assert imported_python(folder) == []
    assert (bundle.mask_id, bundle.pad_id, bundle.eos_ids[0]) == (151666, 151643, 151643)
    text = "<|im_start|>user\n12+34=<|im_end|>"
    ids = bundle.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == DREAM_SPECIALS["<|im_start|>"] and ids[-1] == DREAM_SPECIALS["<|im_end|>"]
    assert bundle.tokenizer.decode(ids) == text


def test_every_family_in_the_table_has_a_native_class_and_loads_by_its_model_type(loaded):
    """The family table and the loader's classes agree: each family has a transformers class,
    each of its model types (any case) maps to it, and its LoRA targets are module names of
    the loaded model."""
    from daca.models.families import FAMILIES, family_of
    from daca.models.native_classes import NATIVE

    assert set(FAMILIES) == set(NATIVE)
    for family in FAMILIES.values():
        for kind in family.model_types:
            assert family_of(kind) == family_of(kind.upper()) == family.name
    assert family_of("qwen3") == family_of(None) == "mlm"
    for kind, bundle in loaded.items():
        names = {name.rsplit(".", 1)[-1] for name, _ in bundle.model.named_modules()}
        assert set(FAMILIES[FAMILY_OF.get(kind, kind)].lora_targets) <= names
