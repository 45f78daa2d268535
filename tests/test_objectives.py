"""Group advantages and the four base losses (METHOD.md §4, §6) against hand computations."""

import math

import pytest
import torch
from conftest import random_mlm

from daca import objectives as obj
from daca.core.modeling import forward_logits

LN2 = math.log(2.0)


def test_group_advantages_by_hand():
    # G = 3: group 0 rewards [1, 0, 2], mean 1 -> [0, -1, 1]; group 1 [3, 3, 3] -> [0, 0, 0].
    rewards = torch.tensor([1.0, 0.0, 2.0, 3.0, 3.0, 3.0])
    assert obj.group_advantages(rewards, 3).tolist() == [0.0, -1.0, 1.0, 0.0, 0.0, 0.0]
    # scale="group": unbiased std of [0, -1, 1] = sqrt(2 / 2) = 1; of group 1: 0 (-> 0 / eps = 0)
    got = obj.group_advantages(rewards, 3, scale="group", eps=1e-4)
    d = 1 / (1 + 1e-4)
    torch.testing.assert_close(got, torch.tensor([0.0, -d, d, 0.0, 0.0, 0.0]))
    # G = 1: every reward is its own group mean.
    assert torch.equal(obj.group_advantages(rewards, 1, scale="group"), torch.zeros(6))
    with pytest.raises(ValueError, match="whole number"):
        obj.group_advantages(rewards, 4)
    with pytest.raises(ValueError, match="scale"):
        obj.group_advantages(rewards, 3, scale="batch")


def test_leave_one_out_advantages_by_hand():
    # DiffuCoder's baseline: the mean of the OTHER rewards of the group.
    # group [1, 0, 2]: others' means [1, 1.5, .5] -> [0, -1.5, 1.5]; group [3, 3, 3] -> 0
    rewards = torch.tensor([1.0, 0.0, 2.0, 3.0, 3.0, 3.0])
    got = obj.group_advantages(rewards, 3, baseline="leave_one_out")
    assert got.tolist() == [0.0, -1.5, 1.5, 0.0, 0.0, 0.0]
    # = G/(G-1) times the mean-baseline advantage; scale="group" divides by the same std (1)
    torch.testing.assert_close(got, 1.5 * obj.group_advantages(rewards, 3))
    scaled = obj.group_advantages(rewards, 3, scale="group", baseline="leave_one_out")
    d = 1.5 / (1 + 1e-4)
    torch.testing.assert_close(scaled, torch.tensor([0.0, -d, d, 0.0, 0.0, 0.0]))
    assert torch.equal(  # the default is the plain mean, unchanged
        obj.group_advantages(rewards, 3, scale="group"),
        obj.group_advantages(rewards, 3, scale="group", baseline="mean"),
    )
    with pytest.raises(ValueError, match="num_generations >= 2"):
        obj.group_advantages(rewards, 1, baseline="leave_one_out")
    with pytest.raises(ValueError, match="baseline"):
        obj.group_advantages(rewards, 3, baseline="median")


# ---------------------------------------------------------------------------------------------
# Diffu-GRPO on a 2-group batch (G = 2, B = 4, L = 3), eps = 0.5 (band [0.5, 1.5]).
#   row 0 A = 1,    rho [1, 2, .25]: -min(rho A, clip A) = -[1, 1.5, .25]   (token 1 clipped)
#   row 1 A = -1,   rho [1, 2, .25]: -min(-[1, 2, .25], -[1, 1.5, .5]) = [1, 2, .5]
#                   (token 2 clipped)
#   row 2 A = .5,   rho [1.2, .8, 1]: in band, -[.6, .4, .5]
#   row 3 A = -.5,  rho [1, 1, 1], mask [1, 1, 0]: [.5, .5]
#   sum = -2.75 + 3.5 - 1.5 + 1 = 0.25 over 11 tokens; clip fraction 2/11
#   ratio mean = (3.25 + 3.25 + 3 + 2) / 11 = 11.5/11; advantage mean = (3 - 3 + 1.5 - 1) / 11
# ---------------------------------------------------------------------------------------------
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5])
RATIO = torch.tensor([[1.0, 2.0, 0.25], [1.0, 2.0, 0.25], [1.2, 0.8, 1.0], [1.0, 1.0, 1.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
LOGP = torch.tensor(
    [[-1.0, -2.0, -0.5], [-3.0, -1.0, -1.5], [-0.7, -2.2, -1.0], [-1.0, -4.0, -2.0]]
)
OLD_LOGP = LOGP - RATIO.log()


def test_diffu_grpo_by_hand():
    loss, m = obj.diffu_grpo_loss(LOGP, OLD_LOGP, ADV, MASK, epsilon=0.5)
    assert loss.item() == pytest.approx(0.25 / 11, abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(2 / 11)
    assert m["ratio_mean"] == pytest.approx(11.5 / 11, rel=1e-6)
    assert m["ratio_max"] == pytest.approx(2.0, rel=1e-6)
    assert m["advantage_mean"] == pytest.approx(0.5 / 11, rel=1e-6)
    assert "kl" not in m and "multiplier_mean" not in m
    # k3 KL with ref - logp = ln 2 on every token: e^{ln 2} - ln 2 - 1 = 1 - ln 2
    loss_kl, m_kl = obj.diffu_grpo_loss(
        LOGP, OLD_LOGP, ADV, MASK, epsilon=0.5, beta=0.04, ref_logp=LOGP + LN2
    )
    assert loss_kl.item() == pytest.approx(0.25 / 11 + 0.04 * (1 - LN2), abs=1e-6)
    assert m_kl["kl"] == pytest.approx(1 - LN2, rel=1e-5)
    with pytest.raises(ValueError, match="ref_logp"):
        obj.diffu_grpo_loss(LOGP, OLD_LOGP, ADV, MASK, beta=0.04)


def reference_ppo_tokens(ratio, adv_tokens, mask, eps):
    """Plain-Python -min(rho A, clip(rho) A) averaged over the masked tokens."""
    total, count = 0.0, 0
    for b in range(len(ratio)):
        for n in range(len(ratio[b])):
            if mask[b][n]:
                r, a = ratio[b][n], adv_tokens[b][n]
                total += -min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
                count += 1
    return total / count


def test_diffu_grpo_with_multipliers_matches_a_plain_loop():
    mult = torch.tensor([[0.5, 1.5, 2.0], [1.0, 0.2, 3.0], [1.1, 0.9, 1.0], [2.0, 0.0, 5.0]])
    loss, m = obj.diffu_grpo_loss(LOGP, OLD_LOGP, ADV, MASK, token_multipliers=mult)
    adv_tokens = (ADV[:, None] * mult).tolist()
    expected = reference_ppo_tokens(RATIO.tolist(), adv_tokens, MASK.tolist(), 0.5)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["multiplier_mean"] == pytest.approx((4 + 4.2 + 3 + 2) / 11, rel=1e-6)


def test_diffu_grpo_clip_kills_the_gradient_outside_the_band():
    logp = LOGP.clone().requires_grad_(True)
    loss, _ = obj.diffu_grpo_loss(logp, OLD_LOGP, ADV, MASK, epsilon=0.5)
    loss.backward()
    # d loss / d logp_n = -A rho_n / 11 where the unclipped term is selected, else 0.
    expected = -(ADV[:, None] * RATIO) / 11
    expected[0, 1] = 0.0  # rho 2 > 1.5 with A > 0
    expected[1, 2] = 0.0  # rho .25 < .5 with A < 0
    expected[3, 2] = 0.0  # outside the completion mask
    torch.testing.assert_close(logp.grad, expected)
    # rho outside the band with the "wrong" sign is not clipped: rho .25, A > 0 keeps a gradient.
    assert logp.grad[0, 2] != 0 and logp.grad[1, 1] != 0


# ---------------------------------------------------------------------------------------------
# wd1, G = 2, A = [a, -a]: w+ = [s(2a), s(-2a)], w- = [s(-2a), s(2a)] (s = sigmoid), so
#   w+ - w- = [tanh a, -tanh a]: group 0 (a = 1) [tanh 1, -tanh 1]; group 1 (a = .5) [tanh .5, ...].
#   token sums over the mask: row 0: -6, row 1: -2, row 2: -2 (mask [1, 1, 0]), row 3: -4
#   group 0: -(tanh1 * -6 - tanh1 * -2) = 4 tanh 1
#   group 1: -(tanh.5 * -2 - tanh.5 * -4) = -2 tanh .5
#   mean over prompts: 2 tanh 1 - tanh .5
# ---------------------------------------------------------------------------------------------
WD1_ADV = torch.tensor([1.0, -1.0, 0.5, -0.5])
WD1_LOGP = torch.tensor(
    [[-1.0, -2.0, -3.0], [-0.5, -0.5, -1.0], [-1.0, -1.0, -9.0], [-2.0, -1.0, -1.0]]
)
WD1_MASK = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)


def test_wd1_by_hand():
    loss, m = obj.wd1_loss(WD1_LOGP, WD1_ADV, WD1_MASK, num_generations=2)
    assert loss.item() == pytest.approx(2 * math.tanh(1) - math.tanh(0.5), abs=1e-6)
    assert m["weight_pos_max"] == pytest.approx(1 / (1 + math.exp(-2)), rel=1e-6)
    # +SML, eta = .1, sml_logp = logp / 2: sequence sums [-3, -1, -1, -2], groups [-4, -3];
    # -(eta / G) * group sum = .05 * 4 = .2 and .05 * 3 = .15; mean over prompts .175
    loss_sml, m_sml = obj.wd1_loss(
        WD1_LOGP, WD1_ADV, WD1_MASK, num_generations=2, sml_logp=WD1_LOGP / 2, eta=0.1
    )
    assert loss_sml.item() == pytest.approx(2 * math.tanh(1) - math.tanh(0.5) + 0.175, abs=1e-6)
    assert m_sml["sml_logp_mean"] == pytest.approx(-7 / 4)
    with pytest.raises(ValueError, match="sml_logp"):
        obj.wd1_loss(WD1_LOGP, WD1_ADV, WD1_MASK, num_generations=2, eta=0.1)
    with pytest.raises(ValueError, match="whole number"):
        obj.wd1_loss(WD1_LOGP, WD1_ADV, WD1_MASK, num_generations=3)


def test_wd1_weights_per_token_via_the_gradient():
    # G = 3, one group A = [1, 0, -1], psi = 2: w+ = softmax([2, 0, -2]), w- = softmax([-2, 0, 2]).
    z = math.exp(2) + 1 + math.exp(-2)
    w_pos = [math.exp(2) / z, 1 / z, math.exp(-2) / z]
    coef = [w_pos[0] - w_pos[2], 0.0, w_pos[2] - w_pos[0]]
    mult = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.5, 0.0]])
    logp = torch.full((3, 2), -1.0, requires_grad=True)
    loss, _ = obj.wd1_loss(
        logp, torch.tensor([1.0, 0.0, -1.0]), num_generations=3, psi=2.0, token_multipliers=mult
    )
    loss.backward()
    # d loss / d l_{g,n} = -(w+ - w-)_g * m_{g,n} / num_prompts (= 1)
    expected = -torch.tensor(coef)[:, None] * mult
    torch.testing.assert_close(logp.grad, expected)
    # the weights are constants: the advantages get no gradient
    adv = torch.tensor([1.0, 0.0, -1.0], requires_grad=True)
    loss, _ = obj.wd1_loss(logp.detach(), adv, num_generations=3)
    assert not loss.requires_grad


# ---------------------------------------------------------------------------------------------
# GDPO, G = 2, eps = .5; rho = exp((ELBO - ELBO_old) / N) per sequence, broadcast to tokens:
#   row 0 A = 1,   N 3, rho 2:   -min(2, 1.5) = -1.5 per token (clip active)
#   row 1 A = -1,  N 3, rho 1:   1 per token
#   row 2 A = .5,  N 2, rho .25: -min(.125, .25) = -.125 per token (below band, A > 0: no clip)
#   row 3 A = -.5, N 3, rho .25: -min(-.125, -.25) = .25 per token (clip active)
#   sum = -4.5 + 3 - .25 + .75 = -1 over 11 tokens; clip fraction 6/11
# ---------------------------------------------------------------------------------------------
GDPO_RHO = torch.tensor([2.0, 1.0, 0.25, 0.25])
GDPO_MASK = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
TERMS = torch.tensor(
    [[-3.0, -1.0, -2.0], [-1.0, -5.0, -2.0], [-4.0, -1.0, -7.0], [-1.0, -1.0, -1.0]]
)
# old terms: each counted token lower by ln rho (so ELBO - ELBO_old = N ln rho); the masked-out
# token of row 2 differs wildly and must not count.
OLD_TERMS = (
    TERMS - GDPO_RHO.log()[:, None] + torch.tensor([[0, 0, 0], [0, 0, 0], [0, 0, 50.0], [0, 0, 0]])
)


def test_gdpo_by_hand():
    loss, m = obj.gdpo_loss(TERMS, OLD_TERMS, ADV, GDPO_MASK, epsilon=0.5)
    assert loss.item() == pytest.approx(-1 / 11, abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(6 / 11)
    assert m["ratio_mean"] == pytest.approx(3.5 / 4, rel=1e-6)
    assert m["ratio_max"] == pytest.approx(2.0, rel=1e-6)
    # sequence-level k3 KL: (ELBO_ref - ELBO) / N = ln 2 for every sequence -> 1 - ln 2 each
    ref = TERMS + LN2
    loss_kl, m_kl = obj.gdpo_loss(TERMS, OLD_TERMS, ADV, GDPO_MASK, beta=0.1, ref_token_terms=ref)
    assert loss_kl.item() == pytest.approx(-1 / 11 + 0.1 * (1 - LN2), abs=1e-6)
    assert m_kl["kl"] == pytest.approx(1 - LN2, rel=1e-5)
    with pytest.raises(ValueError, match="ref_token_terms"):
        obj.gdpo_loss(TERMS, OLD_TERMS, ADV, GDPO_MASK, beta=0.1)


def test_gdpo_with_multipliers_matches_a_plain_loop():
    mult = torch.tensor([[0.5, 1.5, 2.0], [1.0, 0.2, 3.0], [1.1, 0.9, 1.0], [2.0, 0.0, 5.0]])
    loss, _ = obj.gdpo_loss(TERMS, OLD_TERMS, ADV, GDPO_MASK, token_multipliers=mult)
    ratio_tokens = [[r] * 3 for r in GDPO_RHO.tolist()]
    adv_tokens = (ADV[:, None] * mult).tolist()
    expected = reference_ppo_tokens(ratio_tokens, adv_tokens, GDPO_MASK.tolist(), 0.5)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


# ---------------------------------------------------------------------------------------------
# coupled-GRPO: DiffuCoder's GRPO loss on the coupled estimate, token-level ratio, eps = .5,
#   beta = .01 by default. Same batch as Diffu-GRPO above: the surrogate is 0.25 / 11; with
#   ref - logp = -ln 2 on every token the k3 KL is e^{-ln 2} + ln 2 - 1 = ln 2 - 1/2.
# ---------------------------------------------------------------------------------------------


def test_coupled_grpo_by_hand():
    loss, m = obj.coupled_grpo_loss(LOGP, OLD_LOGP, ADV, MASK, ref_logp=LOGP - LN2)
    assert loss.item() == pytest.approx(0.25 / 11 + 0.01 * (LN2 - 0.5), abs=1e-6)
    assert m["kl"] == pytest.approx(LN2 - 0.5, rel=1e-5)
    assert m["clip_fraction"] == pytest.approx(2 / 11)
    assert m["ratio_mean"] == pytest.approx(11.5 / 11, rel=1e-6)
    # the published defaults: eps = .5 and beta = .01 (so a reference is required)
    with pytest.raises(ValueError, match="ref_logp"):
        obj.coupled_grpo_loss(LOGP, OLD_LOGP, ADV, MASK)
    loss0, _ = obj.coupled_grpo_loss(LOGP, OLD_LOGP, ADV, MASK, beta=0.0)
    assert loss0.item() == pytest.approx(0.25 / 11, abs=1e-6)
    # eps = .2: row 0's rho 2 clips at 1.2 (A > 0), row 1's rho .25 at .8 (A < 0), row 2's 1.2
    # stays in band: -[1, 1.2, .25] + [1, 2, .8] - [.6, .4, .5] + [.5, .5] = .85 over 11 tokens
    loss2, _ = obj.coupled_grpo_loss(LOGP, OLD_LOGP, ADV, MASK, beta=0.0, epsilon=0.2)
    assert loss2.item() == pytest.approx(0.85 / 11, abs=1e-6)


def test_coupled_grpo_first_iteration_ratio_one_and_kl_zero():
    """Old = current = reference: rho = 1, KL = 0, loss = -(token mean of A), gradient -A/N."""
    logp = LOGP.clone().requires_grad_(True)
    loss, m = obj.coupled_grpo_loss(logp, LOGP, ADV, MASK, ref_logp=LOGP)
    assert m["ratio_mean"] == 1.0 and m["kl"] == 0.0 and m["clip_fraction"] == 0.0
    assert loss.item() == pytest.approx(-0.5 / 11, abs=1e-7)
    loss.backward()
    torch.testing.assert_close(logp.grad, -(ADV[:, None] * MASK) / 11)


def test_sml_enriched():
    got = obj.sml_enriched(torch.tensor([[-1.0, -4.0]]), torch.tensor([[-3.0, 0.0]]))
    assert got.tolist() == [[-2.0, -2.0]]
    with pytest.raises(ValueError, match="differ"):
        obj.sml_enriched(torch.zeros(1, 2), torch.zeros(1, 3))


def _all_losses(multipliers, **wd1_kw):
    return [
        obj.diffu_grpo_loss(
            LOGP, OLD_LOGP, ADV, MASK, beta=0.04, ref_logp=LOGP + 0.3, token_multipliers=multipliers
        ),
        obj.wd1_loss(
            WD1_LOGP, WD1_ADV, WD1_MASK, num_generations=2, token_multipliers=multipliers, **wd1_kw
        ),
        obj.gdpo_loss(TERMS, OLD_TERMS, ADV, GDPO_MASK, token_multipliers=multipliers),
        obj.coupled_grpo_loss(
            LOGP, OLD_LOGP, ADV, MASK, ref_logp=LOGP - 0.2, token_multipliers=multipliers
        ),
    ]


def test_multipliers_of_one_and_sml_off_reproduce_the_base_loss_exactly():
    base = _all_losses(None)
    ones = _all_losses(torch.ones(4, 3))
    sml_off = _all_losses(None, sml_logp=WD1_LOGP / 2, eta=0.0)
    for (b, mb), (o, mo), (s, _) in zip(base, ones, sml_off, strict=True):
        assert torch.equal(b, o) and torch.equal(b, s)
        assert {k: v for k, v in mo.items() if k != "multiplier_mean"} == mb
    # and multipliers other than 1 do change every loss
    other = _all_losses(torch.full((4, 3), 1.5))
    for (b, _), (o, _) in zip(base, other, strict=True):
        assert not torch.equal(b, o)


def test_gradients_flow_to_model_parameters():
    vocab, mask_id, prompt_len = 32, 31, 2
    model = random_mlm(vocab_size=vocab, seed=0)
    ids = torch.randint(0, vocab - 1, (4, 6), generator=torch.Generator().manual_seed(0))
    targets = ids[:, prompt_len:]
    noisy = ids.clone()
    noisy[:, prompt_len:] = mask_id  # mean-field: whole completion masked

    def token_logp():
        logits = forward_logits(model, noisy)[:, prompt_len:]
        return logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)

    with torch.no_grad():
        old = token_logp() + 0.1
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mult = torch.tensor([[1.2, 0.8, 1.0, 1.5]]).expand(4, 4)
    losses = {
        "diffu_grpo": lambda lp: obj.diffu_grpo_loss(lp, old, adv, token_multipliers=mult)[0],
        "wd1": lambda lp: obj.wd1_loss(lp, adv, num_generations=2, token_multipliers=mult)[0],
        "gdpo": lambda lp: obj.gdpo_loss(lp, old, adv, token_multipliers=mult)[0],
        "coupled_grpo": lambda lp: obj.coupled_grpo_loss(
            lp, old, adv, ref_logp=old, token_multipliers=mult
        )[0],
    }
    for name, loss_fn in losses.items():
        model.zero_grad(set_to_none=True)
        loss_fn(token_logp()).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads, name
        assert all(torch.isfinite(g).all() for g in grads), name
        assert sum(g.abs().sum().item() for g in grads) > 0, name


def test_gdpo_sequence_reduction_by_hand():
    """The reference code's reduction: ELBO over all L positions (padding included), ratio
    exp(ΔELBO / L), mean over sequences, KL k3 of the raw ELBO difference."""
    terms = torch.tensor([[-1.0, -2.0, 0.0, -1.0], [-2.0, 0.0, 0.0, -2.0]], dtype=torch.float64)
    old = terms - torch.tensor([[0.4, 0, 0, 0], [0, 0, 0, -0.8]], dtype=torch.float64)
    ref = terms - torch.tensor([[0.2, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float64)  # row 1 padded
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, metrics = obj.gdpo_loss(terms, old, adv, mask, beta=0.1, ref_token_terms=ref,
                              reduction="sequence")  # fmt: skip
    # ΔELBO 0.4 and -0.8 over L = 4 (the padded position counts); A = +1 and -1, no clip.
    surrogate = (-math.exp(0.1) + math.exp(-0.2)) / 2
    kl = (math.exp(-0.2) + 0.2 - 1) / 2  # k3(ELBO_ref - ELBO) = k3(-0.2) and k3(0)
    assert loss.item() == pytest.approx(surrogate + 0.1 * kl, rel=1e-12)
    assert metrics["kl"] == pytest.approx(kl, rel=1e-12)
    with pytest.raises(ValueError, match="reduction"):
        obj.gdpo_loss(terms, old, adv, mask, reduction="mean")
