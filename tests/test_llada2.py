"""LLaDA 2.x (inclusionAI/LLaDA2.0-mini, LLaDA2.1-mini) run natively on tiny hub-layout
checkpoints (tests/_hub_llada2.py): logits against a plain-torch re-statement of its modeling
code under its block-causal mask (built here position by position, not by daca's function),
left padding, a block that never sees a later one, the block KV cache exact in every mode, the
likelihoods scoring each block given the clean blocks before it, a LoRA and 4-bit step reaching
the fused attention and the experts, save/reload in the hub layout, the special ids, ``daca
eval``, the memory plan, and the one-line refusal of what daca does not run."""

import json
from pathlib import Path

import pytest
import torch
from _hub import read_weights
from _hub_llada2 import BLOCK, write_llada2
from _oracle import block_causal_pattern, config_of, rms, rope, swiglu, token_ids
from conftest import (
    assert_batch_generates_each_prompt_alone,
    assert_moe_tokenizer_ids_and_no_remote_code,
    assert_the_plan_counts_the_adapters_peft_builds,
    left_pad,
    lora_adapted,
    lora_sgd_step,
    one_error_line,
)

from daca.cli import main
from daca.core.block_cache import BlockCache
from daca.core.likelihood import mean_field_logp, stratified_logp
from daca.core.modeling import block_diffusion_mask, forward_logits
from daca.core.sampler import generate
from daca.models import load, save_pretrained
from daca.models.families import FAMILIES, lora_targets, model_shape
from daca.models.prompts import pad_for_model, pad_prompts
from daca.train.config import load_config

# Variants: plain (first layer dense, q/k norms, a shared expert); biased (q/k/v and output
# biases, no q/k norms, two groups kept of two, every layer MoE); tied (a tied head, no shared
# expert, top 1).
VARIANTS = {
    "plain": {},
    "biased": dict(qkv_bias=True, out_bias=True, qk_norm=False, top_groups=2, dense_layers=0),
    "tied": dict(tied=True, shared=None, top_k=1),
}
TOL = dict(atol=2e-5, rtol=2e-5)  # fp32, tiny widths


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {v: write_llada2(tmp_path_factory.mktemp(v), seed=2, **kw) for v, kw in VARIANTS.items()}


@pytest.fixture(scope="module")
def loaded(folders):
    torch.set_num_threads(1)
    return {v: load(str(folders[v])) for v in VARIANTS}


# ------------------------------------------------------------------ the oracle (plain torch)


def _moe(x, w, b, c):
    """LLaDA2MoeGate: sigmoid scores; choose on scores + bias within the best groups (a group
    scored by its two best); renormalise the chosen scores when k > 1; scale; + shared."""
    E, G, k = c["num_experts"], c["n_group"], c["num_experts_per_tok"]
    scores = torch.sigmoid(x @ w[b + "mlp.gate.weight"].T)
    choice = scores + w[b + "mlp.gate.expert_bias"]
    group_best = choice.view(*choice.shape[:-1], G, E // G).topk(2, -1)[0].sum(-1)
    kept = group_best.topk(c["topk_group"], -1)[1]
    allowed = torch.zeros_like(group_best).scatter(-1, kept, 1.0).repeat_interleave(E // G, -1)
    idx = choice.masked_fill(allowed == 0, float("-inf")).topk(k, -1)[1]
    top = scores.gather(-1, idx)
    if k > 1:
        top = top / top.sum(-1, keepdim=True)
    top = top * c["routed_scaling_factor"]
    out = torch.zeros_like(x)
    for j in range(E):
        weight = (top * (idx == j)).sum(-1, keepdim=True)  # 0 where j is not chosen
        out = out + weight * swiglu(x, w, f"{b}mlp.experts.{j}.")
    if c["num_shared_experts"]:
        out = out + swiglu(x, w, b + "mlp.shared_experts.")
    return out


def oracle_logits(w, c, ids, attention_mask=None):
    """LLaDA 2.x's forward as its modeling code computes it under the block-causal mask,
    positions from the first real token of each row."""
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    H, K, D, eps = (
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
        c["rms_norm_eps"],
    )
    rotary = int(D * c["partial_rotary_factor"])
    x = w["model.word_embeddings.weight"][ids]
    B, T, _ = x.shape
    bias = torch.zeros(B, 1, T, T).masked_fill(
        ~block_causal_pattern(mask, BLOCK, anchor="start")[:, None], float("-inf")
    )
    for i in range(c["num_hidden_layers"]):
        b = f"model.layers.{i}."
        h = rms(x, w[b + "input_layernorm.weight"], eps)
        qkv = h @ w[b + "attention.query_key_value.weight"].T
        if c["use_qkv_bias"]:
            qkv = qkv + w[b + "attention.query_key_value.bias"]
        q, k, v = qkv.view(B, T, H + 2 * K, D).split([H, K, K], dim=2)
        if c["use_qk_norm"]:
            q = rms(q, w[b + "attention.query_layernorm.weight"], eps)
            k = rms(k, w[b + "attention.key_layernorm.weight"], eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = rope(q, positions, c["rope_theta"], rotary)
        k = rope(k, positions, c["rope_theta"], rotary)
        k, v = k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / D**0.5 + bias, -1) @ v
        out = att.transpose(1, 2).reshape(B, T, H * D) @ w[b + "attention.dense.weight"].T
        x = x + (out + w[b + "attention.dense.bias"] if c["use_bias"] else out)
        h = rms(x, w[b + "post_attention_layernorm.weight"], eps)
        dense = i < c["first_k_dense_replace"]
        x = x + (swiglu(h, w, b + "mlp.") if dense else _moe(h, w, b, c))
    head = w.get("lm_head.weight", w["model.word_embeddings.weight"])
    return rms(x, w["model.norm.weight"], eps) @ head.T


def _padded(bundle, lengths=(5, 11), seed=1, whole_blocks=True):
    """Prompts of ``lengths`` padded as daca pads LLaDA 2.x's (``pad_prompts``: in whole
    blocks, padding before and after), or left padded alone."""
    rows = [token_ids((n,), seed + r).tolist() for r, n in enumerate(lengths)]
    return (
        pad_for_model(bundle.model, rows, bundle.pad_id)
        if whole_blocks
        else left_pad(rows, bundle.pad_id)
    )


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_the_oracle_unpadded_and_left_padded(variant, folders, loaded):
    bundle = loaded[variant]
    assert type(bundle.model).__name__ == "LLaDA2ForDiffusionLM" and bundle.family == "llada2"
    w, c = read_weights(folders[variant]), config_of(folders[variant])
    ids = token_ids((2, 19))  # 3 blocks, the first of 3 positions
    with torch.no_grad():
        torch.testing.assert_close(bundle.model(ids).logits, oracle_logits(w, c, ids), **TOL)
        ids, mask = _padded(bundle)
        got = bundle.model(ids, attention_mask=mask).logits
    want = oracle_logits(w, c, ids, mask)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], **TOL)


def test_a_left_padded_row_equals_the_row_alone(loaded):
    model = loaded["plain"].model
    ids, mask = _padded(loaded["plain"], lengths=(6, 13, 20), whole_blocks=False)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        for r in range(3):
            alone = model(ids[r : r + 1, mask[r].argmax() :]).logits[0]
            torch.testing.assert_close(batch[r, mask[r].argmax() :], alone, **TOL)


def test_prompts_are_padded_to_whole_blocks_and_cut_as_its_generate_cuts_them(folders, loaded):
    """LLaDA 2.x's generate cuts prompt ++ completion into blocks from position 0; daca pads
    each prompt to whole blocks (before it and after it), so its completion begins a block and
    each prompt's logits are those of the prompt alone under LLaDA 2.x's own mask."""
    bundle = loaded["plain"]
    rows = [token_ids((13,), 1).tolist(), token_ids((5,), 2).tolist()]
    ids, mask = pad_prompts(bundle, rows)
    # Blocks of 8: 13 tokens + 3 of padding; 8 of padding, 5 tokens, 3 of padding.
    assert mask.tolist() == [[1] * 13 + [0] * 3, [0] * 8 + [1] * 5 + [0] * 3]
    assert ids[0, :13].tolist() == rows[0] and ids[1, 8:13].tolist() == rows[1]
    assert (ids[mask == 0] == bundle.pad_id).all()
    w, c = read_weights(folders["plain"]), config_of(folders["plain"])
    with torch.no_grad():
        got = bundle.model(ids, attention_mask=mask).logits
        for r, row in enumerate(rows):
            alone = oracle_logits(w, c, torch.tensor([row]))[0]  # LLaDA 2.x's mask, from 0
            torch.testing.assert_close(got[r][mask[r].bool()], alone, **TOL)
    # Counted back from the end instead, the 13-token prompt's blocks would be 5 + 8: other
    # logits, which is why LLaDA 2.x is anchored at the start.
    end = block_causal_pattern(torch.ones(1, 13), BLOCK, anchor="end")
    assert not torch.equal(end, block_causal_pattern(torch.ones(1, 13), BLOCK, anchor="start"))


def test_the_sampler_and_likelihoods_refuse_prompts_that_are_not_whole_blocks(loaded):
    bundle = loaded["plain"]
    rows = [token_ids((13,), 1).tolist(), token_ids((5,), 2).tolist()]
    ids, mask = left_pad(rows, bundle.pad_id)
    kw = dict(mask_id=bundle.mask_id, gen_length=BLOCK, steps=4, block_length=BLOCK)
    for prompt, attention in ((ids, mask), (torch.tensor([rows[0]]), None)):
        with pytest.raises(ValueError, match="not a whole number of the model's blocks of 8"):
            generate(bundle.model, prompt, attention, **kw)
    completion = token_ids((2, BLOCK))
    with pytest.raises(ValueError, match="pad the prompts with daca.models.prompts.pad_prompts"):
        mean_field_logp(bundle.model, ids, completion, mask_id=bundle.mask_id, attention_mask=mask)
    generate(bundle.model, *pad_prompts(bundle, rows), **kw)  # in whole blocks: runs


def test_a_block_never_sees_a_later_one(loaded):
    """Changing every token of the last two blocks leaves the earlier logits bit for bit."""
    model = loaded["plain"].model
    ids = token_ids((2, 4 * BLOCK))
    later = ids.clone()
    later[:, 2 * BLOCK :] = token_ids((2, 2 * BLOCK), 7)
    with torch.no_grad():
        a, b = model(ids).logits, model(later).logits
    assert torch.equal(a[:, : 2 * BLOCK], b[:, : 2 * BLOCK])
    assert (a[:, 2 * BLOCK :] - b[:, 2 * BLOCK :]).abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_cached_block_steps_equal_the_full_forward(mode, loaded):
    """Every block of a left-padded batch: the refresh, the extension by the block before it,
    a suffix refresh and a step on the cache give the full forward's logits (the step's mask
    laid out as the cache stores its keys)."""
    bundle = loaded["biased"]
    prompt, attn = _padded(bundle, lengths=(3, 6))
    P, L = prompt.shape[1], 3 * BLOCK
    x = torch.cat([prompt, token_ids((2, L), 5)], 1)
    x[:, P + 3 :: 2] = bundle.mask_id
    attn = torch.cat([attn, torch.ones(2, L, dtype=torch.long)], 1)
    with torch.no_grad():
        full = bundle.model(x, attention_mask=attn).logits
        for c in range(L // BLOCK):
            lo, hi = c * BLOCK, (c + 1) * BLOCK
            cache = BlockCache(bundle.model, mode, attn, P, P + L)
            torch.testing.assert_close(cache.refresh(x, lo, hi, L), full[:, P + lo :], **TOL)
            torch.testing.assert_close(cache.block(x, lo, hi), full[:, P + lo : P + hi], **TOL)
        # One cache through the blocks: a refresh, then each next block extends it.
        cache = BlockCache(bundle.model, mode, attn, P, P + L)
        cache.refresh(x, 0, BLOCK, L)
        for c in range(1, L // BLOCK):
            lo, hi = c * BLOCK, (c + 1) * BLOCK
            torch.testing.assert_close(cache.extend(x, lo, hi, L), full[:, P + lo :], **TOL)
            torch.testing.assert_close(cache.block(x, lo, hi), full[:, P + lo : P + hi], **TOL)
            got = cache.refresh_suffix(x, lo, hi, L)  # a refresh within the block
            torch.testing.assert_close(got, full[:, P + lo :], **TOL)


def _with_each_cache(bundle, prompt, attn, **kw):
    """{cache mode: the rollout}, the same seed for each."""
    return {
        cache: generate(
            bundle.model,
            prompt,
            attn,
            generator=torch.Generator().manual_seed(4),
            cache=cache,
            **kw,
        )
        for cache in ("none", "prefix", "dual")
    }


def test_generation_with_either_cache_equals_no_cache_to_the_token_and_the_trace(loaded):
    """Under block-causal attention the cached prefix never goes stale: prefix and dual give
    the tokens, births and DPS trace of no cache, with one full forward in all (the first
    block's start), the next block's start extending the cache and a recorded step recomputing
    only the block and its suffix, or only the block when it reads nothing past it."""
    bundle = loaded["plain"]
    prompt, attn = _padded(bundle, lengths=(4, 9))
    kw = dict(mask_id=bundle.mask_id, gen_length=2 * BLOCK, steps=8, block_length=BLOCK,
              temperature=0.9, dps_stride=3)  # fmt: skip
    runs = _with_each_cache(bundle, prompt, attn, **kw)
    for cache in ("prefix", "dual"):
        assert torch.equal(runs[cache].sequences, runs["none"].sequences)
        assert torch.equal(runs[cache].birth_step, runs["none"].birth_step)
        torch.testing.assert_close(runs[cache].progress_logp, runs["none"].progress_logp, **TOL)
    # t = 0 full, 4 extend, 3 recorded (reads block 1: a suffix refresh), 6 recorded in the last
    # block (reads nothing past it: a block step), 1, 2, 5, 7 block steps
    assert runs["dual"].forwards == {"full": 1, "extend": 1, "suffix": 1, "block": 5}


def test_the_trace_in_scope_block_refreshes_only_what_it_reads(loaded):
    """A recorded step that reads only its block is, under block-causal attention, exactly a
    block step (no refresh), and the trace equals no cache's."""
    bundle = loaded["plain"]
    prompt, attn = _padded(bundle, lengths=(4, 9))
    kw = dict(mask_id=bundle.mask_id, gen_length=2 * BLOCK, steps=8, block_length=BLOCK,
              temperature=0.9, dps_stride=3, dps_scope="block")  # fmt: skip
    runs = _with_each_cache(bundle, prompt, attn, **kw)
    for cache in ("prefix", "dual"):
        assert torch.equal(runs[cache].sequences, runs["none"].sequences)
        torch.testing.assert_close(runs[cache].progress_logp, runs["none"].progress_logp, **TOL)
    # t = 3, block 0's last step, reads block 1 too (its interval to t = 6 reaches into it): a
    # suffix refresh; t = 6 reads its own block only: a block step
    assert runs["dual"].forwards == {"full": 1, "extend": 1, "suffix": 1, "block": 5}


# Query positions of each forward (P 8, 3 blocks of 8, 2 steps a block), without the trace and
# with it at s 2 (every block start recorded: its forward runs to the end, which the trace
# reads). No cache: P + the block, or P + L. Cached: block 0's start P + its block, later starts
# the block finished + the block (recorded: L and L - 8 from the block finished), steps 8.
QUERIES = {
    "none": ([16, 16, 24, 24, 32, 32], [32, 16, 32, 24, 32, 32]),
    "prefix": ([16, 8, 16, 8, 16, 8], [32, 8, 24, 8, 16, 8]),
    "dual": ([16, 8, 16, 8, 16, 8], [32, 8, 24, 8, 16, 8]),
}


@pytest.mark.parametrize("mode", QUERIES)
def test_forwards_stop_where_their_logits_are_read(mode, loaded):
    """Nothing after a position changes it under block-causal attention: no forward computes
    past the last position its logits are read from, with or without the cache."""
    bundle = loaded["plain"]
    embed = bundle.model.get_input_embeddings()
    seen = []
    hook = embed.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))
    prompt = token_ids((2, BLOCK), 3)
    kw = dict(mask_id=bundle.mask_id, gen_length=3 * BLOCK, steps=6, block_length=BLOCK,
              temperature=0.0, cache=mode)  # fmt: skip
    try:
        with torch.no_grad():
            plain = generate(bundle.model, prompt, None, **kw)
            plain_queries, seen[:] = list(seen), []
            traced = generate(bundle.model, prompt, None, dps_stride=2, **kw)
            none = generate(bundle.model, prompt, None, **(kw | {"cache": "none"}))
    finally:
        hook.remove()
    assert (plain_queries, seen[:6]) == QUERIES[mode]
    assert torch.equal(plain.sequences, none.sequences)
    assert torch.equal(traced.sequences, none.sequences)


def test_parallel_decoding_with_either_cache_equals_no_cache(folders):
    """Rows that finish a block at different steps run their steps on their own rows of the
    cache (a head scaled by 30, so that confidences pass the threshold)."""
    bundle = load(str(folders["plain"]))
    with torch.no_grad():
        bundle.model.lm_head.weight.mul_(30)
    prompt, attn = _padded(bundle, lengths=(4, 9))
    kw = dict(mask_id=bundle.mask_id, gen_length=2 * BLOCK, steps=8, block_length=BLOCK,
              temperature=0.9, dps_stride=3, parallel_threshold=0.9)  # fmt: skip
    runs = _with_each_cache(bundle, prompt, attn, **kw)
    taken = runs["none"].steps_taken.tolist()
    assert taken[0] != taken[1] and max(taken) < 8  # the rows finished apart, and early
    for cache in ("prefix", "dual"):
        assert torch.equal(runs[cache].sequences, runs["none"].sequences)
        assert runs[cache].steps_taken.tolist() == taken
        got, want = runs[cache].progress_logp, runs["none"].progress_logp
        torch.testing.assert_close(got, want, equal_nan=True, **TOL)


def test_generation_on_a_left_padded_batch_equals_each_prompt_alone(loaded):
    rows = [token_ids((4,), 11).tolist(), token_ids((9,), 12).tolist()]
    assert_batch_generates_each_prompt_alone(
        loaded["plain"], rows, gen_length=2 * BLOCK, steps=8, block_length=BLOCK
    )


def test_the_sampler_decodes_in_the_model_s_blocks_only(loaded):
    bundle = loaded["plain"]
    with pytest.raises(ValueError, match=f"block_length={BLOCK}"):
        generate(bundle.model, token_ids((1, 4)), mask_id=bundle.mask_id, gen_length=16, steps=8,
                 block_length=4)  # fmt: skip
    with pytest.raises(ValueError, match="whole number of blocks"):
        block_diffusion_mask(None, (1, 12), 6, BLOCK)


def test_the_likelihoods_score_each_block_given_the_clean_blocks_before_it(loaded):
    """forward_logits with the clean completion as context, and through it mean-field and SML:
    block b's logits are those of the block-causal forward of [prompt, the clean blocks before
    b, block b as noised], computed alone (block diffusion's conditional, what the rollout saw)."""
    bundle = loaded["plain"]
    model, mask_id = bundle.model, bundle.mask_id
    prompt, attn = _padded(bundle, lengths=(5, 7))
    L = 3 * BLOCK
    clean = token_ids((2, L), 3)
    noised = clean.masked_fill(torch.rand(2, L, generator=torch.Generator().manual_seed(0)) < 0.5,
                               mask_id)  # fmt: skip
    ones = torch.ones(2, L, dtype=torch.long)

    def alone(completion_view):  # [2, L] -> block-by-block restatement [2, L, V]
        out = []
        for b in range(L // BLOCK):
            seq = torch.cat(
                [prompt, clean[:, : b * BLOCK], completion_view[:, b * BLOCK :][:, :BLOCK]], 1
            )
            am = torch.cat([attn, ones[:, : (b + 1) * BLOCK]], 1)
            out.append(model(seq, attention_mask=am).logits[:, -BLOCK:])
        return torch.cat(out, 1)

    with torch.no_grad():
        x = torch.cat([prompt, noised], 1)
        got = forward_logits(model, x, torch.cat([attn, ones], 1), last=L, context=clean)
        torch.testing.assert_close(got, alone(noised), **TOL)
        targets = clean[..., None]
        mf = mean_field_logp(model, prompt, clean, mask_id=mask_id, attention_mask=attn)
        want = alone(torch.full_like(clean, mask_id)).log_softmax(-1).gather(-1, targets)[..., 0]
        torch.testing.assert_close(mf, want, **TOL)
        strata = torch.arange(L).remainder(2).expand(2, L)  # two views: even and odd positions
        sml = stratified_logp(model, prompt, clean, mask_id=mask_id, attention_mask=attn,
                              num_strata=2, strata=strata)  # fmt: skip
        views = [alone(clean.masked_fill(strata == k, mask_id)).log_softmax(-1) for k in (0, 1)]
        want = torch.where(strata == 0, views[0].gather(-1, targets)[..., 0],
                           views[1].gather(-1, targets)[..., 0])  # fmt: skip
        torch.testing.assert_close(sml, want, **TOL)


def test_a_lora_step_trains_the_fused_attention_and_every_expert_it_routes_to(folders):
    bundle = load(str(folders["biased"]))
    assert lora_targets(bundle) == list(FAMILIES["llada2"].lora_targets)
    model = lora_adapted(bundle)
    ids = token_ids((2, 16))
    with torch.no_grad():
        before = forward_logits(model.eval(), ids)
    chosen = set()  # (layer, expert) the router sent a token to, in the training forward
    for name, module in model.named_modules():
        if name.endswith(".mlp.experts"):
            layer = int(name.split(".layers.")[1].split(".")[0])
            module.register_forward_hook(
                lambda _m, args, _o, layer=layer: chosen.update(
                    (layer, int(j)) for j in args[1].unique()
                )
            )
    hit = lora_sgd_step(model, ids)
    assert {n.rsplit(".", 1)[-1] for n in hit} == {
        "query_key_value", "dense", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    routed = {n.split(".layers.")[1] for n in hit if ".mlp.experts." in n}
    want = {
        f"{i}.mlp.experts.{j}.{p}" for i, j in chosen for p in ("gate_proj", "up_proj", "down_proj")
    }
    assert routed == want and {i for i, _ in chosen} == {0, 1}  # each layer routes somewhere
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        assert (forward_logits(model.eval(), ids) - before).abs().max() > 1e-3


def test_a_4bit_qlora_step_quantises_every_projection_and_trains_them(tmp_path):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from daca.models.loading import load_4bit
    from daca.models.quant import prepare_for_training

    # bitsandbytes packs 4-bit weights in blocks of 64: widths of 64.
    folder = write_llada2(tmp_path / "w64", hidden_size=64, expert_size=64, dense_size=64, seed=4)
    bundle = load_4bit(str(folder), device="cpu", dtype=torch.float32)
    four_bit = [n for n, m in bundle.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    # qkv and dense a layer; a dense MLP, then 4 experts and the shared one; the router stays
    assert len(four_bit) == 2 * 2 + 3 + (4 + 1) * 3
    bundle.model = prepare_for_training(bundle.model)
    hit = lora_sgd_step(lora_adapted(bundle), token_ids((2, 16)))
    assert {n for n in hit if ".mlp.experts." in n} and {n for n in hit if "query_key_value" in n}


def test_save_and_reload_keeps_logits_hub_keys_and_config(folders, loaded, tmp_path):
    for variant in ("plain", "tied"):
        out = save_pretrained(loaded[variant], tmp_path / variant)
        assert set(read_weights(out)) == set(read_weights(folders[variant]))  # hub names
        saved, original = config_of(out), config_of(folders[variant])
        assert {k: saved[k] for k in original if k != "torch_dtype"} == {
            k: v for k, v in original.items() if k != "torch_dtype"
        }
        ids = token_ids((1, 11))
        with torch.no_grad():
            want = loaded[variant].model(ids).logits
            torch.testing.assert_close(load(str(out)).model(ids).logits, want)


def test_special_ids_are_read_off_the_checkpoint_and_its_code_never_runs(folders, loaded):
    assert_moe_tokenizer_ids_and_no_remote_code(folders["plain"], loaded["plain"])


def test_llada2_1_and_a_moved_mask_id_load(tmp_path):
    folder = write_llada2(tmp_path, seed=2, model_type="llada21_moe", mask_token_id=156990)
    with pytest.warns(UserWarning, match="differ from the public llada2 checkpoints"):
        bundle = load(str(folder))
    assert bundle.family == "llada2" and bundle.mask_id == 156990
    ids = token_ids((1, 10))
    with torch.no_grad():
        got = bundle.model(ids).logits
    torch.testing.assert_close(
        got, oracle_logits(read_weights(folder), config_of(folder), ids), **TOL
    )


def test_daca_eval_runs_the_checkpoint_in_its_blocks(folders, tmp_path):
    out = tmp_path / "eval.jsonl"
    code = main(["eval", "--task", "sudoku", "--model", str(folders["plain"]), "--limit", "2",
                 "--device", "cpu", "--gen-length", "16", "--block-length", str(BLOCK),
                 "--cache", "dual", "--out", str(out)])  # fmt: skip
    assert code == 0 and len(out.read_text().splitlines()) == 2


def test_the_memory_plan_counts_the_clean_copy_of_the_update_s_forward(folders, monkeypatch):
    """The likelihoods' forward holds prompt, noised and clean completion: (T + L) / T the
    activations of a bidirectional model of the same shape."""
    import dataclasses

    from daca.tools import memory
    from daca.train.config import load_config

    cfg = load_config(None, [f"model={folders['plain']}", "generation.gen_length=64",
                             "generation.block_length=8"])  # fmt: skip
    shape, source = model_shape(cfg.model)
    assert shape.block_causal
    bidirectional = dataclasses.replace(shape, block_causal=False)
    ours = memory.estimate(cfg).update
    monkeypatch.setattr("daca.models.families.model_shape", lambda _: (bidirectional, source))
    theirs = memory.estimate(cfg).update
    key = next(k for k in ours if k.startswith("activations"))
    T = memory.PROMPT_TOKENS + 64
    assert ours[key] / theirs[key] == pytest.approx((T + 64) / T)


def test_the_memory_plan_counts_active_and_total_parameters(folders):
    shape, _ = model_shape(str(folders["plain"]))
    c = config_of(folders["plain"])
    d, f, E, k = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"], 2
    routed = E * 3 * d * f  # one MoE layer (the first is dense)
    assert shape.layers == 2 and shape.mlp == k * f
    assert shape.parameters - shape.active == routed * (E - k) // E
    assert len(shape.linears) == 2 * 2 + 3 + (E + 1) * 3


RECIPE = Path(__file__).resolve().parent.parent / "configs/paper/families/llada2-mini-gsm8k.yaml"


@pytest.mark.parametrize("recipe", [False, True], ids=["family targets", "the recipe's targets"])
def test_the_memory_plan_counts_the_adapters_peft_builds(recipe, folders):
    """Every projection (the family's default), or the shipped recipe's: attention, the dense
    layer's MLP and the shared expert, every routed expert frozen."""
    targets = load_config(RECIPE).lora.target_modules if recipe else None
    shape = assert_the_plan_counts_the_adapters_peft_builds(folders["plain"], targets)
    c = config_of(folders["plain"])
    routed = [name for name in shape.linear_names if ".experts." in name]
    shares = {seen for _, seen in shape.adapted(targets)}
    # Routed experts' adapters see top k / experts of the tokens (2 of the config's experts).
    assert shares == ({1.0} if recipe else {1.0, 2 / c["num_experts"]})
    assert len(shape.adapted(targets)) == len(shape.linears) - (len(routed) if recipe else 0)


@pytest.mark.parametrize(
    "change, said",
    [
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"n_group": 3}, "n_group=3"),
        ({"num_shared_experts": 0}, "num_shared_experts=0"),
        ({"use_sliding_window": True}, "use_sliding_window=True"),
        ({"moe_intermediate_size": None} | {"num_experts": None}, "lacks"),
    ],
)
def test_what_daca_does_not_run_is_one_line_before_any_weight_loads(change, said, tmp_path, capsys):
    folder = write_llada2(tmp_path / "m", seed=2)
    config = {k: v for k, v in (config_of(folder) | change).items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    for shard in folder.glob("*.safetensors"):
        shard.write_bytes(b"not weights: reading them would fail otherwise")
    code = main(["eval", "--task", "sudoku", "--model", str(folder), "--limit", "2",
                 "--device", "cpu", "--out", str(tmp_path / "e.jsonl")])  # fmt: skip
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and said in line and "llada2" in line
