"""Plain-torch pieces of the mixture-of-experts oracles (tests/test_llada_moe.py,
tests/test_llada2.py): re-statements of the public modeling code, not the transformers classes
daca builds on."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta, rotary=None):
    """Rotate-half RoPE on the first ``rotary`` (default: all) of each head's D dims of x
    [B, H, T, D] at ``positions`` [B, T]."""
    rotary = rotary or x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary)
    ang = positions[:, None, :, None].float() * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot, rest = x[..., :rotary], x[..., rotary:]
    half = torch.cat([-rot[..., rotary // 2 :], rot[..., : rotary // 2]], -1)
    return torch.cat([rot * cos + half * sin, rest], -1)


def swiglu(x, w, prefix):
    gate, up = x @ w[prefix + "gate_proj.weight"].T, x @ w[prefix + "up_proj.weight"].T
    return (F.silu(gate) * up) @ w[prefix + "down_proj.weight"].T


def config_of(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def token_ids(shape, seed=0):
    return torch.randint(0, 250, shape, generator=torch.Generator().manual_seed(seed))


def block_causal_pattern(mask, block, anchor="end"):
    """[B, T, T] bool of block-causal attention, row by row: a row's real tokens in blocks of
    ``block`` counted back from its last (``anchor`` "end", dllm's BD3LM sampler), or by their
    position counted on from its first (``anchor`` "start", LLaDA 2.x's generate: blocks of
    positions 0..block-1, ... of the row), a query attending to the real keys of its block and
    of the blocks before it (a padding query to itself)."""
    B, T = mask.shape
    out = torch.zeros(B, T, T, dtype=torch.bool)
    for r in range(B):
        real = [i for i in range(T) if mask[r, i]]
        shift = (-len(real)) % block
        block_of = {i: (n + shift) // block for n, i in enumerate(real)}
        if anchor == "start":
            block_of = {i: (i - real[0]) // block for i in real}
        for i in range(T):
            for j in real:
                out[r, i, j] = i in block_of and block_of[j] <= block_of[i]
            out[r, i, i] |= i not in block_of
    return out
