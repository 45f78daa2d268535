"""daca.core.likelihood: mean-field, SML, the GDPO ELBO and coupled-GRPO (METHOD.md §3, §4, §6).

Most checks use an ORACLE model built from an explicit joint p(x) over short sequences: at each
masked position its logits are the exact log p(x_n | visible tokens), every other masked position
marginalised out. The estimators must then return those exact conditionals.
"""

import itertools
import math

import numpy as np
import pytest
import torch
from conftest import random_mlm

from daca.core.likelihood import (
    coupled_logp,
    coupled_masks,
    elbo_masks,
    elbo_token_terms,
    elbo_token_terms_from_masks,
    mean_field_logp,
    quadrature_nodes,
    strata_assignment,
    stratified_logp,
)

V = 3  # real tokens 0..V-1 of the oracle; its mask token is V
MASK = V


class Oracle:
    """Exact conditionals of a joint over all V**T sequences (float64 logits over V+1 tokens)."""

    def __init__(self, probs: torch.Tensor, length: int):
        self.support = torch.tensor(list(itertools.product(range(V), repeat=length)))  # [N, T]
        self.probs = probs.double()
        self.onehot = torch.nn.functional.one_hot(self.support, V).double()  # [N, T, V]
        self.calls = 0

    def __call__(self, input_ids, attention_mask=None):
        self.calls += 1
        hidden = input_ids == MASK
        fits = ((self.support[None] == input_ids[:, None]) | hidden[:, None]).all(-1)  # [R, N]
        w = fits * self.probs
        marg = torch.einsum("rn,ntv->rtv", w, self.onehot) / w.sum(-1)[:, None, None]
        no_mask = torch.full((*input_ids.shape, 1), -math.inf, dtype=torch.float64)
        return torch.cat([marg.log(), no_mask], dim=-1)

    def log_p(self, seq) -> float:
        i = (self.support == torch.as_tensor(seq)).all(-1).nonzero().item()
        return self.probs[i].log().item()

    def cond(self, seq, n, hidden) -> float:
        """Brute force: log p(x_n = seq[n] | x_j = seq[j] for j not in hidden), n in hidden."""
        num = den = 0.0
        for s, p in zip(self.support.tolist(), self.probs.tolist(), strict=True):
            if all(s[j] == seq[j] for j in range(len(seq)) if j not in hidden):
                den += p
                num += p if s[n] == seq[n] else 0.0
        return math.log(num / den)


def random_joint(length, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(V**length, generator=g, dtype=torch.float64) + 0.05
    return Oracle(p / p.sum(), length)


def sticky_chain(length, repeat=0.9):
    """Uniform start, repeat the previous token w.p. `repeat`: every marginal is uniform."""
    seqs = itertools.product(range(V), repeat=length)
    stay, move = math.log(repeat), math.log((1 - repeat) / (V - 1))
    logp = [
        -math.log(V) + sum(stay if a == b else move for a, b in itertools.pairwise(s)) for s in seqs
    ]
    return Oracle(torch.tensor(logp, dtype=torch.float64).exp(), length)


def split(oracle, rows):
    """Sequences (prompt of 1 token ++ completion) as prompt_ids [B, 1], completion_ids [B, L]."""
    x = oracle.support[rows]
    return x[:, :1], x[:, 1:]


def log_p_given_prompt(oracle, seq):
    prompt_mass = oracle.probs[oracle.support[:, 0] == seq[0]].sum().item()
    return oracle.log_p(seq) - math.log(prompt_mass)


def spearman(a, b):
    def ranks(x):
        x = np.round(np.asarray(x, dtype=np.float64), 9)
        r = np.empty(len(x))
        r[np.argsort(x, kind="stable")] = np.arange(len(x))
        for v in np.unique(x):  # ties get their average rank
            r[x == v] = r[x == v].mean()
        return r

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- SML and mean-field, exact


@pytest.mark.parametrize("strata", ["random", "interleaved", "contiguous"])
def test_sml_with_k_equal_l_is_the_exact_pseudo_likelihood(strata):
    oracle = random_joint(5)  # prompt 1 token, completion L = 4
    rows = torch.arange(0, 243, 7)
    q, o = split(oracle, rows)
    got = stratified_logp(oracle, q, o, mask_id=MASK, num_strata=4, strata=strata, generator=gen(0))
    for b, seq in enumerate(oracle.support[rows].tolist()):
        want = [oracle.cond(seq, n, {n}) for n in range(1, 5)]
        torch.testing.assert_close(got[b], torch.tensor(want, dtype=torch.float64))


def test_sml_with_one_stratum_is_the_sum_of_log_marginals():
    oracle = random_joint(5)
    rows = torch.arange(3, 243, 11)
    q, o = split(oracle, rows)
    got = stratified_logp(oracle, q, o, mask_id=MASK, num_strata=1)
    for b, seq in enumerate(oracle.support[rows].tolist()):
        want = [oracle.cond(seq, n, {1, 2, 3, 4}) for n in range(1, 5)]
        torch.testing.assert_close(got[b], torch.tensor(want, dtype=torch.float64))
    mf = mean_field_logp(oracle, q, o, mask_id=MASK)
    assert torch.equal(got, mf)  # K = 1 is the mean-field estimate, bit for bit


@pytest.mark.parametrize("strata", ["random", "interleaved", "contiguous"])
def test_each_token_is_conditioned_on_everything_outside_its_stratum(strata):
    oracle = random_joint(5)
    rows = torch.tensor([0, 17, 58, 101, 200, 242])
    q, o = split(oracle, rows)
    got = stratified_logp(oracle, q, o, mask_id=MASK, num_strata=2, strata=strata, generator=gen(3))
    k_of = strata_assignment(len(rows), 4, 2, strata, generator=gen(3))
    assert sorted(k_of.sum(1).tolist()) == [2] * len(rows)  # two strata of 2 positions
    for b, seq in enumerate(oracle.support[rows].tolist()):
        for n in range(4):
            hidden = {1 + j for j in range(4) if k_of[b, j] == k_of[b, n]}
            assert got[b, n].item() == pytest.approx(oracle.cond(seq, 1 + n, hidden), abs=1e-12)


def test_strata_partitions():
    assert strata_assignment(1, 7, 3, "interleaved").tolist() == [[0, 1, 2, 0, 1, 2, 0]]
    assert strata_assignment(1, 7, 3, "contiguous").tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    k_of = strata_assignment(64, 10, 4, "random", generator=gen(1))
    sizes = torch.stack([(k_of == k).sum(1) for k in range(4)], 1)
    assert sizes.min() >= 2 and sizes.max() <= 3 and (sizes.sum(1) == 10).all()
    assert len({tuple(r) for r in k_of.tolist()}) > 50  # one permutation per row
    assert torch.equal(k_of, strata_assignment(64, 10, 4, "random", generator=gen(1)))
    assert not torch.equal(k_of, strata_assignment(64, 10, 4, "random", generator=gen(2)))


def test_sml_ranks_a_sticky_chain_like_the_truth_and_mean_field_cannot():
    L = 6
    chain = sticky_chain(L)
    # prompt token independent of the completion: uniform marginals given the prompt too
    probs = (chain.probs / V).repeat(V)  # index = prompt·V^L + completion
    oracle = Oracle(probs, L + 1)
    rows = torch.arange(V**L)  # prompt token 0, every completion of the support
    q, o = split(oracle, rows)
    truth = [chain.log_p(s) for s in o.tolist()]

    mf = mean_field_logp(oracle, q, o, mask_id=MASK).sum(1)
    torch.testing.assert_close(mf, torch.full_like(mf, L * math.log(1 / V)))  # all alike

    pseudo = stratified_logp(oracle, q, o, mask_id=MASK, num_strata=L, strata="interleaved")
    sml4 = stratified_logp(oracle, q, o, mask_id=MASK, num_strata=4, generator=gen(0))
    assert spearman(pseudo.sum(1), truth) > 0.9
    assert spearman(sml4.sum(1), truth) > 0.8


# ---------------------------------------------------------------- GDPO ELBO


def test_gauss_legendre_nodes_and_weights():
    t, w = quadrature_nodes("gauss-3")
    torch.testing.assert_close(t, torch.tensor([0.5 - 0.15**0.5, 0.5, 0.5 + 0.15**0.5]).double())
    torch.testing.assert_close(w, torch.tensor([5 / 18, 8 / 18, 5 / 18], dtype=torch.float64))
    assert t[0].item() == pytest.approx(0.1127, abs=1e-4)
    t1, w1 = quadrature_nodes("gauss-1")
    assert t1.tolist() == [0.5] and w1.tolist() == [1.0]
    for n in (2, 5, 8):  # exact for polynomials of degree 2n-1 on [0, 1]
        t, w = quadrature_nodes(f"gauss-{n}")
        assert (w * t ** (2 * n - 1)).sum().item() == pytest.approx(1 / (2 * n), rel=1e-12)


def test_elbo_masks_count_and_uniformity():
    t, _ = quadrature_nodes("gauss-3")
    m = elbo_masks(4000, 4, t, generator=gen(0))  # ⌊t·4⌋ = 0, 2, 3 -> at least 1
    assert m.sum(-1).unique(dim=1).tolist() == [[1], [2], [3]]
    pairs = torch.tensor([[1, 1, 0, 0], [0, 1, 0, 1]]).bool()
    for pat in pairs:  # each of the C(4, 2) = 6 subsets is drawn ~1/6 of the time
        freq = (m[1] == pat).all(-1).double().mean().item()
        assert abs(freq - 1 / 6) < 0.03
    assert torch.equal(m, elbo_masks(4000, 4, t, generator=gen(0)))
    assert elbo_masks(2, 10, t, generator=gen(0)).sum(-1).tolist() == [[1, 1], [5, 5], [8, 8]]


def test_elbo_terms_match_a_hand_computation_with_fixed_masks():
    oracle = random_joint(5)
    rows = torch.tensor([5, 77, 160])
    q, o = split(oracle, rows)
    masks = torch.tensor(
        [
            [[1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]],  # node 0: one position masked
            [[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 0]],  # node 1: three positions masked
        ]
    ).bool()
    t = torch.tensor([0.25, 0.75], dtype=torch.float64)
    w = torch.tensor([0.4, 0.6], dtype=torch.float64)
    got = elbo_token_terms_from_masks(oracle, q, o, masks, t, w, mask_id=MASK)
    for b, seq in enumerate(oracle.support[rows].tolist()):
        want = [0.0] * 4
        for i in range(2):
            hidden = {1 + n for n in range(4) if masks[i, b, n]}
            for n in range(4):
                if masks[i, b, n]:
                    want[n] += w[i].item() / t[i].item() * oracle.cond(seq, 1 + n, hidden)
        torch.testing.assert_close(got[b], torch.tensor(want, dtype=torch.float64))


def test_elbo_integrated_exactly_is_tight_for_the_oracle():
    """Σ_m (1/m) E_{|M|=m} Σ_{n∈M} log p(o_n | o_{-M}) = log p(o) (any-order chain rule): the
    estimator's formula with every mask, nodes m/L and weights 1/(L·C(L,m)), is exact."""
    oracle = random_joint(5)
    L = 4
    subsets = [s for m in range(1, L + 1) for s in itertools.combinations(range(L), m)]
    masks = torch.zeros(len(subsets), L, dtype=torch.bool)
    for i, s in enumerate(subsets):
        masks[i, list(s)] = True
    sizes = masks.sum(1).double()
    nodes = sizes / L
    weights = 1 / (L * torch.tensor([math.comb(L, int(m)) for m in sizes], dtype=torch.float64))
    assert weights.sum().item() == pytest.approx(1.0)
    rows = torch.tensor([0, 99, 242])
    q, o = split(oracle, rows)
    masks = masks[:, None].expand(-1, len(rows), -1)
    elbo = elbo_token_terms_from_masks(oracle, q, o, masks, nodes, weights, mask_id=MASK).sum(1)
    want = [log_p_given_prompt(oracle, s) for s in oracle.support[rows].tolist()]
    torch.testing.assert_close(elbo, torch.tensor(want, dtype=torch.float64))


def test_gauss3_elbo_matches_its_brute_force_expectation():
    """Averaged over mask draws, the gauss-3 ELBO converges to its brute-force expectation
    Σ_q w_q/t_q · E_{|M|=m_q}[Σ_{n∈M} log p(o_n | o_{-M})] (masks uniform over subsets)."""
    oracle = random_joint(5)
    L = 4
    t, w = quadrature_nodes("gauss-3")
    rows = torch.tensor([7, 130])
    q, o = split(oracle, rows)
    reps = 2000
    draws = elbo_token_terms(
        oracle, q.repeat(reps, 1), o.repeat(reps, 1), mask_id=MASK, generator=gen(0)
    ).sum(1)
    draws = draws.view(reps, len(rows))
    for b, seq in enumerate(oracle.support[rows].tolist()):
        expect = 0.0
        for tq, wq in zip(t.tolist(), w.tolist(), strict=True):
            m = max(1, math.floor(tq * L))
            subsets = list(itertools.combinations(range(L), m))
            total = sum(oracle.cond(seq, 1 + n, {1 + j for j in s}) for s in subsets for n in s)
            expect += wq / tq * total / len(subsets)
        stderr = draws[:, b].std().item() / reps**0.5
        assert draws[:, b].mean().item() == pytest.approx(expect, abs=4 * stderr)


def test_gauss3_elbo_bound_what_holds():
    """The SDMC estimator is not a per-sample bound: single draws can exceed log p(o | q). Its
    expectation lies below log p(o | q) for every sequence of this L = 4 oracle, but that is not a
    theorem (gauss-5 on a random L = 6 oracle exceeded log p by up to 0.06 in a check); the exact
    integral is tight (test above), the gap is what the 3-node quadrature loses."""
    oracle = random_joint(5)
    L = 4
    t, w = quadrature_nodes("gauss-3")
    q, o = split(oracle, torch.arange(V**5))
    log_p = torch.tensor([log_p_given_prompt(oracle, s) for s in oracle.support.tolist()])
    # exact expectation: every subset of size m_q at node t_q, weight w_q / C(L, m_q)
    masks, nodes, weights = [], [], []
    for tq, wq in zip(t.tolist(), w.tolist(), strict=True):
        m = max(1, math.floor(tq * L))
        for s in itertools.combinations(range(L), m):
            masks.append(torch.zeros(L, dtype=torch.bool).index_fill(0, torch.tensor(s), True))
            nodes.append(tq)
            weights.append(wq / math.comb(L, m))
    masks = torch.stack(masks)[:, None].expand(-1, len(o), -1)
    nodes, weights = torch.tensor(nodes).double(), torch.tensor(weights).double()
    expect = elbo_token_terms_from_masks(oracle, q, o, masks, nodes, weights, mask_id=MASK)
    assert (expect.sum(1) < log_p).all()
    one_draw = elbo_token_terms(oracle, q, o, mask_id=MASK, generator=gen(0)).sum(1)
    assert (one_draw > log_p).any() and (one_draw < log_p).float().mean() > 0.9


def test_elbo_same_seed_same_masks():
    oracle = random_joint(5)
    q, o = split(oracle, torch.arange(0, 243, 10))
    a = elbo_token_terms(oracle, q, o, mask_id=MASK, generator=gen(4))
    b = elbo_token_terms(oracle, q, o, mask_id=MASK, generator=gen(4))
    c = elbo_token_terms(oracle, q, o, mask_id=MASK, generator=gen(5))
    assert torch.equal(a, b) and not torch.equal(a, c)
    t, w = quadrature_nodes("gauss-3")
    masks = elbo_masks(*o.shape, t, generator=gen(4))
    assert torch.equal(a, elbo_token_terms_from_masks(oracle, q, o, masks, t, w, mask_id=MASK))
    assert oracle.calls == 4  # all nodes in one batched forward per call


# ---------------------------------------------------------------- a real (random) model

MID = 31  # mask id of the random ModernBERT (vocab 32, pad 0)


@pytest.fixture(scope="module")
def mlm():
    return random_mlm(32, seed=0)


def batch(B=3, P=5, L=8, seed=0):
    g = gen(seed)
    return torch.randint(1, 31, (B, P), generator=g), torch.randint(1, 31, (B, L), generator=g)


def test_mean_field_equals_manual(mlm):
    q, o = batch()
    ids = torch.cat([q, torch.full_like(o, MID)], 1)
    with torch.no_grad():
        want = mlm(ids).logits[:, q.shape[1] :].log_softmax(-1).gather(-1, o[..., None])[..., 0]
        got = mean_field_logp(mlm, q, o, mask_id=MID)
    torch.testing.assert_close(got, want)


class Spy:
    def __init__(self, model):
        self.model, self.inputs = model, []

    def __call__(self, input_ids, attention_mask=None):
        self.inputs.append(input_ids.clone())
        return self.model(input_ids, attention_mask=attention_mask)


def test_prompt_masking_is_seeded_and_spares_padding(mlm):
    q, o = batch(B=4, P=6)
    am = torch.ones_like(q)
    am[0, :3] = 0
    am[2, :1] = 0
    q = q.masked_fill(am == 0, 0)
    spy = Spy(mlm)
    with torch.no_grad():
        a = mean_field_logp(
            spy, q, o, mask_id=MID, p_mask_prompt=0.4, generator=gen(1), attention_mask=am
        )
        b = mean_field_logp(
            spy, q, o, mask_id=MID, p_mask_prompt=0.4, generator=gen(1), attention_mask=am
        )
        mean_field_logp(spy, q, o, mask_id=MID, p_mask_prompt=1.0, attention_mask=am)
        c = mean_field_logp(mlm, q, o, mask_id=MID, attention_mask=am)
    assert torch.equal(a, b) and not torch.equal(a, c)
    hide = (torch.rand(q.shape, generator=gen(1)) < 0.4) & (am == 1)  # the documented draw
    assert 0 < hide.sum() < hide.numel()
    assert torch.equal(spy.inputs[0][:, :6], q.masked_fill(hide, MID))
    assert torch.equal(spy.inputs[2][:, :6], q.masked_fill(am == 1, MID))  # p = 1: all but pads
    assert (spy.inputs[0][:, 6:] == MID).all()


def test_left_padded_batch_equals_rows_one_by_one(mlm):
    g = gen(2)
    lengths = [5, 2, 4]
    prompts = [torch.randint(1, 31, (1, n), generator=g) for n in lengths]
    o = torch.randint(1, 31, (3, 6), generator=g)
    q = torch.zeros(3, 5, dtype=torch.long)
    am = torch.zeros(3, 5, dtype=torch.long)
    for b, p in enumerate(prompts):
        q[b, 5 - p.shape[1] :], am[b, 5 - p.shape[1] :] = p, 1
    t, w = quadrature_nodes("gauss-3")
    masks = elbo_masks(3, 6, t, generator=gen(0))
    fns = {
        "mf": lambda q, o, am, b: mean_field_logp(mlm, q, o, mask_id=MID, attention_mask=am),
        "sml": lambda q, o, am, b: stratified_logp(
            mlm, q, o, mask_id=MID, num_strata=3, strata="contiguous", attention_mask=am
        ),
        "elbo": lambda q, o, am, b: elbo_token_terms_from_masks(
            mlm, q, o, masks[:, b], t, w, mask_id=MID, attention_mask=am
        ),
    }
    with torch.no_grad():
        for fn in fns.values():
            together = fn(q, o, am, slice(None))
            for b, p in enumerate(prompts):
                alone = fn(p, o[b : b + 1], None, slice(b, b + 1))
                torch.testing.assert_close(together[b : b + 1], alone, atol=1e-5, rtol=1e-5)


def test_views_per_forward_does_not_change_the_result(mlm):
    q, o = batch(B=2, L=9)
    with torch.no_grad():
        ref = stratified_logp(mlm, q, o, mask_id=MID, num_strata=4, generator=gen(7))
        for vpf in (1, 3, 4, 10):
            got = stratified_logp(
                mlm, q, o, mask_id=MID, num_strata=4, generator=gen(7), views_per_forward=vpf
            )
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(
            stratified_logp(mlm, q, o, mask_id=MID, num_strata=1),
            mean_field_logp(mlm, q, o, mask_id=MID),
        )


def test_sml_uses_more_context_than_mean_field(mlm):
    q, o = batch(B=2, L=8)
    spy = Spy(mlm)
    with torch.no_grad():
        stratified_logp(spy, q, o, mask_id=MID, num_strata=4, generator=gen(0))
    (ids,) = spy.inputs  # K = 4 views stacked into one forward of 4·B rows
    comp = ids[:, 5:].view(4, 2, 8)
    assert ((comp == MID).sum(-1) == 2).all()  # each view hides 2 of 8 positions
    assert ((comp == MID).sum(0) == 1).all()  # each position hidden in exactly one view
    assert torch.equal(torch.where(comp == MID, o, comp), o.expand(4, 2, 8))
    assert (ids[:, :5] == q.repeat(4, 1)).all()


@pytest.mark.parametrize("which", ["mf", "sml", "elbo"])
def test_gradients_flow(which):
    model = random_mlm(32, seed=1).train()
    q, o = batch(B=2, L=6)
    kw = dict(mask_id=MID, generator=gen(0))
    fn = {"mf": mean_field_logp, "sml": stratified_logp, "elbo": elbo_token_terms}[which]
    out = fn(model, q, o, **kw)
    assert out.requires_grad
    out.sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0


def test_bad_inputs_raise():
    oracle = random_joint(5)
    q, o = split(oracle, torch.arange(3))
    with pytest.raises(ValueError, match="num_strata"):
        stratified_logp(oracle, q, o, mask_id=MASK, num_strata=0)
    with pytest.raises(ValueError, match="exceeds the completion length"):
        stratified_logp(oracle, q, o, mask_id=MASK, num_strata=5)
    with pytest.raises(ValueError, match="strata: 'blocks' is not one of"):
        stratified_logp(oracle, q, o, mask_id=MASK, strata="blocks")
    with pytest.raises(ValueError, match="views_per_forward"):
        stratified_logp(oracle, q, o, mask_id=MASK, views_per_forward=0)
    for bad in ("gauss-0", "gauss", "simpson-3", "gauss-x"):
        with pytest.raises(ValueError, match="unknown quadrature"):
            elbo_token_terms(oracle, q, o, mask_id=MASK, quadrature=bad)
    for fn in (mean_field_logp, stratified_logp, elbo_token_terms):
        with pytest.raises(ValueError, match="batch sizes differ"):
            fn(oracle, q[:2], o, mask_id=MASK)
        with pytest.raises(ValueError, match="attention_mask"):
            fn(oracle, q, o, mask_id=MASK, attention_mask=torch.ones(3, 2))
        with pytest.raises(ValueError, match=r"\[B, P\]"):
            fn(oracle, q[0], o, mask_id=MASK)
    with pytest.raises(ValueError, match="p_mask_prompt"):
        mean_field_logp(oracle, q, o, mask_id=MASK, p_mask_prompt=1.5)
    t, w = quadrature_nodes()
    with pytest.raises(ValueError, match="masks must be bool"):
        elbo_token_terms_from_masks(oracle, q, o, torch.ones(3, 3, 4), t, w, mask_id=MASK)
    with pytest.raises(ValueError, match="nodes and weights"):
        elbo_token_terms_from_masks(
            oracle, q, o, torch.ones(2, 3, 4, dtype=torch.bool), t, w, mask_id=MASK
        )


# ---------------------------------------------------------------- GDPO masks among real tokens


def test_elbo_masks_only_real_tokens_and_count_from_the_real_length():
    """⌊t·N⌋ among the N real tokens, never padding after EOS: the ELBO bounds the N tokens the
    GDPO loss divides by (before: ⌊t·L⌋ positions drawn among all L)."""
    t, _ = quadrature_nodes("gauss-3")  # 0.113, 0.5, 0.887
    real = torch.zeros(3, 10, dtype=torch.bool)
    real[0, :4] = True  # N = 4: ⌊t·4⌋ = 0, 2, 3 -> 1, 2, 3
    real[1, :] = True  # N = 10: 1, 5, 8
    # row 2: no real token -> nothing masked
    m = elbo_masks(3, 10, t, generator=gen(0), completion_mask=real)
    assert m.sum(-1).tolist() == [[1, 1, 0], [2, 5, 0], [3, 8, 0]]
    assert not (m & ~real).any()
    # all real: exactly the masks drawn without a completion mask (the draw is unchanged)
    full = torch.ones(3, 10, dtype=torch.bool)
    assert torch.equal(
        elbo_masks(3, 10, t, generator=gen(0), completion_mask=full),
        elbo_masks(3, 10, t, generator=gen(0)),
    )
    # uniform among the real positions: each of the C(4, 2) = 6 subsets ~1/6 of the time
    many = elbo_masks(
        6000,
        6,
        t,
        generator=gen(1),
        completion_mask=torch.tensor([[1] * 4 + [0] * 2]).bool().expand(6000, 6),
    )
    pat = torch.tensor([1, 0, 1, 0, 0, 0]).bool()
    assert abs((many[1] == pat).all(-1).double().mean().item() - 1 / 6) < 0.03


def test_elbo_terms_with_padding_mask_only_real_tokens(mlm):
    q, o = batch(B=2, L=8)
    real = torch.ones(2, 8, dtype=torch.bool)
    real[0, 3:] = False  # N = 3 and 8
    spy = Spy(mlm)
    with torch.no_grad():
        terms = elbo_token_terms(spy, q, o, mask_id=MID, generator=gen(2), completion_mask=real)
    (ids,) = spy.inputs
    hidden = ids[:, 5:].view(3, 2, 8) == MID
    assert not (hidden & ~real).any()  # no padding masked
    assert hidden.sum(-1).tolist() == [[1, 1], [1, 4], [2, 7]]  # max(1, ⌊t·N⌋), N = 3 and 8
    assert (terms[0, 3:] == 0).all() and (terms[0, :3] != 0).any()


# ---------------------------------------------------------------- given masks and strata


def test_given_strata_prompt_masks_and_elbo_masks_reproduce_the_drawn_ones(mlm):
    q, o = batch(B=3, P=5, L=8)
    with torch.no_grad():
        k_of = strata_assignment(3, 8, 4, "random", generator=gen(5))
        drawn = stratified_logp(mlm, q, o, mask_id=MID, num_strata=4, generator=gen(5))
        given = stratified_logp(mlm, q, o, mask_id=MID, num_strata=4, strata=k_of)
        assert torch.equal(drawn, given)

        hide = torch.rand(q.shape, generator=gen(6)) < 0.3  # mean_field_logp's documented draw
        drawn = mean_field_logp(mlm, q, o, mask_id=MID, p_mask_prompt=0.3, generator=gen(6))
        given = mean_field_logp(mlm, q, o, mask_id=MID, prompt_hide=hide)
        assert torch.equal(drawn, given)
        assert torch.equal(given, mean_field_logp(mlm, q.masked_fill(hide, MID), o, mask_id=MID))

        t, _ = quadrature_nodes("gauss-3")
        masks = elbo_masks(3, 8, t, generator=gen(7))
        drawn = elbo_token_terms(mlm, q, o, mask_id=MID, generator=gen(7))
        given = elbo_token_terms(mlm, q, o, mask_id=MID, masks=masks)
        assert torch.equal(drawn, given)


def test_given_masks_replace_the_trl_side_doors(mlm):
    """The core calls that replaced the strata-as-ELBO-masks side door (unit nodes and weights)
    and the pre-masked prompt of the TRL front-end's retired own-loss mode give the same numbers."""
    q, o = batch(B=2, P=5, L=8)
    am = torch.ones_like(q)
    am[1, :2] = 0
    k_of = strata_assignment(2, 8, 4, "random", generator=gen(8))
    hide = (torch.rand(q.shape, generator=gen(9)) < 0.5) & am.bool()
    with torch.no_grad():
        views = k_of[None] == torch.arange(4)[:, None, None]
        ones = torch.ones(4, dtype=torch.float64)
        side = elbo_token_terms_from_masks(
            mlm, q, o, views, ones, ones, mask_id=MID, attention_mask=am
        )
        core = stratified_logp(mlm, q, o, mask_id=MID, num_strata=4, strata=k_of, attention_mask=am)
        assert torch.equal(core, side)
        side = mean_field_logp(mlm, q.masked_fill(hide, MID), o, mask_id=MID, attention_mask=am)
        core = mean_field_logp(mlm, q, o, mask_id=MID, prompt_hide=hide, attention_mask=am)
        assert torch.equal(core, side)


def test_given_masks_bad_inputs_raise():
    oracle = random_joint(5)
    q, o = split(oracle, torch.arange(3))
    with pytest.raises(ValueError, match="strata values"):
        stratified_logp(oracle, q, o, mask_id=MASK, num_strata=2, strata=torch.full((3, 4), 2))
    with pytest.raises(ValueError, match="integer assignment"):
        stratified_logp(oracle, q, o, mask_id=MASK, num_strata=2, strata=torch.zeros(3, 3).long())
    with pytest.raises(ValueError, match="not both"):
        mean_field_logp(
            oracle, q, o, mask_id=MASK, p_mask_prompt=0.1, prompt_hide=torch.zeros_like(q).bool()
        )
    with pytest.raises(ValueError, match="prompt_hide must be bool"):
        mean_field_logp(oracle, q, o, mask_id=MASK, prompt_hide=torch.zeros(3, 2).bool())
    with pytest.raises(ValueError, match="completion_mask"):
        elbo_masks(3, 4, quadrature_nodes()[0], completion_mask=torch.ones(3, 5).bool())


# ---------------------------------------------------------------- coupled-GRPO (DiffuCoder)


def coupled_by_hand(oracle, seq, masks_b, ratios):
    """ℓ^C_n = (ℓ(all hidden) + Σ_i [n ∈ M_i] ℓ(M_i)/t_i + [n ∉ M_i] ℓ(¬M_i)/(1-t_i)) / (λ+1),
    every conditional by brute force over the joint."""
    L = len(seq) - 1
    out = []
    for n in range(L):
        total = oracle.cond(seq, 1 + n, set(range(1, L + 1)))
        for m, t in zip(masks_b, ratios, strict=True):
            inside = {1 + j for j in range(L) if m[j]}
            if m[n]:
                total += oracle.cond(seq, 1 + n, inside) / t
            else:
                total += oracle.cond(seq, 1 + n, set(range(1, L + 1)) - inside) / (1 - t)
        out.append(total / (len(ratios) + 1))
    return out


@pytest.mark.parametrize("num_pairs", [1, 2])
def test_coupled_logp_matches_a_hand_computation(num_pairs):
    oracle = random_joint(5)
    rows = torch.tensor([3, 50, 121, 240])
    q, o = split(oracle, rows)
    masks, ratios = coupled_masks(4, 4, num_pairs=num_pairs, generator=gen(1))
    got = coupled_logp(oracle, q, o, mask_id=MASK, num_pairs=num_pairs, generator=gen(1))
    assert got.shape == (4, 4)
    for b, seq in enumerate(oracle.support[rows].tolist()):
        want = coupled_by_hand(oracle, seq, masks[:, b].tolist(), ratios.tolist())
        torch.testing.assert_close(got[b], torch.tensor(want, dtype=torch.float64))
    given = coupled_logp(oracle, q, o, mask_id=MASK, masks=masks, ratios=ratios)
    assert torch.equal(got, given)
    assert oracle.calls == 2  # 1 + 2λ views in one batched forward per call


def test_coupled_logp_fixed_masks_by_hand():
    """t = 1/4: masked in M -> ℓ/(1/4) = 4ℓ, else the complement's ℓ/(3/4)."""
    oracle = random_joint(5)
    rows = torch.tensor([10, 200])
    q, o = split(oracle, rows)
    masks = torch.tensor([[[1, 0, 0, 1], [0, 0, 0, 0]]]).bool()  # row 1: M empty, ¬M everything
    got = coupled_logp(
        oracle, q, o, mask_id=MASK, masks=masks, ratios=torch.tensor([0.25], dtype=torch.float64)
    )
    full = {1, 2, 3, 4}
    s0, s1 = oracle.support[rows].tolist()
    want0 = [
        (oracle.cond(s0, 1, full) + 4 * oracle.cond(s0, 1, {1, 4})) / 2,
        (oracle.cond(s0, 2, full) + oracle.cond(s0, 2, {2, 3}) / 0.75) / 2,
        (oracle.cond(s0, 3, full) + oracle.cond(s0, 3, {2, 3}) / 0.75) / 2,
        (oracle.cond(s0, 4, full) + 4 * oracle.cond(s0, 4, {1, 4})) / 2,
    ]
    want1 = [(1 + 1 / 0.75) * oracle.cond(s1, n, full) / 2 for n in range(1, 5)]
    torch.testing.assert_close(got, torch.tensor([want0, want1], dtype=torch.float64))


def test_coupled_views_score_every_token_exactly_once_per_pair(mlm):
    q, o = batch(B=3, P=5, L=10)
    spy = Spy(mlm)
    with torch.no_grad():
        coupled_logp(spy, q, o, mask_id=MID, num_pairs=3, generator=gen(4))
    (ids,) = spy.inputs  # 1 + 2·3 views of B rows in one forward
    assert ids.shape == (7 * 3, 15)
    assert (ids[:, :5] == q.repeat(7, 1)).all()  # the prompt is never masked
    hidden = ids[:, 5:].view(7, 3, 10) == MID
    assert hidden[0].all()  # the full mask x_T
    pairs = hidden[1:].view(3, 2, 3, 10)
    assert (pairs.sum(1) == 1).all()  # each token hidden in exactly one view of each pair
    assert torch.equal(pairs[:, 0], coupled_masks(3, 10, num_pairs=3, generator=gen(4))[0])
    comp = ids[:, 5:].view(7, 3, 10)
    assert torch.equal(torch.where(hidden, o, comp), o.expand(7, 3, 10))


def test_coupled_masks_draws_and_ratios():
    masks, t = coupled_masks(2000, 50, num_pairs=4, generator=gen(0))
    g = gen(0)  # the documented draws
    u = torch.rand(4, dtype=torch.float64, generator=g)
    draw = torch.rand(4, 2000, 50, dtype=torch.float64, generator=g)
    torch.testing.assert_close(t, 0.2 + 0.6 * u)
    assert torch.equal(masks, draw < t[:, None, None])
    assert ((t >= 0.2) & (t <= 0.8)).all()
    freq = masks.double().mean((1, 2))
    torch.testing.assert_close(freq, t, atol=0.01, rtol=0)  # masked with probability t
    t_many = coupled_masks(1, 1, num_pairs=4000, generator=gen(1))[1]
    assert abs(t_many.mean().item() - 0.5) < 0.01 and t_many.min() >= 0.2 and t_many.max() <= 0.8
    a = coupled_masks(3, 7, t_range=(0.5, 0.5), generator=gen(2))[1]
    assert a.tolist() == [0.5]
    for bad in ((0.0, 0.5), (0.6, 0.5), (0.2, 1.0)):
        with pytest.raises(ValueError, match="t_range"):
            coupled_masks(2, 3, t_range=bad)
    with pytest.raises(ValueError, match="num_pairs"):
        coupled_masks(2, 3, num_pairs=0)


def test_coupled_matches_diffucoder_reference_formula(mlm):
    """λ = 1 is DiffuCoder's selective_log_softmax: (p0 + where(mask, p1 / t, p2 / (1 - t))) / 2
    with p0, p1, p2 the log-probs of the full, masked and reverse-masked views."""
    q, o = batch(B=2, P=5, L=8)
    masks, t = coupled_masks(2, 8, generator=gen(3))
    views = [torch.ones_like(masks[0]), masks[0], ~masks[0]]
    with torch.no_grad():
        p = []
        for m in views:
            ids = torch.cat([q, torch.where(m, MID, o)], 1)
            lp = mlm(ids).logits[:, 5:].log_softmax(-1).gather(-1, o[..., None])[..., 0]
            p.append(lp)
        t = t.item()
        want = (p[0] + torch.where(masks[0], p[1] / t, p[2] / (1 - t))) / 2
        got = coupled_logp(mlm, q, o, mask_id=MID, generator=gen(3))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_coupled_invariants(mlm):
    q, o = batch(B=2, L=9)
    am = torch.ones_like(q)
    with torch.no_grad():
        ref = coupled_logp(mlm, q, o, mask_id=MID, num_pairs=2, generator=gen(7))
        for vpf in (1, 2, 5):
            got = coupled_logp(
                mlm, q, o, mask_id=MID, num_pairs=2, generator=gen(7), views_per_forward=vpf
            )
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(ref, coupled_logp(mlm, q, o, mask_id=MID, num_pairs=2, generator=gen(7)))
        assert not torch.equal(
            ref, coupled_logp(mlm, q, o, mask_id=MID, num_pairs=2, generator=gen(8))
        )
        with_am = coupled_logp(
            mlm, q, o, mask_id=MID, num_pairs=2, generator=gen(7), attention_mask=am
        )
        torch.testing.assert_close(with_am, ref, atol=1e-5, rtol=1e-5)
    oracle = random_joint(5)
    q, o = split(oracle, torch.arange(3))
    with pytest.raises(ValueError, match="both masks and ratios"):
        coupled_logp(oracle, q, o, mask_id=MASK, masks=torch.ones(1, 3, 4).bool())
    with pytest.raises(ValueError, match="masks must be bool"):
        coupled_logp(
            oracle, q, o, mask_id=MASK, masks=torch.ones(1, 3, 5).bool(), ratios=torch.ones(1) / 2
        )
    with pytest.raises(ValueError, match="ratios"):
        coupled_logp(
            oracle, q, o, mask_id=MASK, masks=torch.ones(1, 3, 4).bool(), ratios=torch.ones(1)
        )


def test_coupled_gradients_flow():
    model = random_mlm(32, seed=1).train()
    q, o = batch(B=2, L=6)
    out = coupled_logp(model, q, o, mask_id=MID, generator=gen(0))
    assert out.requires_grad
    out.sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0
