"""The pretraining noise of ``daca pretrain`` (LLaDA's SFT noise, the block-by-block noise of
the semi-autoregressive sampler, the answer hidden for a curriculum), checked exactly."""

import torch

from daca.tools.pretrain import answer_positions, diffusion_noise


def test_llada_noise_masks_with_probability_t_and_weights_one_over_t():
    g = torch.Generator().manual_seed(0)
    masked, weight = diffusion_noise(4000, 64, generator=g)
    again = torch.Generator().manual_seed(0)
    t = 1.0 - torch.rand(4000, 1, generator=again)
    assert torch.equal(masked, torch.rand(4000, 64, generator=again) < t)
    assert torch.allclose(weight, masked / t)
    # E[mask rate] = E[t] = 1/2, and E[weight] = 1 for every position (the ELBO's unbiasedness)
    assert abs(masked.float().mean().item() - 0.5) < 0.01
    assert abs(weight.mean().item() - 1.0) < 0.05


def test_block_noise_cleans_earlier_blocks_and_masks_later_ones():
    masked, weight = diffusion_noise(
        500, 64, generator=torch.Generator().manual_seed(1), block_length=16, block_noise=0.5
    )
    # The same draws, in diffusion_noise's order: t, the positions, the pick, the block k.
    g = torch.Generator().manual_seed(1)
    t = 1.0 - torch.rand(500, 1, generator=g)
    plain = torch.rand(500, 64, generator=g) < t
    pick = (torch.rand(500, 1, generator=g) < 0.5).squeeze(1)
    k = torch.randint(0, 4, (500, 1), generator=g).squeeze(1)
    assert 200 < pick.sum() < 300
    for row in range(500):
        m, w = masked[row].view(4, 16), weight[row].view(4, 16)
        if not pick[row]:
            assert torch.equal(masked[row], plain[row])
            continue
        b = int(k[row])
        assert not m[:b].any() and (w[:b] == 0).all()  # earlier blocks: clean, no loss
        assert torch.equal(m[b], plain[row].view(4, 16)[b])  # the block: LLaDA's noise
        assert torch.allclose(w[b], m[b] / t[row])
        assert m[b + 1 :].all() and (w[b + 1 :] == 1).all()  # later blocks: wholly masked


def test_hidden_positions_are_masked_and_out_of_the_loss():
    targets = torch.tensor([[5, 6, 7, 9, 8, 8], [5, 9, 6, 6, 6, 6], [5, 5, 5, 5, 5, 5]])
    hidden = answer_positions(targets, answer_id=9)
    assert hidden.tolist() == [
        [False, False, False, True, True, True],
        [False, True, True, True, True, True],
        [False] * 6,  # no answer tag: nothing hidden
    ]
    masked, weight = diffusion_noise(
        3, 6, generator=torch.Generator().manual_seed(2), hidden=hidden
    )
    assert masked[hidden].all() and (weight[hidden] == 0).all()
