"""DPS (METHOD.md §2) on a trace worked out by hand, plus invariants and reference loops."""

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import random_mlm

from daca import dps, generate

NAN = float("nan")
EPS = 1e-6

# ---------------------------------------------------------------------------------------------
# The hand trace: B = 2, L = 4, T = 6 steps (t = 0..5), stride 2 -> recorded r = [0, 2, 4] (R = 3).
# Entries where the mask is False hold NaN: they are meaningless and must never leak.
#
# Sequence 0 ("all" scope): births [1, 3, 5, 4]; M_0 = {0,1,2,3}, M_2 = {1,2,3}, M_4 = {2,3},
#   M_5 = {2} (state x_{T-1}).
# Sequence 1 ("block" scope, blocks {0,1} | {2,3}, 3 steps each): births [0, 2, 3, 5];
#   recorded at r=0: block 0 masked {0,1}; r=2: block 0 still masked {1}; r=4: block 1 masked {3};
#   M_5 = {3}. Intervals 0->1 share {1}; 1->2 share nothing (empty intersection -> delta 0).
# ---------------------------------------------------------------------------------------------
RECORDED = torch.tensor([0, 2, 4])
BIRTH = torch.tensor([[1, 3, 5, 4], [0, 2, 3, 5]])
LOGP = torch.tensor(
    [
        [[-4.0, -3.0, -2.0, -2.0], [NAN, -2.0, -1.5, -0.5], [NAN, NAN, -1.0, -0.5]],
        [[-1.0, -3.0, NAN, NAN], [NAN, -1.0, NAN, NAN], [NAN, NAN, NAN, -2.0]],
    ]
)
MASK = torch.tensor(
    [
        [[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]],
        [[1, 1, 0, 0], [0, 1, 0, 0], [0, 0, 0, 1]],
    ],
    dtype=torch.bool,
)
LAST_LOGP = torch.tensor([[NAN, NAN, -0.25, NAN], [NAN, NAN, NAN, -1.5]])
LAST_MASK = torch.tensor([[0, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
NUM_STEPS = 6

# Inner intervals (same for every mode):
#   seq 0, delta_0 on {1,2,3}: ((-2+3) + (-1.5+2) + (-0.5+2)) / 3 = (1 + 0.5 + 1.5) / 3 = 1
#   seq 0, delta_1 on {2,3}:   ((-1+1.5) + (-0.5+0.5)) / 2 = (0.5 + 0) / 2 = 0.25
#   seq 1, delta_0 on {1}:     -1 - (-3) = 2
#   seq 1, delta_1 on {}:      0 (no evidence)
# Last interval (j = 2):
#   extrapolate: delta_1 -> 0.25 | 0
#   neutral:     0 | 0
#   raw:         S(2,2): (-1 - 0.5) / 2 = -0.75 | -2
#   mean:        (1 + 0.25) / 2 = 0.625 | (2 + 0) / 2 = 1
#   measured:    on last_mask & M_4: seq 0 {2}: -0.25 - (-1) = 0.75 | seq 1 {3}: -1.5 - (-2) = 0.5
HAND_DELTAS = {
    "extrapolate": [[1.0, 0.25, 0.25], [2.0, 0.0, 0.0]],
    "neutral": [[1.0, 0.25, 0.0], [2.0, 0.0, 0.0]],
    "raw": [[1.0, 0.25, -0.75], [2.0, 0.0, -2.0]],
    "mean": [[1.0, 0.25, 0.625], [2.0, 0.0, 1.0]],
    "measured": [[1.0, 0.25, 0.75], [2.0, 0.0, 0.5]],
}
# J(n) = max{j : r_j <= birth(n)} with r = [0, 2, 4]:
#   seq 0 births [1, 3, 5, 4] -> [0, 1, 2, 2] (between, between, after r_m, on r_m)
#   seq 1 births [0, 2, 3, 5] -> [0, 1, 1, 2] (on r_0, on r_1, between, after r_m)
HAND_J = [[0, 1, 2, 2], [0, 1, 1, 2]]


def deltas_of(mode, **kw):
    trace = dict(last_logp=LAST_LOGP, last_mask=LAST_MASK, recorded_steps=RECORDED)
    return dps.progress_deltas(LOGP, MASK, mode, **(trace | {"num_steps": NUM_STEPS} | kw))


@pytest.mark.parametrize("mode", dps.LAST_STEP_MODES)
def test_hand_trace_deltas(mode):
    got = deltas_of(mode)
    assert got.dtype == torch.float32 and not torch.isnan(got).any()
    torch.testing.assert_close(got, torch.tensor(HAND_DELTAS[mode]), rtol=0, atol=1e-7)


def test_measured_falls_back_to_extrapolate_when_last_recorded_is_last_step():
    # With T = 5 the last recorded step r_2 = 4 is x_{T-1} itself.
    got = dps.progress_deltas(
        LOGP, MASK, "measured", last_logp=LAST_LOGP, last_mask=LAST_MASK,
        recorded_steps=RECORDED, num_steps=5,
    )  # fmt: skip
    torch.testing.assert_close(got, torch.tensor(HAND_DELTAS["extrapolate"]))


def test_measured_needs_its_inputs():
    with pytest.raises(ValueError, match="measured"):
        dps.progress_deltas(LOGP, MASK, "measured")
    with pytest.raises(ValueError, match="beyond"):
        deltas_of("measured", num_steps=4)  # r_m = 4 > T-1 = 3


def test_bad_arguments():
    with pytest.raises(ValueError, match="last_step"):
        dps.progress_deltas(LOGP, MASK, "bogus")
    with pytest.raises(ValueError, match="B, R, L"):
        dps.progress_deltas(LOGP[0], MASK[0])
    with pytest.raises(ValueError, match="axis"):
        dps.normalize(torch.zeros(2, 3), "bogus")


def test_single_recorded_step():
    # R = 1: no inner interval; extrapolate and mean have no previous delta -> 0; raw is S(0, 0).
    logp, mask = LOGP[:, :1], MASK[:, :1]
    assert torch.equal(dps.progress_deltas(logp, mask, "extrapolate"), torch.zeros(2, 1))
    assert torch.equal(dps.progress_deltas(logp, mask, "mean"), torch.zeros(2, 1))
    # raw: seq 0 (-4-3-2-2)/4 = -2.75, seq 1 (-1-3)/2 = -2
    torch.testing.assert_close(
        dps.progress_deltas(logp, mask, "raw"), torch.tensor([[-2.75], [-2.0]])
    )


# Hand normalisation of the extrapolate deltas D = [[1, .25, .25], [2, 0, 0]], population std:
#   per_step: col 0 {1, 2}: mu 1.5, sigma 0.5; cols 1, 2 {.25, 0}: mu .125, sigma .125
#   trajectory: row 0 mu = 1.5/3 = 0.5, var = (.5^2 + .25^2 + .25^2)/3 = .375/3 = .125
#               row 1 mu = 2/3, var = ((4/3)^2 + 2 (2/3)^2)/3 = (24/9)/3 = 8/9
#   group: mu = 3.5/6, var = E[x^2] - mu^2 = 5.125/6 - (3.5/6)^2 = 0.8541667 - 0.3402778
def _z(x, mu, var):
    return (x - mu) / (math.sqrt(var) + EPS)


HAND_NORM_EXTRAPOLATE = {
    "per_step": [
        [_z(1, 1.5, 0.25), _z(0.25, 0.125, 0.125**2), _z(0.25, 0.125, 0.125**2)],
        [_z(2, 1.5, 0.25), _z(0, 0.125, 0.125**2), _z(0, 0.125, 0.125**2)],
    ],
    "trajectory": [
        [_z(1, 0.5, 0.125), _z(0.25, 0.5, 0.125), _z(0.25, 0.5, 0.125)],
        [_z(2, 2 / 3, 8 / 9), _z(0, 2 / 3, 8 / 9), _z(0, 2 / 3, 8 / 9)],
    ],
    "group": [
        [_z(x, 3.5 / 6, 5.125 / 6 - (3.5 / 6) ** 2) for x in (1, 0.25, 0.25)],
        [_z(x, 3.5 / 6, 5.125 / 6 - (3.5 / 6) ** 2) for x in (2, 0, 0)],
    ],
    "none": HAND_DELTAS["extrapolate"],
}


@pytest.mark.parametrize("axis", dps.NORM_AXES)
def test_hand_normalisation(axis):
    got = dps.normalize(torch.tensor(HAND_DELTAS["extrapolate"]), axis, EPS)
    torch.testing.assert_close(got, torch.tensor(HAND_NORM_EXTRAPOLATE[axis]), rtol=1e-6, atol=1e-6)


def test_hand_values_of_per_step_are_plus_minus_one():
    # Two trajectories: per interval, each sits one population std from the mean.
    got = dps.normalize(torch.tensor(HAND_DELTAS["raw"]), "per_step", EPS)
    torch.testing.assert_close(got, torch.tensor([[-1.0, 1, 1], [1, -1, -1]]), atol=1e-5, rtol=0)


def reference_normalize(d, axis, eps):
    """Plain-Python z-score with the population std."""
    rows = [list(map(float, r)) for r in d]
    b, r = len(rows), len(rows[0])

    def z(values):
        mu = sum(values) / len(values)
        sd = math.sqrt(sum((v - mu) ** 2 for v in values) / len(values))
        return [0.0 if sd == 0 else (v - mu) / (sd + eps) for v in values]

    if axis == "none":
        return rows
    if axis == "trajectory":
        return [z(row) for row in rows]
    if axis == "group":
        flat = z([v for row in rows for v in row])
        return [flat[i * r : (i + 1) * r] for i in range(b)]
    cols = [z([rows[i][j] for i in range(b)]) for j in range(r)]
    return [[cols[j][i] for j in range(r)] for i in range(b)]


@pytest.mark.parametrize("mode", dps.LAST_STEP_MODES)
@pytest.mark.parametrize("axis", dps.NORM_AXES)
def test_every_mode_and_axis_normalised_and_multiplied(mode, axis):
    lam = 0.5
    norm = dps.normalize(deltas_of(mode), axis, EPS)
    expected_norm = reference_normalize(HAND_DELTAS[mode], axis, EPS)
    torch.testing.assert_close(norm, torch.tensor(expected_norm), rtol=1e-5, atol=1e-6)
    mult = dps.token_multipliers(norm, BIRTH, RECORDED, lam)
    expected = [[1 + lam * expected_norm[b][HAND_J[b][n]] for n in range(4)] for b in range(2)]
    torch.testing.assert_close(mult, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    # lam = 0 reproduces the base method exactly.
    zero = dps.token_multipliers(norm, BIRTH, RECORDED, 0.0)
    assert torch.equal(zero, torch.ones(2, 4))


def test_hand_multipliers_and_clamp():
    # extrapolate + per_step ~ [[-1, 1, 1], [1, -1, -1]]; J = [[0,1,2,2],[0,1,1,2]]; lam = 0.5:
    # seq 0: 1 + .5 * [-1, 1, 1, 1] = [.5, 1.5, 1.5, 1.5]; seq 1: 1 + .5 * [1, -1, -1, -1]
    norm = dps.normalize(deltas_of("extrapolate"), "per_step", EPS)
    mult = dps.token_multipliers(norm, BIRTH, RECORDED, 0.5)
    torch.testing.assert_close(
        mult, torch.tensor([[0.5, 1.5, 1.5, 1.5], [1.5, 0.5, 0.5, 0.5]]), atol=1e-5, rtol=0
    )
    clamped = dps.token_multipliers(norm, BIRTH, RECORDED, 0.5, clamp_min=0.75)
    torch.testing.assert_close(
        clamped, torch.tensor([[0.75, 1.5, 1.5, 1.5], [1.5, 0.75, 0.75, 0.75]]), atol=1e-5, rtol=0
    )
    # lam = 3 would flip signs; clamp_min = 0 keeps every multiplier >= 0
    assert dps.token_multipliers(norm, BIRTH, RECORDED, 3.0).min() < 0
    assert dps.token_multipliers(norm, BIRTH, RECORDED, 3.0, clamp_min=0.0).min() == 0


def test_birth_interval_mapping_regular_and_irregular():
    # Pick a distinct value per interval so that the multiplier reveals J(n): 1 + 1 * (j+1)*10.
    norm = torch.tensor([[10.0, 20.0, 30.0]])
    births = torch.tensor([[0, 1, 2, 3, 4, 5, 9]])
    mult = dps.token_multipliers(norm, births, torch.tensor([0, 2, 4]), 1.0)
    # J = [0, 0, 1, 1, 2, 2, 2] (on, between, on, between, on r_m, after r_m, far after)
    assert mult.tolist() == [[11.0, 11.0, 21.0, 21.0, 31.0, 31.0, 31.0]]
    irregular = dps.token_multipliers(norm, births, torch.tensor([0, 3, 7]), 1.0)
    # r = [0, 3, 7]: J = [0, 0, 0, 1, 1, 1, 2]
    assert irregular.tolist() == [[11.0, 11.0, 11.0, 21.0, 21.0, 21.0, 31.0]]
    with pytest.raises(ValueError, match="precedes"):
        dps.token_multipliers(norm, births, torch.tensor([1, 3, 7]), 1.0)
    with pytest.raises(ValueError, match="recorded_steps"):
        dps.token_multipliers(norm, births, torch.tensor([0, 3]), 1.0)


def test_constant_delta_per_step_gives_zero_and_sigma_zero_is_not_nan():
    # Interval 0 has the same delta in every trajectory -> exactly 0 after per_step normalisation.
    d = torch.tensor([[0.1, 0.3], [0.1, 0.7], [0.1, -0.2]])
    norm = dps.normalize(d, "per_step")
    assert torch.equal(norm[:, 0], torch.zeros(3))
    assert (norm[:, 1] != 0).all()
    # sigma = 0 on every axis: zeros, never NaN (also a batch of one trajectory).
    flat = torch.full((3, 4), 0.1)
    for axis in ("per_step", "trajectory", "group"):
        assert torch.equal(dps.normalize(flat, axis), torch.zeros(3, 4))
    assert torch.equal(
        dps.normalize(torch.tensor([[0.3, -1.0, 2.0]]), "per_step"), torch.zeros(1, 3)
    )
    assert torch.equal(dps.normalize(torch.tensor([[0.3], [2.0]]), "trajectory"), torch.zeros(2, 1))


def test_block_scope_empty_intersections_give_zero():
    # Every interval has disjoint recorded sets (block scope across block boundaries).
    mask = torch.tensor([[[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0, 0]]], dtype=torch.bool)
    logp = torch.where(mask, torch.tensor(-1.0), torch.tensor(NAN))
    got = dps.progress_deltas(logp, mask, "mean")
    assert torch.equal(got, torch.zeros(1, 3))


def reference_deltas_all_scope(logp, birth, recorded):
    """delta_j = S(j+1, j+1) - S(j, j+1) with S(j, j') the mean of l[j] over M_{r_j'} (§2)."""
    out = []
    for b in range(len(birth)):
        row = []
        for j in range(len(recorded) - 1):
            later = [n for n in range(len(birth[b])) if birth[b][n] >= recorded[j + 1]]
            if not later:
                row.append(0.0)
                continue
            s_next = sum(logp[b][j + 1][n] for n in later) / len(later)
            s_prev = sum(logp[b][j][n] for n in later) / len(later)
            row.append(s_next - s_prev)
        out.append(row)
    return out


def test_scope_all_matches_the_definition_on_a_random_trace():
    g = torch.Generator().manual_seed(0)
    batch, length, steps, stride = 3, 12, 12, 4
    birth = torch.stack([torch.randperm(steps, generator=g)[:length] for _ in range(batch)])
    recorded = torch.arange(0, steps, stride)
    mask = birth[:, None, :] >= recorded[None, :, None]  # n in M_{r_j} <=> birth(n) >= r_j
    logp = -torch.rand(batch, len(recorded), length, generator=g) * 5
    got = dps.progress_deltas(logp.masked_fill(~mask, NAN), mask, "neutral")
    expected = reference_deltas_all_scope(logp.tolist(), birth.tolist(), recorded.tolist())
    torch.testing.assert_close(got[:, :-1], torch.tensor(expected))


def test_rollout_multipliers_chains_the_three():
    rollout = SimpleNamespace(
        progress_logp=LOGP, progress_mask=MASK, recorded_steps=RECORDED, birth_step=BIRTH,
        last_logp=LAST_LOGP, last_mask=LAST_MASK, num_steps=NUM_STEPS,
    )  # fmt: skip
    got = dps.rollout_multipliers(rollout, lam=0.3, last_step="measured", norm_axis="group")
    norm = dps.normalize(torch.tensor(HAND_DELTAS["measured"]), "group")
    assert torch.equal(got, dps.token_multipliers(norm, BIRTH, RECORDED, 0.3))
    with pytest.raises(ValueError, match="dps_stride"):
        dps.rollout_multipliers(SimpleNamespace(progress_logp=None), lam=0.3)


def test_on_a_real_rollout_of_the_sampler():
    model = random_mlm(vocab_size=32, seed=0)
    prompt = torch.randint(0, 30, (3, 4), generator=torch.Generator().manual_seed(0))
    rollout = generate(
        model, prompt, mask_id=31, gen_length=8, steps=8, block_length=4, temperature=0.9,
        generator=torch.Generator().manual_seed(1), dps_stride=3,
    )  # fmt: skip
    for mode in dps.LAST_STEP_MODES:
        mult = dps.rollout_multipliers(rollout, lam=0.5, last_step=mode)
        assert mult.shape == (3, 8) and torch.isfinite(mult).all()
        assert torch.equal(
            dps.rollout_multipliers(rollout, lam=0.0, last_step=mode), torch.ones(3, 8)
        )
    # Regular stride: J(n) = min(birth(n) // s, m) (METHOD.md §2).
    norm = dps.normalize(dps.progress_deltas(rollout.progress_logp, rollout.progress_mask))
    j = (rollout.birth_step // 3).clamp_max(norm.shape[1] - 1)
    expected = 1 + 0.5 * norm.gather(1, j)
    assert torch.equal(dps.rollout_multipliers(rollout, lam=0.5), expected)


def test_every_last_step_mode_has_one_rule():
    """The modes the configuration accepts (daca.core.options) are the rules progress_deltas
    has, in the same order."""
    assert tuple(dps.LAST_INTERVAL) == dps.LAST_STEP_MODES
