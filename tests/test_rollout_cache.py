"""Fast rollouts (docs/rollouts.md): the block KV cache, parallel decoding, and the DPS trace."""

import pytest
import torch
import torch.nn.functional as F
from _hub_a2d import LLAMA3_ROPE_SCALING
from conftest import random_mlm
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from daca import dps
from daca.core.block_cache import BlockCache
from daca.core.sampler import generate
from daca.models.native import (
    A2DLlamaForDiffusionLM,
    A2DQwen2ForDiffusionLM,
    A2DQwen3ForDiffusionLM,
    DreamForDiffusionLM,
    a2d_config,
    qwen2_config,
)
from daca.models.tiny import new_tiny


@pytest.fixture(scope="module")
def llada():
    model, tok = new_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=3)
    return model, tok.mask_token_id, len(tok)


def _tiny_hub(model_type: str, **extra) -> dict:
    """A 2-layer, width-32 config.json on a 24-token vocabulary."""
    return dict(
        model_type=model_type,
        vocab_size=24,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        **extra,
    )


def dream():
    hub = _tiny_hub("Dream")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return DreamForDiffusionLM(qwen2_config(hub)).eval()


# dllm's A2D kinds: (model class, transformers config class, config.json extras). Qwen3 with
# its own q/k norms and an explicit head width; Qwen2 with q/k/v biases; Llama with Llama 3's
# RoPE scaling.
A2D = {
    "a2d-qwen3": (A2DQwen3ForDiffusionLM, Qwen3Config, dict(head_dim=24)),
    "a2d-qwen2": (A2DQwen2ForDiffusionLM, Qwen2Config, {}),
    "a2d-llama": (
        A2DLlamaForDiffusionLM,
        LlamaConfig,
        dict(
            rope_scaling=dict(LLAMA3_ROPE_SCALING),
            rope_theta=500000.0,
            max_position_embeddings=131072,
        ),
    ),
}


def a2d(kind):
    """An A2D model of ``A2D`` on a 24-token vocabulary, its head tied to the embedding."""
    model_class, config_class, extra = A2D[kind]
    hub = _tiny_hub(kind, tie_word_embeddings=True, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_class(a2d_config(config_class, hub)).eval()
        for name, p in model.named_parameters():
            # norms off their 1 start, Qwen2's biases off 0: a cache skipping one shows
            if name.endswith(("norm.weight", "_proj.bias")):
                p.data += 0.2 * torch.randn_like(p)
        return model


def model_of(family, llada):
    """(model, mask id, vocabulary) of a test family."""
    if family == "llada":
        return llada
    return (dream(), 23, 24) if family == "dream" else (a2d(family), 23, 24)


def left_padded(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.zeros(len(lengths), P, dtype=torch.long)
    mask = torch.zeros(len(lengths), P, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, P - n :] = torch.randint(4, vocab, (n,), generator=g)
        mask[b, P - n :] = 1
    return ids, mask


def partly_committed(V, mask_id):
    """Three left-padded prompts with a 12-token completion, some of it masked: (x, attention
    mask, P, L, block length 4, the generator for further draws)."""
    ids, mask = left_padded(V - 1, [3, 6, 5])
    P, L, bl = ids.shape[1], 12, 4
    g = torch.Generator().manual_seed(1)
    x = torch.cat([ids, torch.randint(4, V - 1, (3, L), generator=g)], 1)
    x[:, P + 5 :: 2] = mask_id
    attn = torch.cat([mask, torch.ones(3, L, dtype=torch.long)], 1)
    return x, attn, P, L, bl, g


def x_at(rollout, step, mask_id):
    """x_step rebuilt from the rollout: the prompt, tokens born before ``step``, masks elsewhere."""
    x = rollout.sequences.clone()
    comp = x[:, rollout.prompt_length :]
    comp[rollout.birth_step >= step] = mask_id
    return x


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("family", ["llada", "dream", *A2D])
def test_cached_block_step_equals_the_full_forward(llada, mode, family):
    """The cache machinery is exact: a block step on the cache of the same x gives the full
    forward's logits (padding, positions and, for Dream, the shift handled)."""
    model, mask_id, V = model_of(family, llada)
    x, attn, P, L, bl, g = partly_committed(V, mask_id)
    with torch.no_grad():
        full = model(x, attention_mask=attn).logits
        for c in range(L // bl):
            lo, hi = c * bl, (c + 1) * bl
            cache = BlockCache(model, mode, attn, P, P + L)
            refreshed = cache.refresh(x, lo, hi, L)
            torch.testing.assert_close(refreshed, full[:, P + lo :], atol=1e-5, rtol=1e-5)
            for _ in range(2):  # the cache is cropped back after each block step
                step = cache.block(x, lo, hi)
                torch.testing.assert_close(step, full[:, P + lo : P + hi], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_a_block_step_leaves_the_cache_as_the_refresh_left_it(llada, mode, family):
    """A block step writes its keys into the cache's slot for the block, never into what the
    refresh cached: after steps on other tokens, of all rows and of some, a step on x gives
    bit for bit what a fresh cache's first step on x gives."""
    model, mask_id, V = llada if family == "llada" else (dream(), 23, 24)
    x, attn, P, L, bl, g = partly_committed(V, mask_id)
    lo, hi = bl, 2 * bl
    other = x.clone()
    other[:, P + lo : P + hi] = torch.randint(4, V - 1, (3, bl), generator=g)
    with torch.no_grad():
        fresh = BlockCache(model, mode, attn, P, P + L)
        fresh.refresh(x, lo, hi, L)
        expected = fresh.block(x, lo, hi)
        used = BlockCache(model, mode, attn, P, P + L)
        used.refresh(x, lo, hi, L)
        kept = [(lay.keys[..., : lay.cached, :].clone(), lay.values[..., : lay.cached, :].clone())
                for lay in used.cache.layers]  # fmt: skip
        used.block(other, lo, hi)
        rows = torch.tensor([0, 2])
        part = used.block(other[rows], lo, hi, rows)
        assert torch.equal(part, used.block(other, lo, hi)[rows])
        assert torch.equal(used.block(x, lo, hi), expected)
        for lay, (keys, values) in zip(used.cache.layers, kept, strict=True):
            assert torch.equal(lay.keys[..., : lay.cached, :], keys)
            assert torch.equal(lay.values[..., : lay.cached, :], values)


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_every_refresh_rewrites_the_first_one_s_buffers(llada, mode, family):
    """A refresh copies its keys into the buffers the first refresh made (no new cache per
    refresh) and leaves nothing of an earlier block or input behind: a cache refreshed block
    after block, on changing tokens, steps bit for bit as a fresh cache of that block."""
    model, mask_id, V = llada if family == "llada" else (dream(), 23, 24)
    x, attn, P, L, bl, g = partly_committed(V, mask_id)
    reused = BlockCache(model, mode, attn, P, P + L)
    with torch.no_grad():
        for c in range(L // bl):
            lo, hi = c * bl, (c + 1) * bl
            x = x.clone()
            x[:, P + lo] = torch.randint(4, V - 1, (3,), generator=g)  # a new input each block
            reused.refresh(x, lo, hi, L)
            if c == 0:
                buffers = [t.data_ptr() for t in reused.keys + reused.values]
            fresh = BlockCache(model, mode, attn, P, P + L)
            fresh.refresh(x, lo, hi, L)
            assert torch.equal(reused.block(x, lo, hi), fresh.block(x, lo, hi))
            assert [t.data_ptr() for t in reused.keys + reused.values] == buffers
            slots = [lay.keys.data_ptr() for lay in reused.cache.layers]
            assert slots == buffers[: len(reused.keys)]


@pytest.mark.parametrize("cfg_scale", [0.0, 1.0])
def test_dual_refreshed_every_step_equals_none(llada, cfg_scale):
    model, mask_id, V = llada
    ids, mask = left_padded(V - 1, [4, 7])
    kw = dict(mask_id=mask_id, gen_length=12, steps=6, block_length=4, cfg_scale=cfg_scale)
    kw |= dict(temperature=0.8, dps_stride=1)
    none = generate(model, ids, mask, generator=torch.Generator().manual_seed(5), **kw)
    dual = generate(
        model, ids, mask, generator=torch.Generator().manual_seed(5), cache="dual", **kw
    )
    assert torch.equal(dual.sequences, none.sequences)
    assert torch.equal(dual.birth_step, none.birth_step)
    assert dual.forwards == {"full": 6, "block": 0}
    torch.testing.assert_close(dual.progress_logp, none.progress_logp, atol=1e-5, rtol=1e-5)
    assert torch.equal(dual.progress_mask, none.progress_mask)


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_recorded_steps_see_the_full_forward(llada, mode):
    """With a cache, l[j, n] is still log p(x*_n | x_{r_j}) from a full forward of x_{r_j}."""
    model, mask_id, V = llada
    ids, mask = left_padded(V - 1, [5, 3])
    P, L, T, s = ids.shape[1], 16, 16, 3
    out = generate(
        model, ids, mask, mask_id=mask_id, gen_length=L, steps=T, block_length=8,
        cache=mode, dps_stride=s,
    )  # fmt: skip
    # refreshes at the block starts 0, 8 and the recorded steps 0, 3, 6, 9, 12, 15
    assert out.forwards == {"full": 7, "block": 9}
    attn = torch.cat([mask, torch.ones(2, L, dtype=torch.long)], 1)
    for j, r in enumerate(range(0, T, s)):
        x = x_at(out, r, mask_id)
        assert torch.equal(out.progress_mask[:, j], x[:, P:] == mask_id)
        with torch.no_grad():
            logp = F.log_softmax(model(x, attention_mask=attn).logits[:, P:].float(), -1)
        expected = logp.gather(-1, out.completion_ids[..., None]).squeeze(-1)
        held = out.progress_mask[:, j]
        torch.testing.assert_close(
            out.progress_logp[:, j][held], expected[held], atol=1e-5, rtol=1e-5
        )


def test_cache_counts_match_the_cost_model(llada):
    model, mask_id, V = llada
    ids, mask = left_padded(V - 1, [4, 4])
    kw = dict(mask_id=mask_id, gen_length=16, steps=16, block_length=4)
    for mode in ("prefix", "dual"):
        plain = generate(model, ids, mask, cache=mode, **kw)
        assert plain.forwards == {"full": 4, "block": 12}  # one refresh per block
        traced = generate(model, ids, mask, cache=mode, dps_stride=2, **kw)
        assert traced.forwards == {"full": 8, "block": 8}  # a refresh per recorded step
    none = generate(model, ids, mask, **kw)
    assert none.forwards == {"full": 16, "block": 0}


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_refresh_every_step_equals_none(llada, mode):
    """refresh_every=1 refreshes at every step: the cache changes no token, in one long block."""
    model, mask_id, V = llada
    ids, mask = left_padded(V - 1, [4, 7])
    kw = dict(mask_id=mask_id, gen_length=12, steps=6, block_length=12, temperature=0.8)
    none = generate(model, ids, mask, generator=torch.Generator().manual_seed(5), **kw)
    cached = generate(
        model, ids, mask, generator=torch.Generator().manual_seed(5), cache=mode,
        refresh_every=1, **kw,
    )  # fmt: skip
    assert torch.equal(cached.sequences, none.sequences)
    assert torch.equal(cached.birth_step, none.birth_step)
    assert cached.forwards == {"full": 6, "block": 0}


def test_refresh_every_counts(llada):
    """Refreshes at block starts, every n-th step of a block and recorded steps, no more."""
    model, mask_id, V = llada
    ids, mask = left_padded(V - 1, [4, 4])
    kw = dict(mask_id=mask_id, gen_length=16, steps=16, block_length=8, cache="dual")
    # 2 blocks of 8 steps; n = 3 refreshes at i = 0, 3, 6 of each block
    assert generate(model, ids, mask, refresh_every=3, **kw).forwards == {"full": 6, "block": 10}
    # with s = 4 the recorded steps 0, 4, 8, 12 add i = 4 of each block (i = 0 is one already)
    out = generate(model, ids, mask, refresh_every=3, dps_stride=4, **kw)
    assert out.forwards == {"full": 8, "block": 8}


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("family", ["llada", "dream", *A2D])
def test_suffix_refresh_is_exact_on_an_unchanged_prefix(llada, mode, family):
    """A suffix refresh recomputes the block and its suffix against the cached prefix: on the
    x of the last full refresh it gives the full forward's logits, and the dual cache it leaves
    gives the full forward's logits at the next block step (also after tokens change there)."""
    model, mask_id, V = model_of(family, llada)
    x, attn, P, L, bl, g = partly_committed(V, mask_id)
    with torch.no_grad():
        full = model(x, attention_mask=attn).logits
        lo, hi = bl, 2 * bl
        cache = BlockCache(model, mode, attn, P, P + L)
        cache.refresh(x, lo, hi, L)
        part = cache.refresh_suffix(x, lo, hi, L)
        torch.testing.assert_close(part, full[:, P + lo :], atol=1e-5, rtol=1e-5)
        step = cache.block(x, lo, hi)
        torch.testing.assert_close(step, full[:, P + lo : P + hi], atol=1e-5, rtol=1e-5)
        # the suffix changes after the full refresh: a suffix refresh sees the new tokens, and
        # a dual block step then reads the suffix keys it stored (the same block logits)
        y = x.clone()
        y[:, P + hi :] = torch.randint(4, V - 1, (3, L - hi), generator=g)
        part = cache.refresh_suffix(y, lo, hi, L)
        assert not torch.allclose(part, full[:, P + lo :], atol=1e-3)
        if mode == "dual":
            step = cache.block(y, lo, hi)
            torch.testing.assert_close(step, part[:, :bl], atol=1e-5, rtol=1e-5)


def test_suffix_refresh_counts_and_keeps_the_trace_masks(llada):
    """trace_refresh="suffix": recorded steps that are not block starts run a suffix forward;
    the trace records the same positions (the masks are the sampler's, not the cache's)."""
    model, mask_id, V = llada
    ids, mask = left_padded(V - 1, [5, 3])
    kw = dict(mask_id=mask_id, gen_length=16, steps=16, block_length=8, dps_stride=2)
    out = generate(model, ids, mask, cache="dual", trace_refresh="suffix", **kw)
    # blocks start at steps 0 and 8 (both recorded); recorded 2, 4, 6, 10, 12, 14 are suffix
    assert out.forwards == {"full": 2, "block": 8, "suffix": 6}
    assert out.progress_mask.shape[1] == 8
    for j, r in enumerate(range(0, 16, 2)):
        x = x_at(out, r, mask_id)
        assert torch.equal(out.progress_mask[:, j], x[:, ids.shape[1] :] == mask_id)


def test_a_model_without_a_cache_is_named():
    with pytest.raises(ValueError, match="ModernBertForMaskedLM"):
        generate(
            random_mlm(32), torch.ones(1, 3, dtype=torch.long), mask_id=31, gen_length=4,
            steps=2, block_length=4, cache="dual",
        )  # fmt: skip


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(cache="kv"), "cache: .kv. is not one of"),
        (dict(cache="dual", refresh_every=0), "refresh_every"),
        (dict(cache="dual", trace_refresh="prefix"), "trace_refresh"),
        (dict(parallel_threshold=1.5), "parallel_threshold"),
        (dict(parallel_threshold=0.9, remasking="random"), "low_confidence"),
        (dict(parallel_threshold=0.9, dps_stride=2, dps_scope="block"), "fixed schedule"),
    ],
)
def test_invalid_fast_rollout_arguments(kw, message):
    args = dict(mask_id=31, gen_length=8, steps=4, block_length=4) | kw
    with pytest.raises(ValueError, match=message):
        generate(random_mlm(32), torch.ones(1, 3, dtype=torch.long), **args)


@pytest.mark.parametrize("stride", [4, 6])
def test_a_single_recorded_step_is_rejected(stride):
    with pytest.raises(ValueError, match=rf"dps_stride={stride} >= steps=4 records a single"):
        generate(
            random_mlm(32), torch.ones(1, 3, dtype=torch.long), mask_id=31, gen_length=8,
            steps=4, block_length=4, dps_stride=stride,
        )  # fmt: skip


def test_threshold_one_follows_the_schedule_and_zero_commits_a_block_per_step(llada):
    model, mask_id, V = llada
    ids, mask = left_padded(V - 1, [4, 6, 2])
    kw = dict(mask_id=mask_id, gen_length=12, steps=6, block_length=4)  # schedule 2 + 2
    none = generate(model, ids, mask, **kw)
    strict = generate(model, ids, mask, parallel_threshold=1.0, **kw)
    assert torch.equal(strict.sequences, none.sequences)
    assert torch.equal(strict.birth_step, none.birth_step)
    assert strict.steps_taken.tolist() == [6, 6, 6]
    greedy = generate(model, ids, mask, parallel_threshold=0.0, **kw)
    assert greedy.steps_taken.tolist() == [3, 3, 3]
    assert torch.equal(
        greedy.birth_step, torch.arange(12).div(4, rounding_mode="floor").repeat(3, 1)
    )


def assert_each_row_as_alone(model, ids, mask, batch, **kw):
    """Each row of ``batch`` (left-padded ``ids``) has the tokens, births (own clock) and trace
    it gets when generated alone."""
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        alone = generate(model, ids[b : b + 1, -n:], **kw)
        assert torch.equal(alone.completion_ids[0], batch.completion_ids[b])
        assert torch.equal(alone.birth_step[0], batch.birth_step[b])
        R = alone.recorded_steps.numel()
        assert (int(batch.steps_taken[b]) - 1) // kw["dps_stride"] + 1 == R
        torch.testing.assert_close(
            alone.progress_logp[0], batch.progress_logp[b, :R], atol=1e-5, rtol=1e-5
        )
        assert batch.progress_logp[b, R:].isnan().all() and not batch.progress_mask[b, R:].any()
        torch.testing.assert_close(alone.last_logp[0], batch.last_logp[b], atol=1e-5, rtol=1e-5)
        assert torch.equal(alone.last_mask[0], batch.last_mask[b])


@pytest.mark.parametrize(
    "fast",
    [
        {},
        dict(cache="prefix"),
        dict(cache="dual"),
        dict(cache="dual", trace_refresh="suffix", refresh_every=3),
        dict(cache="dual", cfg_scale=1.5),
        dict(cache="dual", family="dream"),
    ],
    ids=["none", "prefix", "dual", "dual-suffix", "dual-cfg", "dream-dual"],
)
def test_parallel_rows_keep_their_own_clock_and_trace(llada, fast):
    """Each row's tokens, births (own clock) and trace are those it gets alone, and only the rows
    still decoding a block run through a forward (a finished row's cache keeps its keys)."""
    fast = dict(fast)
    model, mask_id, V = llada if fast.pop("family", "llada") == "llada" else (dream(), 23, 24)
    ids, mask = left_padded(V - 1, [4, 6, 2, 5], seed=2)
    kw = dict(mask_id=mask_id, gen_length=16, steps=16, block_length=8, dps_stride=2) | fast
    batch = generate(model, ids, mask, parallel_threshold=0.05, **kw)
    taken = batch.steps_taken
    assert (taken <= 16).all() and (batch.birth_step < taken[:, None]).all()
    assert len(set(taken.tolist())) > 1, "the test needs rows of different lengths"
    assert batch.rows_forwarded == int(taken.sum()) < 4 * sum(batch.forwards.values())
    assert_each_row_as_alone(model, ids, mask, batch, parallel_threshold=0.05, **kw)
    mult = dps.rollout_multipliers(batch, lam=0.5, last_step="measured")
    assert mult.isfinite().all()


def test_parallel_rows_on_their_own_clocks_run_the_forward_they_run_alone():
    """Under parallel decoding rows fall out of step, so at one step some are recorded (a cache
    refresh) and others not (a block step): each group runs its own forward, and every row's
    tokens, births and trace are those it gets alone."""
    model, tok = new_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=3)
    with torch.no_grad():  # confident enough that rows commit a varying number per step
        model.lm_head.weight.mul_(20)
    V, mask_id, bl = len(tok), tok.mask_token_id, 8
    ids, mask = left_padded(V - 1, [4, 6, 2, 5], seed=0)
    kw = dict(mask_id=mask_id, gen_length=32, steps=32, block_length=bl, dps_stride=2, cache="dual")
    batch = generate(model, ids, mask, parallel_threshold=0.25, **kw)
    births = batch.birth_step.view(4, -1, bl)  # each step commits at least one: steps per block
    per_block = births.amax(-1) - births.amin(-1) + 1  # [B, blocks]
    assert torch.equal(per_block.sum(1), batch.steps_taken)
    batch_steps = int(per_block.amax(0).sum())
    assert sum(batch.forwards.values()) > batch_steps, "no step split its rows"
    assert batch.rows_forwarded == int(batch.steps_taken.sum())
    assert_each_row_as_alone(model, ids, mask, batch, parallel_threshold=0.25, **kw)


def test_ragged_deltas_and_normalisation_by_hand():
    # Row 0 took 4 steps (r = 0, 2 reached), row 1 took 2 (only r_0), row 2 took 3 (r_0, r_1).
    logp = torch.tensor(
        [
            [[-2.0, -3.0], [-1.0, -1.0]],
            [[-1.0, -4.0], [0.0, 0.0]],
            [[-3.0, -3.0], [-1.5, -2.5]],
        ]
    )
    mask = torch.tensor([[[1, 1], [0, 1]], [[1, 1], [0, 0]], [[1, 1], [1, 1]]], dtype=torch.bool)
    logp[1, 1] = float("nan")  # the sampler's marker: row 1 never reached r_1
    steps = torch.tensor([0, 2])
    taken = torch.tensor([4, 2, 3])
    # row 0: delta_0 on {1}: -1 - (-3) = 2; row 2: on {0, 1}: (1.5 + 0.5) / 2 = 1
    # last (extrapolate): row 0, 2 copy delta_0; row 1 (m = 0) has none: 0; row 1 has no j = 1
    for num_steps in (taken, 4):  # per-row steps, or the budget with the NaN marker
        d = dps.progress_deltas(
            logp, mask, "extrapolate", recorded_steps=steps, num_steps=num_steps
        )
        assert d[:, 0].tolist() == [2.0, 0.0, 1.0] and d[[0, 2], 1].tolist() == [2.0, 1.0]
        assert d[1, 1].isnan()
    raw = dps.progress_deltas(logp, mask, "raw", recorded_steps=steps, num_steps=taken)
    assert raw[1, 0] == -2.5 and raw[0, 1] == -1.0  # S(m_b, m_b) at each row's own m_b
    d = dps.progress_deltas(logp, mask, "extrapolate", recorded_steps=steps, num_steps=taken)
    # per step: j = 0 over all three rows (mu 1, sigma sqrt(2/3)); j = 1 over rows 0, 2 only
    # (mu 1.5, sigma 0.5), not over a delta of 0 for row 1
    z = dps.normalize(d, "per_step", eps=0.0)
    torch.testing.assert_close(z[:, 0], torch.tensor([1.0, -1.0, 0.0]) / (2 / 3) ** 0.5)
    torch.testing.assert_close(z[[0, 2], 1], torch.tensor([1.0, -1.0]))
    assert z[1, 1].isnan()
    mult = dps.token_multipliers(z, torch.tensor([[0, 3], [1, 0], [2, 1]]), steps, lam=1.0)
    assert mult.isfinite().all() and mult[1].tolist() == pytest.approx([1 - (1.5) ** 0.5] * 2)


def test_block_scope_intervals_across_blocks_carry_progress():
    """Stride 4 with 4 steps per block: every interval crosses a block; its delta was 0."""
    model = random_mlm(32, seed=1)
    g = torch.Generator().manual_seed(0)
    out = generate(
        model, torch.randint(1, 31, (4, 3), generator=g), mask_id=31, gen_length=16, steps=16,
        block_length=4, temperature=1.0, generator=g, dps_stride=4, dps_scope="block",
    )  # fmt: skip
    # each r_j = 4j is a block start; the next recorded state's block is recorded too
    assert out.progress_mask[:, :-1, 4:].any(-1).all()
    deltas = dps.progress_deltas(out.progress_logp, out.progress_mask, "neutral")
    assert (deltas[:, :-1] != 0).all()
    mult = dps.rollout_multipliers(out, lam=0.5)
    assert not torch.all(mult == 1)
