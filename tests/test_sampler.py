"""The sampler (METHOD.md §1) and its DPS trace (METHOD.md §2)."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import random_mlm

from daca.core.sampler import generate, top_confidence_mask, transfer_schedule

V, MASK, PAD = 32, 31, 0


@pytest.fixture(autouse=True)
def _one_thread(_few_threads):
    """Tiny models: one thread is faster than two on a shared CPU (conftest resets it per test)."""
    torch.set_num_threads(1)


class Recorded:
    """A model that never predicts the mask token (as a trained one) and records each call."""

    def __init__(self, seed=0):
        self.model = random_mlm(V, seed=seed)
        self.inputs, self.logits = [], []

    def __call__(self, input_ids, attention_mask=None):
        logits = self.model(input_ids, attention_mask=attention_mask).logits
        logits = logits.masked_fill(torch.arange(V) == MASK, -1e4)
        self.inputs.append(input_ids.clone())
        self.logits.append(logits.clone())
        return logits


def prompts(batch, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, MASK, (batch, length), generator=g)


def llada_reference(model, prompt, *, gen_length, steps, block_length, cfg_scale=0.0):
    """LLaDA's `generate` restated (temperature 0, low_confidence, full-sequence logits and
    float64 softmax every step, per-row topk); returns x_T and the step committing each position."""
    B, P = prompt.shape
    x = torch.full((B, P + gen_length), MASK)
    x[:, :P] = prompt
    prompt_index = x != MASK
    birth = torch.full((B, gen_length), -1)
    num_blocks = gen_length // block_length
    k = steps // num_blocks
    t = 0
    for nb in range(num_blocks):
        n = (x[:, P + nb * block_length : P + (nb + 1) * block_length] == MASK).sum(1).tolist()
        for i in range(k):
            mask_index = x == MASK
            if cfg_scale > 0:
                un = x.clone()
                un[prompt_index] = MASK
                cond, uncond = model(torch.cat([x, un])).chunk(2)
                logits = uncond + (cfg_scale + 1) * (cond - uncond)
            else:
                logits = model(x)
            x0 = logits.argmax(-1)
            x0_p = F.softmax(logits.double(), -1).gather(-1, x0[..., None]).squeeze(-1)
            x0_p[:, P + (nb + 1) * block_length :] = -math.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -math.inf)
            for b in range(B):
                count = n[b] // k + (1 if i < n[b] % k else 0)
                sel = confidence[b].topk(count).indices
                x[b, sel] = x0[b, sel]
                birth[b, sel - P] = t
            t += 1
    return x, birth


def guided(model, step, cfg_scale, batch):
    logits = model.logits[step]
    if cfg_scale == 0:
        return logits
    cond, uncond = logits[:batch], logits[batch:]
    return uncond + (cfg_scale + 1) * (cond - uncond)


def test_transfer_schedule_by_hand():
    assert transfer_schedule(torch.tensor([10, 2, 4]), 4).tolist() == [
        [3, 3, 2, 2],
        [1, 1, 0, 0],
        [1, 1, 1, 1],
    ]


def test_top_confidence_mask_per_row_counts():
    confidence = torch.tensor([[0.1, 0.5, -math.inf, 0.3], [0.9, 0.2, 0.4, -math.inf]])
    assert top_confidence_mask(confidence, [2, 1]).tolist() == [
        [False, True, False, True],
        [True, False, False, False],
    ]
    assert top_confidence_mask(confidence, [1, 1]).tolist() == [
        [False, True, False, False],
        [True, False, False, False],
    ]


@pytest.mark.parametrize(
    "gen_length,steps,block_length,cfg_scale",
    [(12, 6, 4, 0.0), (12, 12, 4, 0.0), (16, 4, 8, 0.0), (12, 6, 4, 1.5), (8, 12, 4, 0.5)],
)
def test_matches_llada_reference(gen_length, steps, block_length, cfg_scale):
    model = Recorded()
    prompt = prompts(3, 5)
    kw = dict(gen_length=gen_length, steps=steps, block_length=block_length, cfg_scale=cfg_scale)
    ref_x, ref_birth = llada_reference(model, prompt, **kw)
    out = generate(model, prompt, mask_id=MASK, **kw)
    assert torch.equal(out.sequences, ref_x)
    assert torch.equal(out.birth_step, ref_birth)
    assert torch.equal(out.completion_ids, ref_x[:, 5:])
    assert out.prompt_length == 5 and out.num_steps == steps
    # with the trace recorded the tokens and their order do not change
    traced = generate(model, prompt, mask_id=MASK, dps_stride=3, **kw)
    assert torch.equal(traced.sequences, ref_x) and torch.equal(traced.birth_step, ref_birth)


@pytest.mark.parametrize("gen_length,steps,block_length", [(12, 6, 4), (8, 12, 4), (10, 5, 10)])
def test_each_position_committed_once_on_schedule(gen_length, steps, block_length):
    out = generate(
        Recorded(),
        prompts(2, 3),
        mask_id=MASK,
        gen_length=gen_length,
        steps=steps,
        block_length=block_length,
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    birth = out.birth_step
    assert birth.min() >= 0 and birth.max() < steps and (out.completion_ids != MASK).all()
    k = steps // (gen_length // block_length)
    expected = transfer_schedule(torch.tensor([block_length]), k)[0].repeat(steps // k)
    for b in range(2):
        assert torch.equal(torch.bincount(birth[b], minlength=steps), expected)
        # a position is born inside its own block's steps
        block = torch.arange(gen_length) // block_length
        assert torch.equal(birth[b] // k, block)


def test_birth_step_is_when_the_token_appears():
    model = Recorded()
    P, L, T = 4, 12, 6
    out = generate(model, prompts(2, P), mask_id=MASK, gen_length=L, steps=T, block_length=4)
    inputs = torch.stack(model.inputs + [out.sequences])[:, :, P:]  # x_0 .. x_T
    assert len(model.inputs) == T and (inputs[0] == MASK).all()
    unmasked = inputs != MASK
    # committed tokens never change nor return to the mask
    assert (unmasked[1:] >= unmasked[:-1]).all()
    assert (inputs[1:][unmasked[:-1]] == inputs[:-1][unmasked[:-1]]).all()
    first_visible = unmasked.long().argmax(0)  # first t with position unmasked in x_t
    assert torch.equal(first_visible - 1, out.birth_step)


@pytest.mark.parametrize("cfg_scale", [0.0, 1.0])
def test_left_padding_matches_one_by_one(cfg_scale):
    model = Recorded()
    lengths = [2, 5, 3]
    P = max(lengths)
    rows = [prompts(1, n, seed=n)[0] for n in lengths]
    prompt = torch.full((3, P), PAD)
    mask = torch.zeros(3, P, dtype=torch.long)
    for b, r in enumerate(rows):
        prompt[b, P - len(r) :] = r
        mask[b, P - len(r) :] = 1
    kw = dict(mask_id=MASK, gen_length=8, steps=4, block_length=4, cfg_scale=cfg_scale)
    batched = generate(model, prompt, mask, **kw)
    for b, r in enumerate(rows):
        single = generate(model, r[None], **kw)
        assert torch.equal(batched.completion_ids[b], single.completion_ids[0])
        assert torch.equal(batched.birth_step[b], single.birth_step[0])


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_same_seed_same_rollout(remasking):
    model = Recorded()
    prompt = prompts(2, 4)

    def run(seed):
        return generate(
            model,
            prompt,
            mask_id=MASK,
            gen_length=16,
            steps=8,
            block_length=8,
            temperature=1.0,
            remasking=remasking,
            generator=torch.Generator().manual_seed(seed),
        )

    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.birth_step, b.birth_step)
    assert not (torch.equal(a.sequences, c.sequences) and torch.equal(a.birth_step, c.birth_step))


def test_random_remasking_commits_argmax_in_random_order():
    prompt = prompts(2, 4)
    kw = dict(mask_id=MASK, gen_length=8, steps=8, block_length=8, remasking="random")
    model = Recorded()
    a = generate(model, prompt, generator=torch.Generator().manual_seed(0), **kw)
    b = generate(Recorded(), prompt, generator=torch.Generator().manual_seed(1), **kw)
    assert not torch.equal(a.birth_step, b.birth_step)
    # temperature 0: each token is the argmax of the logits at the step that committed it
    for row in range(2):
        for n in range(8):
            step = a.birth_step[row, n]
            assert a.completion_ids[row, n] == model.logits[step][row, 4 + n].argmax()


@pytest.mark.parametrize("scope", ["all", "block"])
@pytest.mark.parametrize(
    "gen_length,steps,block_length,stride,cfg_scale,temperature",
    [
        (12, 6, 4, 1, 0.0, 0.0),
        (12, 12, 4, 4, 0.0, 0.9),
        (12, 6, 4, 4, 1.0, 0.9),
        (8, 12, 4, 5, 0.0, 0.0),  # blocks commit 0 on some steps, M_{T-1} empty
        (16, 8, 8, 3, 0.5, 0.0),
    ],
)
def test_trace_matches_per_step_log_softmax(
    scope, gen_length, steps, block_length, stride, cfg_scale, temperature
):
    model = Recorded()
    B, P = 2, 3
    prompt = prompts(B, P)
    kw = dict(
        mask_id=MASK,
        gen_length=gen_length,
        steps=steps,
        block_length=block_length,
        temperature=temperature,
        cfg_scale=cfg_scale,
    )
    plain = generate(model, prompt, generator=torch.Generator().manual_seed(3), **kw)
    model.inputs.clear(), model.logits.clear()
    out = generate(
        model,
        prompt,
        generator=torch.Generator().manual_seed(3),
        dps_stride=stride,
        dps_scope=scope,
        **kw,
    )
    assert torch.equal(out.sequences, plain.sequences)
    assert torch.equal(out.birth_step, plain.birth_step)
    assert torch.equal(out.recorded_steps, torch.arange(0, steps, stride))
    assert out.progress_logp.dtype == torch.float32 and out.progress_logp.shape == (
        B,
        len(range(0, steps, stride)),
        gen_length,
    )
    k = steps // (gen_length // block_length)
    x_star = out.completion_ids
    block_of = torch.arange(gen_length) // block_length
    for j, r in enumerate(range(0, steps, stride)):
        masked = model.inputs[r][:B, P:] == MASK
        if scope == "block":  # the block of r_j and that of the next recorded state
            masked &= (block_of == r // k) | (block_of == min(r + stride, steps - 1) // k)
        assert torch.equal(out.progress_mask[:, j], masked)
        logp = F.log_softmax(guided(model, r, cfg_scale, B)[:, P:].float(), -1)
        expected = logp.gather(-1, x_star[..., None]).squeeze(-1)
        torch.testing.assert_close(
            out.progress_logp[:, j][masked], expected[masked], atol=1e-5, rtol=1e-5
        )
        assert (out.progress_logp[:, j][~masked] == 0).all()
    last_masked = model.inputs[steps - 1][:B, P:] == MASK
    assert torch.equal(out.last_mask, last_masked)
    logp = F.log_softmax(guided(model, steps - 1, cfg_scale, B)[:, P:].float(), -1)
    expected = logp.gather(-1, x_star[..., None]).squeeze(-1)
    torch.testing.assert_close(out.last_logp[last_masked], expected[last_masked])
    assert (out.last_logp[~last_masked] == 0).all()


def live_rows(gen_length, steps, block_length, stride, scope):
    """Per sequence, after each step t: the rows the trace needs (live) and an upper bound on those
    held (live + the halving slack in the current block), from the uniform schedule."""
    k = steps // (gen_length // block_length)
    per_step = transfer_schedule(torch.tensor([block_length]), k)[0].tolist()
    masked_block, out = block_length, []
    for t in range(steps):
        i = t % k
        masked_block = block_length if i == 0 else masked_block
        masked_block -= per_step[i]
        later = gen_length - (t // k + 1) * block_length
        if scope == "all":
            snaps, masked = t // stride + 1, masked_block + later
        else:
            snaps = len([r for r in range(t - i, t + 1) if r % stride == 0])
            masked = masked_block
        out.append((snaps * masked, snaps * masked + snaps * masked_block))
    return out


@pytest.mark.parametrize("scope", ["all", "block"])
@pytest.mark.parametrize("steps,stride", [(16, 2), (16, 4), (8, 3)])
def test_trace_memory_is_bounded(scope, steps, stride):
    B, L, bl = 2, 16, 8
    out = generate(
        Recorded(),
        prompts(B, 3),
        mask_id=MASK,
        gen_length=L,
        steps=steps,
        block_length=bl,
        dps_stride=stride,
        dps_scope=scope,
    )
    row_bytes = V * 4 + 4  # a float32 logits row and its logsumexp
    bounds = live_rows(L, steps, bl, stride, scope)
    groups = (L // bl) * len(range(0, steps, stride))
    lower = B * row_bytes * max(lo for lo, _ in bounds)
    upper = B * row_bytes * max(hi for _, hi in bounds) + groups * B * bl * 8
    assert lower <= out.trace_peak_bytes <= upper
    if scope == "block":  # block_length x snapshots-per-block rows per sequence, + index
        k = steps // (L // bl)
        snaps = math.ceil(k / stride)
        assert out.trace_peak_bytes <= B * bl * snaps * (row_bytes + 8)


def test_model_mode_is_left_alone():
    model = random_mlm(V)
    model.train()
    generate(model, prompts(1, 3), mask_id=MASK, gen_length=4, steps=2, block_length=4)
    assert model.training
    model.eval()
    generate(model, prompts(1, 3), mask_id=MASK, gen_length=4, steps=2, block_length=4)
    assert not model.training


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(gen_length=10, steps=4, block_length=4), "divisible by block_length"),
        (dict(gen_length=8, steps=3, block_length=4), "divisible by the number of blocks"),
        (dict(remasking="top_p"), "remasking"),
        (dict(dps_stride=2, dps_scope="sequence"), "dps_scope"),
        (dict(dps_stride=0), "dps_stride"),
        (dict(temperature=-1.0), "temperature"),
        (dict(steps=0), ">= 1"),
    ],
)
def test_invalid_arguments(kw, message):
    args = dict(mask_id=MASK, gen_length=8, steps=4, block_length=4) | kw
    with pytest.raises(ValueError, match=message):
        generate(Recorded(), prompts(1, 3), **args)
