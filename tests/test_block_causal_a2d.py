"""dllm's BD3LM-trained A2D models (``dllm-hub/…-bd3lm-v0.1``): the A2D architecture trained
with block-causal attention, which their config.json does not record. With
``"attention_block_size"`` added to it (docs/scale.md) daca runs them block-causally: logits
against the oracle of tests/test_native_families.py under a block-causal pattern built here,
left padding, the sampler in the model's blocks, the cache exact, the likelihoods given the
clean blocks before each block, save/reload keeping the key, and a bad value refused."""

import json

import pytest
import torch
from _hub import read_weights
from _hub_a2d import write_a2d_llama, write_a2d_qwen3
from _oracle import block_causal_pattern, config_of
from conftest import assert_batch_generates_each_prompt_alone, left_pad
from test_native_families import Arch, oracle_logits

from daca.core.likelihood import mean_field_logp
from daca.core.sampler import generate
from daca.models import load, save_pretrained

BLOCK = 4
WRITERS = {"a2d-qwen3": write_a2d_qwen3, "a2d-llama": write_a2d_llama}
TOL = dict(atol=2e-5, rtol=2e-5)


def _bd3lm(folder, block=BLOCK):
    """The user's step: the block named in config.json."""
    config = config_of(folder) | {"attention_block_size": block}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {f: _bd3lm(write(tmp_path_factory.mktemp(f), seed=3)) for f, write in WRITERS.items()}


@pytest.fixture(scope="module")
def loaded(folders):
    return {f: load(str(folders[f])) for f in WRITERS}


def _rows(bundle, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab = bundle.model.get_output_embeddings().weight.shape[0]
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("family", WRITERS)
def test_logits_match_the_oracle_under_the_block_causal_pattern(family, folders, loaded):
    bundle, folder = loaded[family], folders[family]
    assert bundle.model.attention_block == BLOCK
    ids, mask = left_pad(_rows(bundle, (7, 10)), bundle.pad_id)
    with torch.no_grad():
        got = bundle.model(ids, attention_mask=mask).logits
    arch, weights = Arch.of(config_of(folder)), read_weights(folder)
    want = oracle_logits(weights, arch, ids, mask, pattern=block_causal_pattern(mask, BLOCK))
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], **TOL)
    bidirectional = oracle_logits(weights, arch, ids, mask)  # what it would be without the key
    assert (got[mask.bool()] - bidirectional[mask.bool()]).abs().max() > 1e-3


@pytest.mark.parametrize("family", WRITERS)
def test_generation_is_exact_with_the_cache_and_each_prompt_alone(family, loaded):
    bundle = loaded[family]
    prompt, attn = left_pad(_rows(bundle, (3, 6), seed=1), bundle.pad_id)
    kw = dict(mask_id=bundle.mask_id, gen_length=3 * BLOCK, steps=6, block_length=BLOCK,
              temperature=0.9, dps_stride=2)  # fmt: skip
    runs = {
        cache: generate(
            bundle.model,
            prompt,
            attn,
            cache=cache,
            generator=torch.Generator().manual_seed(2),
            **kw,
        )
        for cache in ("none", "dual")
    }
    assert torch.equal(runs["dual"].sequences, runs["none"].sequences)
    torch.testing.assert_close(runs["dual"].progress_logp, runs["none"].progress_logp, **TOL)
    assert runs["dual"].forwards["full"] == 1
    assert_batch_generates_each_prompt_alone(
        bundle, _rows(bundle, (3, 6), seed=1), gen_length=2 * BLOCK, steps=4, block_length=BLOCK
    )
    with pytest.raises(ValueError, match=f"block_length={BLOCK}"):
        generate(bundle.model, prompt, attn, **kw | {"block_length": 2 * BLOCK, "gen_length": 16})


def test_mean_field_scores_each_block_given_the_clean_blocks_before_it(loaded):
    bundle = loaded["a2d-qwen3"]
    model, mask_id = bundle.model, bundle.mask_id
    prompt, attn = left_pad(_rows(bundle, (5, 2), seed=4), bundle.pad_id)
    clean = torch.tensor(_rows(bundle, (2 * BLOCK, 2 * BLOCK), seed=5))
    ones = torch.ones(2, 2 * BLOCK, dtype=torch.long)
    with torch.no_grad():
        got = mean_field_logp(model, prompt, clean, mask_id=mask_id, attention_mask=attn)
        want = []
        for b in range(2):  # [prompt, the clean blocks before b, block b masked], alone
            seq = torch.cat([prompt, clean[:, : b * BLOCK], torch.full((2, BLOCK), mask_id)], 1)
            am = torch.cat([attn, ones[:, : (b + 1) * BLOCK]], 1)
            logp = model(seq, attention_mask=am).logits[:, -BLOCK:].log_softmax(-1)
            want.append(logp.gather(-1, clean[:, b * BLOCK : (b + 1) * BLOCK, None])[..., 0])
    torch.testing.assert_close(got, torch.cat(want, 1), **TOL)


def test_save_keeps_the_block_and_a_bad_one_is_refused(folders, loaded, tmp_path, capsys):
    out = save_pretrained(loaded["a2d-qwen3"], tmp_path / "saved")
    assert config_of(out)["attention_block_size"] == BLOCK
    assert load(str(out)).model.attention_block == BLOCK
    from daca.cli import main

    bad = _bd3lm(write_a2d_qwen3(tmp_path / "bad", seed=3), block=0)
    code = main(["eval", "--task", "sudoku", "--model", str(bad), "--limit", "1",
                 "--device", "cpu", "--out", str(tmp_path / "e.jsonl")])  # fmt: skip
    assert code == 2 and "attention_block_size" in capsys.readouterr().err
