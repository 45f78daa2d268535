"""The block KV cache of faster rollouts (docs/rollouts.md, a daca decision) over transformers'
cache classes: a full forward refreshes it, the steps between run the current block (and, for
``prefix``, its suffix) against the cached keys and values."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from daca.core.modeling import block_causal_mask, causal_lm_backbone, padded_positions


def _cache_backbone(model, cache: str):
    """``causal_lm_backbone(model)``, else a ValueError naming the cache asked for."""
    base = causal_lm_backbone(model)
    if base is None:
        raise ValueError(
            f"cache={cache!r} needs a model on transformers' Llama, Qwen2, Qwen3 or GLM-4.5-MoE "
            f"classes (LLaDA, Dream, LLaDA-MoE, LLaDA 2.x, daca's tiny models via "
            f"daca.models.load); {type(model).__name__} has no KV cache daca can use: use "
            "cache='none'"
        )
    return base


class _SlotLayer(DynamicLayer):
    """One layer's cached keys and values [B, H, n + q, D]: the first n (``cached``) kept from
    the last refresh, then a slot for the q positions a block step recomputes. The step writes
    its keys into the slot and attends to the whole buffer, so no step copies the cache (a
    transformers ``DynamicLayer`` would concatenate it with the new keys, then be cropped)."""

    def __init__(self, keys: Tensor, values: Tensor, cached: int):
        super().__init__()
        self.keys, self.values, self.cached = keys, values, cached
        self.device, self.is_initialized = keys.device, True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        n = self.cached
        if n + key_states.shape[-2] != self.keys.shape[-2]:
            raise RuntimeError("a block step's queries do not fill the cache's slot")
        self.keys[..., n:, :] = key_states
        self.values[..., n:, :] = value_states
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.cached

    def rows(self, rows: Tensor) -> _SlotLayer:
        """A copy of the batch rows ``rows``."""
        return _SlotLayer(self.keys[rows], self.values[rows], self.cached)


class _RefreshLayer(DynamicLayer):
    """A refresh's layer: the full forward attends to its keys and values as computed, and
    ``store`` copies what later block steps read into the cache's buffers, once (a
    ``DynamicLayer`` would first concatenate them onto an empty tensor, a copy of its own)."""

    def __init__(self, store):
        super().__init__()
        self.store = store

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        self.store(key_states, value_states)
        return key_states, value_states


class BlockCache:
    """A block KV cache over transformers' cache classes (docs/rollouts.md).

    ``refresh`` runs one full forward over prompt ++ completion and keeps the keys/values of the
    positions outside the query span of later steps: ``prefix`` keeps the prompt and the earlier
    blocks (later steps recompute the block and everything after it); ``dual`` keeps the masked
    suffix too (later steps run only the block). ``block`` runs one such step, its keys written
    into the cache's slot for the block (``_SlotLayer``). Keys are cached after RoPE, so every
    forward passes explicit ``position_ids`` (counted from the first real token of a left-padded
    row, as the full forward) and a 2-D padding mask over [cache, query] in the order the keys
    are stored (dual: prefix, suffix, block). They live in one buffer per layer, made at the
    first refresh; every later refresh copies its keys into it once, in that order.

    Every call takes ``rows``, the batch rows to run (None: all): under parallel decoding a row
    that has finished the block takes no step, and rows on their own clocks may need different
    forwards at one step. A refresh of some rows writes their keys into the cache, whose other
    rows keep theirs; a block step on some rows runs on a copy of their cache.

    Dream's logits at i come from the hidden state at i-1 (``DreamForDiffusionLM`` undoes the
    shift within one forward), so for Dream the query span starts one position earlier and that
    position's key is not cached.

    A block-causal model (LLaDA 2.x: ``attention_block``) gets, at every step on cached keys,
    its [B, 1, q, kv] mask laid out as the keys are stored (``block_causal_mask`` of the whole
    sequence, its query rows, its key columns in the cache's order): a block never attends to
    the suffix, and the prefix's keys do not depend on later blocks, so every mode is exact.
    """

    def __init__(self, model, mode: str, attn: Tensor | None, prompt_length: int, total: int):
        self.base = _cache_backbone(model, mode)
        self.model, self.mode, self.P = model, mode, prompt_length
        self.shift = getattr(self.base, "logits_shift", 0)  # Dream's 1 (daca.models.native)
        self.attention_block = getattr(self.base, "attention_block", None)  # LLaDA 2.x's
        self.attention_anchor = getattr(self.base, "attention_anchor", "end")
        self.attn, self.total = attn, total
        self.block_causal: Tensor | None = None  # [B, 1, N, N], made at the first refresh
        if attn is None:
            self.pos = torch.arange(total)[None]
        else:
            self.pos = padded_positions(attn)
        # per layer, keys and values [B, H, P+L, D] in the order block steps read them
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.cache = None

    def _query_start(self, lo: int) -> int:
        """The first position a step on block start ``lo`` recomputes (Dream: one earlier)."""
        return self.P + lo - (self.shift if self.P + lo > 0 else 0)

    def _check_block(self, method: str, lo: int, hi: int) -> int:
        a = self._query_start(lo)
        if a != self.a or hi != self.hi:
            raise RuntimeError(f"BlockCache.{method} called for another block's cache")
        return a

    def _inputs(self, rows: Tensor | None, start: int):
        """The padding mask (every column) and the position ids from ``start`` of ``rows``."""
        mask, pos = self.attn, self.pos[:, start:]
        if rows is not None and mask is not None:  # pos has one row per batch row with a mask
            mask, pos = mask[rows], pos[rows]
        return mask, pos

    def _reach(self, end: int) -> int:
        """Where a forward whose logits reach completion position ``end`` may stop: a
        block-causal model's positions after it change nothing before it (P + end), any other
        model's attend to everything (P + L)."""
        return self.P + end if self.attention_block is not None else self.total

    def _call(self, cache, ids, mask, pos, keep) -> Tensor:
        pos = pos[:, : ids.shape[1]].to(ids.device).expand(ids.shape[0], -1)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache=cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        return out.logits

    def _rows_of(self, rows: Tensor | None, length: int | None = None):
        """The cache itself (all rows), or a copy of ``rows``' cache; with ``length``, a growing
        cache of the first ``length`` positions (a suffix refresh appends to it)."""
        from transformers import Cache, DynamicCache

        if length is not None:
            at = slice(None) if rows is None else rows
            layers = [(k.keys[at, :, :length], k.values[at, :, :length]) for k in self.cache.layers]
            return DynamicCache(layers, config=self.base.config)
        if rows is None:
            return self.cache
        return Cache(layers=[lay.rows(rows) for lay in self.cache.layers])

    def _store(self, layer, rows, keys: Tensor, values: Tensor, prefix: bool = True) -> None:
        """Copy the positions outside the query span of a forward's ``keys``/``values`` (every
        position, in order) into layer ``layer``'s buffers, rows ``rows``: the prefix before
        ``a`` (unless ``prefix`` is False: a suffix refresh read it from the buffers) and, for
        ``dual``, the suffix after the block. The slot is left as it is: every block step
        writes all of it before attending."""
        if len(self.keys) <= layer:  # the first refresh (of every row) makes the buffers
            if rows is not None:
                raise RuntimeError("BlockCache: a refresh of some rows before one of all rows")
            if self.attention_block is not None:  # its forwards may stop short (``_reach``):
                shape = (*keys.shape[:-2], self.total, keys.shape[-1])  # keys never written
                self.keys.append(keys.new_zeros(shape))  # are masked out, and 0, not garbage
                self.values.append(values.new_zeros(shape))
            else:
                self.keys.append(torch.empty_like(keys, memory_format=torch.contiguous_format))
                self.values.append(torch.empty_like(values, memory_format=torch.contiguous_format))
        a, cut_from, total = self.a, self.P + self.hi, keys.shape[-2]
        pieces = [(slice(0, a), slice(0, a))] if prefix else []  # (buffer, forward positions)
        if self.mode == "dual":
            pieces.append((slice(a, a + total - cut_from), slice(cut_from, total)))
        at = slice(None) if rows is None else rows
        for buf, new in ((self.keys[layer], keys), (self.values[layer], values)):
            for dst, src in pieces:
                buf[at, :, dst] = new[:, :, src]

    def _slot_cache(self):
        """The cache block steps run on: the buffers, their first ``cached`` positions kept."""
        from transformers import Cache

        cut_from, total = self.P + self.hi, self.keys[0].shape[-2]
        cached = self.a if self.mode == "prefix" else self.a + total - cut_from
        # prefix: the slot is the block and everything after, or a block-causal model's block
        stop = self._reach(self.hi) if self.mode == "prefix" else total
        layers = [
            _SlotLayer(k[..., :stop, :], v[..., :stop, :], cached)
            for k, v in zip(self.keys, self.values, strict=True)
        ]
        return Cache(layers=layers)

    def refresh(self, inp: Tensor, lo: int, hi: int, end: int, rows: Tensor | None = None):
        """Full forward of ``inp`` [B', P+L] (the batch's ``rows``); logits of completion
        positions lo..end-1. A refresh of some rows keeps the block of the last full one."""
        from transformers import Cache

        a = self._query_start(lo)
        if rows is not None:
            self._check_block("refresh", lo, hi)
        self.a, self.hi = a, hi
        n_layers = self.base.config.num_hidden_layers
        stores = [lambda k, v, i=i: self._store(i, rows, k, v) for i in range(n_layers)]
        cache = Cache(layers=[_RefreshLayer(store) for store in stores])
        keep = torch.arange(a, self.P + end, device=inp.device)
        mask, pos = self._inputs(rows, 0)
        if self.attention_block is not None and self.block_causal is None:
            shape = (inp.shape[0], self.total)
            block, anchor = self.attention_block, self.attention_anchor
            self.block_causal = block_causal_mask(self.attn, shape, block, inp.device, anchor)
        n = self._reach(end)
        mask = None if mask is None else mask[:, :n]
        logits = self._call(cache, inp[:, :n], mask, pos, keep)[:, self.P + lo - a :]
        self.cache = self._slot_cache()
        return logits

    def refresh_suffix(self, inp: Tensor, lo: int, hi: int, end: int, rows=None) -> Tensor:
        """A partial refresh (``trace_refresh="suffix"``): the block and everything after it
        recomputed against the cached prompt and earlier blocks (kept from the last full
        refresh); logits of positions lo..end-1. ``dual`` then caches the new suffix keys."""
        a, P = self._check_block("refresh_suffix", lo, hi), self.P
        cache = self._rows_of(rows, a)  # dual: [prefix, suffix] -> prefix
        keep = torch.arange(0, P + end - a, device=inp.device)
        mask, pos = self._inputs(rows, a)
        n = self._reach(end)
        if self.block_causal is not None:
            mask = self._block_causal_rows(rows, a, n, None)[..., :n]
        logits = self._call(cache, inp[:, a:n], mask, pos, keep)[:, P + lo - a :]
        for i, layer in enumerate(cache.layers):
            self._store(i, rows, layer.keys, layer.values, prefix=False)
        self.cache = self._slot_cache()
        return logits

    def extend(self, inp: Tensor, lo: int, hi: int, end: int, rows: Tensor | None = None):
        """A block-causal model's refresh at the start of block lo..hi-1 (lo > 0): the block
        before it, now final, and everything after it up to ``end`` recomputed against the
        cached prompt and earlier blocks, which nothing they attend to has changed since they
        were cached; logits of positions lo..end-1. Exact: the refresh's logits and keys, at
        end - lo + block query positions instead of P + L."""
        if self.attention_block is None or lo == 0 or lo != self.hi:
            raise RuntimeError("BlockCache.extend: a block-causal model's next block only")
        start, P = self.P + lo - self.attention_block, self.P  # the block just finished
        self.a, self.hi = P + lo, hi
        cache = self._rows_of(rows, start)
        keep = torch.arange(P + lo - start, P + end - start, device=inp.device)
        _, pos = self._inputs(rows, start)
        n = self._reach(end)
        mask = self._block_causal_rows(rows, start, n, None)[..., :n]
        logits = self._call(cache, inp[:, start:n], mask, pos, keep)
        for i, layer in enumerate(cache.layers):
            self._store(i, rows, layer.keys, layer.values)
        self.cache = self._slot_cache()
        return logits

    def block(self, inp: Tensor, lo: int, hi: int, rows: Tensor | None = None) -> Tensor:
        """One block step on the cache of the last refresh: logits of positions lo..hi-1."""
        a, P = self._check_block("block", lo, hi), self.P
        end = P + hi if self.mode == "dual" else self._reach(hi)
        mask, pos = self._inputs(rows, a)
        if self.block_causal is not None:
            order = None  # the keys as stored; dual: prefix, suffix, block
            if self.mode == "dual":
                at = torch.arange(self.total, device=inp.device)
                order = torch.cat([at[:a], at[P + hi :], at[a : P + hi]])
            mask = self._block_causal_rows(rows, a, end, order)
            mask = mask if order is not None else mask[..., :end]  # prefix: keys up to end
        elif mask is not None and self.mode == "dual":
            mask = torch.cat([mask[:, :a], mask[:, P + hi :], mask[:, a : P + hi]], dim=1)
        cache = self._rows_of(rows)
        keep = torch.arange(0, P + hi - a, device=inp.device)
        return self._call(cache, inp[:, a:end], mask, pos[:, : end - a], keep)[:, P + lo - a :]

    def _block_causal_rows(self, rows, start: int, stop: int | None, order: Tensor | None):
        """A block-causal model's mask for a step on cached keys: query positions
        ``start``..``stop``-1, key columns in ``order`` (None: in order), batch rows ``rows``."""
        laid = self.block_causal[:, :, start:stop]
        laid = laid if order is None else laid[..., order]
        return laid if rows is None else laid[rows.to(laid.device)]
