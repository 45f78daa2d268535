"""LLaDA's masked-diffusion sampler, recording the Denoising Progress Scores trace.

METHOD.md §1 (the sampler) and the recording half of §2 (DPS): the trace is read off the logits
the sampler computes anyway, so recording costs no extra forward pass, only the memory of the
log-probability rows it must hold until the tokens they score are known (see `TraceRecorder`).
Faster rollouts (docs/rollouts.md, a daca decision): a block KV cache (`BlockCache`, transformers'
`DynamicCache`) refreshed at every recorded step, and confidence-threshold parallel decoding.

Notation (METHOD.md §1): steps t = 0 .. T-1, x_t the input of step t, M_t the completion positions
masked in x_t, birth(n) the step that commits position n, x*_n the final token at n.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from daca.core.modeling import causal_lm_backbone, forward_logits, full_attention_mask
from daca.core.options import check_sampler


@dataclass
class Rollout:
    """What `generate` returns. B rows, prompt length P, completion length L, T steps.

    sequences:      [B, P+L] long, the prompt (left padded as given) ++ the completion.
    completion_ids: [B, L] long, x_T restricted to the completion (x*).
    birth_step:     [B, L] long, birth(n): the step t that committed position n (METHOD.md §1),
                    counted on the row's own clock (see ``steps_taken``).
    prompt_length:  P.
    With ``dps_stride=s`` (METHOD.md §2), R = ceil(T / s) recorded steps r_j = j*s:
    recorded_steps: [R] long, the r_j.
    progress_logp:  [B, R, L] float32, l[j, n] = log p(x*_n | x_{r_j}); 0 off progress_mask;
                    NaN at every n where row b never reached r_j (parallel decoding only).
    progress_mask:  [B, R, L] bool, n in M_{r_j} (and in the recording scope at r_j).
    last_logp:      [B, L] float32, log p(x*_n | x_{T_b-1}) (last_step="measured"); 0 off last_mask.
    last_mask:      [B, L] bool, n in M_{T_b-1}.
    num_steps:      T, the step budget.
    steps_taken:    [B] long, T_b, the steps row b took: T without ``parallel_threshold``;
                    with it, the steps in which the row still had masked positions in the block
                    being decoded (each commits at least one), so T_b <= T.
    forwards:       {"full": n, "block": m} (and "suffix" with ``trace_refresh="suffix"``), the
                    forward passes run (docs/rollouts.md).
    rows_forwarded: the batch rows those forwards ran: B per forward, or under parallel decoding
                    only the rows still decoding the block (sum of T_b).
    trace_peak_bytes: the most bytes the trace recorder held at once (0 without recording).
    """

    sequences: Tensor
    completion_ids: Tensor
    birth_step: Tensor
    prompt_length: int
    recorded_steps: Tensor | None = None
    progress_logp: Tensor | None = None
    progress_mask: Tensor | None = None
    last_logp: Tensor | None = None
    last_mask: Tensor | None = None
    num_steps: int = 0
    steps_taken: Tensor | None = None
    forwards: dict | None = None
    rows_forwarded: int = 0
    trace_peak_bytes: int = 0


def transfer_schedule(num_masked: Tensor, steps: int) -> Tensor:
    """Tokens to commit at each step of a block: [B] -> [B, steps] long (METHOD.md §1).

    A block with n masked positions and k steps commits n // k per step, the first n % k steps
    one more (LLaDA's linear schedule), so the block is complete after its last step.
    """
    base = (num_masked // steps)[:, None]
    extra = torch.arange(steps, device=num_masked.device)[None, :] < (num_masked % steps)[:, None]
    return base + extra.long()


def threshold_counts(
    confidence: Tensor, threshold: float, schedule_due: Tensor, active: Tensor
) -> list[int]:
    """Commits per row under parallel decoding: [B, W] confidences (-inf where not committable).

    Every open position above ``threshold``, at least one, and at least ``schedule_due`` (what
    LLaDA's schedule still owes, so a block never needs more than its k steps); rows not
    ``active`` commit nothing.
    """
    open_count = torch.isfinite(confidence).sum(1)
    above = (confidence > threshold).sum(1)
    count = torch.maximum(above, schedule_due).clamp_min(1).minimum(open_count)
    return torch.where(active, count, 0).tolist()


def guided_logits(cond: Tensor, uncond: Tensor, cfg_scale: float) -> Tensor:
    """Classifier-free guidance, METHOD.md §1: un + (cfg + 1) * (cond - un)."""
    return uncond + (cfg_scale + 1) * (cond - uncond)


def gumbel_argmax(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """Candidate tokens x0 [...] from logits [..., V] (METHOD.md §1).

    temperature 0: plain argmax. Otherwise LLaDA's Gumbel-max in float64,
    argmax exp(l) / (-log U)^temperature, U ~ Uniform(0, 1) (low-precision noise is a known defect),
    taken in log space, argmax l - temperature * log(-log U): the same argmax, but exp(l)
    overflows float64 above l ≈ 709 (large ``cfg_scale``) and would make every candidate a tie.
    """
    if temperature == 0:
        return logits.argmax(-1)
    u = torch.rand(logits.shape, dtype=torch.float64, generator=generator, device=logits.device)
    return (logits.double() - temperature * torch.log(-torch.log(u))).argmax(-1)


def candidate_confidence(
    logits: Tensor, x0: Tensor, remasking: str, generator: torch.Generator | None
) -> Tensor:
    """Confidence of each candidate, [..., V] logits and [...] x0 -> [...] (METHOD.md §1).

    low_confidence: softmax(logits)[x0] in float64 (as LLaDA); random: Uniform(0, 1).
    """
    if remasking == "low_confidence":
        return F.softmax(logits.double(), dim=-1).gather(-1, x0[..., None]).squeeze(-1)
    return torch.rand(x0.shape, generator=generator, device=x0.device)


def top_confidence_mask(confidence: Tensor, counts: list[int]) -> Tensor:
    """Commit the counts[b] most confident positions of row b: [B, W] -> [B, W] bool.

    Positions that must not be committed carry confidence -inf.
    """
    commit = torch.zeros(confidence.shape, dtype=torch.bool, device=confidence.device)
    if len(set(counts)) == 1:  # one batched topk; rows share the schedule in practice
        commit.scatter_(1, confidence.topk(counts[0], dim=1).indices, True)
    else:
        for b, k in enumerate(counts):
            commit[b, confidence[b].topk(k).indices] = True
    return commit


def token_logp(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits)[token] at temperature 1, in float32: [..., V], [...] -> [...]."""
    lse = torch.logsumexp(logits.float(), dim=-1)
    return logits.gather(-1, tokens[..., None]).squeeze(-1).float() - lse


class _Rows:
    """Held logits rows of one snapshot for the masked positions of one block.

    rows [N, V] (the logits' dtype) with their float32 logsumexp [N], so that
    log p = rows[i, x*] - lse[i]; slot [B, block_length] maps a position to its row (-1: none);
    js [B] long, the recorded step index j of each row in this snapshot (-1: row not recorded).
    """

    def __init__(self, js: Tensor, rows: Tensor, slot: Tensor):
        self.js, self.rows, self.slot = js, rows, slot
        self.lse = torch.logsumexp(rows.float(), dim=-1)
        self.live = rows.shape[0]

    def logp_at(self, tokens: Tensor) -> Tensor:
        """log p(tokens) at each position's row: [B, bl] -> [B, bl] (garbage where no row)."""
        idx = self.slot.clamp_min(0)
        return self.rows[idx, tokens].float() - self.lse[idx]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in (self.rows, self.lse, self.slot, self.js))

    def compact(self) -> None:
        """Keep only the live rows (one copy of them)."""
        alive = self.slot >= 0
        keep = self.slot[alive]
        self.rows, self.lse = self.rows[keep], self.lse[keep]
        self.slot = torch.full_like(self.slot, -1)
        self.slot[alive] = torch.arange(keep.numel(), device=keep.device)


class TraceRecorder:
    """Records the DPS trace (METHOD.md §2) from logits the sampler already computed.

    At a recorded step r_j the log-probability rows of the masked positions in scope are needed
    later at x*_n, which is known only at birth(n). Scope "all": M_{r_j}. Scope "block":
    M_{r_j} within the block being decoded and within the block of the next recorded state
    (r_{j+1}, or the last step T-1 after r_m), so that every interval, also one that crosses
    blocks, compares the two states on a non-empty common set (docs/rollouts.md). Positions born
    at r_j itself are gathered at once; the others keep their logits row (dtype of the logits,
    e bytes per entry) plus a float32 logsumexp, grouped per (snapshot, block). At each step the
    rows of the positions just born are gathered from every held snapshot and released: a group
    is compacted (one copy of its live rows) when at most half of its rows are live, and dropped
    when none is, so every row is copied O(1) times. Rows of later blocks are never touched until
    their block is decoded.

    Each row b counts steps on its own clock t_b (``Rollout.steps_taken``); without parallel
    decoding every row's clock is the global step t, and it is recorded at t = j*s.

    Peak memory, per sequence, with k = T / num_blocks steps per block. The live rows after step t
    are sum_{j: r_j <= t} |M_{t+1} ∩ scope_j|, that is
        scope "all":   (floor(t / s) + 1) * |M_{t+1}|
        scope "block": (#{j : r_j in the current block, r_j <= t} + c) * |M_{t+1} ∩ current block|,
    c = 1 if the last recorded step of the previous block reached into this one, else 0.
    With the uniform schedule (k divides block_length) |M_{t+1}| = L (T - t - 1) / T, and the
    peak of the live rows is, in closed form (continuous t, s <= k for "block"),
        "all":   L (T + s - 1)^2 / (4 s T)            ≈ L T / (4 s)             (at t ≈ T/2)
        "block": block_length (k + s - 1)^2 / (4 s k) ≈ block_length k / (4 s) (mid-block),
    plus, under "block", up to one block_length of rows held for the next block.
    Held rows exceed the live ones only in the current block's groups, by less than their live
    rows (the halving rule), so held ≤ live + (number of snapshots) * |M_{t+1} ∩ current block|;
    under "block" each of the ceil(k / s) + 1 groups of a block holds at most block_length rows.
    Bytes = rows * (V * e + 4) + (groups held) * B * (block_length + 1) * 8 (the index).
    Everything is released by the end of generation (every position is born).
    """

    def __init__(
        self,
        *,
        batch: int,
        gen_length: int,
        block_length: int,
        num_steps: int,
        stride: int,
        scope: str,
        device: torch.device,
    ):
        self.L, self.bl, self.T = gen_length, block_length, num_steps
        self.k = num_steps // (gen_length // block_length)
        self.s, self.scope = stride, scope
        self.recorded_steps = torch.arange(0, num_steps, stride, device=device)
        R = self.recorded_steps.numel()
        self.progress_logp = torch.zeros(batch, R, gen_length, dtype=torch.float32, device=device)
        self.progress_mask = torch.zeros(batch, R, gen_length, dtype=torch.bool, device=device)
        self.last_logp = torch.zeros(batch, gen_length, dtype=torch.float32, device=device)
        self.last_mask = torch.zeros(batch, gen_length, dtype=torch.bool, device=device)
        self.groups: dict[int, list[_Rows]] = {}  # block -> held rows of each snapshot
        self.held_bytes = 0
        self.peak_bytes = 0

    def recorded_rows(self, clock: Tensor, active: Tensor) -> Tensor:
        """Rows recorded at this step, [B] bool: active rows whose own step is some r_j."""
        return active & (clock % self.s == 0)

    def reach_block(self, t: int, block: int) -> int:
        """The last block whose logits a recorded step t of ``block`` needs (on the global clock,
        which is every row's clock without parallel decoding)."""
        if self.scope == "all":
            return self.L // self.bl - 1
        nxt = min(t + self.s, self.T - 1)
        return max(block, nxt // self.k)

    def step(
        self,
        *,
        block: int,
        reach: int,
        logits: Tensor,
        masked: Tensor,
        born: Tensor,
        tokens: Tensor,
        clock: Tensor,
        recorded: Tensor,
        last: Tensor,
    ) -> None:
        """Record one step of the given block.

        logits [B, W, V]: the logits the sampler used for completion positions block*bl ..
        block*bl + W - 1 (W >= (reach + 1 - block) * bl when a row is recorded, else >= bl);
        masked [B, L]: M before the step; born [B, bl]: the positions of the block committed now;
        tokens [B, bl]: the block after the commit (x* where born); clock [B]: each row's own
        step; recorded [B]: rows recorded now (j = clock // s); last [B]: rows whose last step
        this is (their M_{T_b-1}).
        """
        bl, lo, hi = self.bl, block * self.bl, (block + 1) * self.bl
        self._release(block, born, tokens)
        gather_now = born & (recorded | last)[:, None]  # positions born now: x* is known
        now = torch.zeros(born.shape, dtype=torch.float32, device=born.device)
        now[gather_now] = token_logp(logits[:, :bl][gather_now], tokens[gather_now])
        if bool(recorded.any()):
            self._snapshot(block, reach, logits, masked, born, now, clock, recorded)
        if bool(last.any()):
            self.last_mask[last] = masked[last]
            self.last_logp[last, lo:hi] = torch.where(born[last], now[last], 0.0)
        self.held_bytes = sum(g.nbytes for gs in self.groups.values() for g in gs)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _snapshot(self, block, reach, logits, masked, born, now, clock, recorded) -> None:
        bl, lo, hi = self.bl, block * self.bl, (block + 1) * self.bl
        rows_b = recorded.nonzero().squeeze(1)
        js = torch.where(recorded, clock // self.s, -1)
        in_scope = torch.zeros_like(masked)
        for c in sorted({block, reach}):
            in_scope[:, c * bl : (c + 1) * bl] = masked[:, c * bl : (c + 1) * bl]
        if self.scope == "all":
            in_scope = masked
        self.progress_mask[rows_b, js[rows_b]] = in_scope[rows_b]
        self.progress_logp[rows_b, js[rows_b], lo:hi] = torch.where(born, now, 0.0)[rows_b]
        keep = masked[:, lo:hi] & ~born & recorded[:, None]
        self._hold(block, js, logits[:, :bl], keep)
        # Later blocks in scope are still fully masked: hold all their rows.
        later = range(block + 1, reach + 1) if self.scope == "all" else [reach] * (reach > block)
        for c in later:
            part = logits[:, (c - block) * bl : (c - block + 1) * bl]
            self._hold(c, js, part, recorded[:, None].expand(-1, bl))

    def _hold(self, block: int, js: Tensor, logits: Tensor, keep: Tensor) -> None:
        """Hold the rows logits[keep] ([B, bl, V], [B, bl] bool) for positions of ``block``."""
        rows = logits[keep]
        if rows.shape[0] == 0:
            return
        slot = torch.full(keep.shape, -1, dtype=torch.long, device=keep.device)
        slot[keep] = torch.arange(rows.shape[0], device=keep.device)
        self.groups.setdefault(block, []).append(_Rows(js, rows, slot))

    def _release(self, block: int, born: Tensor, tokens: Tensor) -> None:
        """Gather l[j, n] of the positions born in this block from every snapshot; free them.

        Every position born after a snapshot was masked then, so it has a row in each group
        that holds its sequence.
        """
        groups = self.groups.get(block)
        if not groups or not bool(born.any()):
            return
        lo, hi = block * self.bl, (block + 1) * self.bl
        kept = []
        for g in groups:
            rows_b = (g.js >= 0).nonzero().squeeze(1)
            js = g.js[rows_b]
            vals = g.logp_at(tokens)[rows_b]
            old = self.progress_logp[rows_b, js, lo:hi]
            self.progress_logp[rows_b, js, lo:hi] = torch.where(born[rows_b], vals, old)
            freed = born & (g.slot >= 0)
            g.live -= int(freed.sum())
            g.slot.masked_fill_(freed, -1)
            if g.live == 0:
                continue
            if 2 * g.live <= g.rows.shape[0]:
                g.compact()
            kept.append(g)
        if kept:
            self.groups[block] = kept
        else:
            del self.groups[block]

    def finish(self, steps_taken: Tensor) -> None:
        """Keep the recorded steps some row reached; mark (b, j) never reached with NaN."""
        if self.groups:  # every position is born, so nothing may remain held
            raise RuntimeError("trace recorder still holds rows after the last step")
        reached = self.recorded_steps[None, :] < steps_taken[:, None]  # [B, R]
        R = int(reached.any(0).sum())
        self.recorded_steps = self.recorded_steps[:R]
        self.progress_logp = self.progress_logp[:, :R]
        self.progress_mask = self.progress_mask[:, :R]
        self.progress_logp[~reached[:, :R]] = math.nan


def _cache_backbone(model, cache: str):
    """``causal_lm_backbone(model)``, else a ValueError naming the cache asked for."""
    base = causal_lm_backbone(model)
    if base is None:
        raise ValueError(
            f"cache={cache!r} needs a model on transformers' Llama or Qwen2 classes (LLaDA, "
            f"Dream, daca's tiny models via daca.models.load); {type(model).__name__} has no KV "
            "cache daca can use: use cache='none'"
        )
    return base


class BlockCache:
    """A block KV cache over transformers' ``DynamicCache`` (docs/rollouts.md).

    ``refresh`` runs one full forward over prompt ++ completion and keeps the keys/values of the
    positions outside the query span of later steps: ``prefix`` keeps the prompt and the earlier
    blocks (later steps recompute the block and everything after it); ``dual`` keeps the masked
    suffix too (later steps run only the block). ``block`` runs one such step and crops the cache
    back. Keys are cached after RoPE, so every forward passes explicit ``position_ids`` (counted
    from the first real token of a left-padded row, as the full forward) and a 2-D padding mask
    over [cache, query] in the order the keys are stored (dual: prefix, suffix, block).

    Every call takes ``rows``, the batch rows to run (None: all): under parallel decoding a row
    that has finished the block takes no step, and rows on their own clocks may need different
    forwards at one step. A refresh of some rows writes their keys into the cache, whose other
    rows keep theirs; a block step on some rows runs on a copy of their cache.

    Dream's logits at i come from the hidden state at i-1 (``DreamForDiffusionLM`` undoes the
    shift within one forward), so for Dream the query span starts one position earlier and that
    position's key is not cached.
    """

    def __init__(self, model, mode: str, attn: Tensor | None, prompt_length: int, total: int):
        self.base = _cache_backbone(model, mode)
        self.model, self.mode, self.P = model, mode, prompt_length
        self.shift = getattr(self.base, "logits_shift", 0)  # Dream's 1 (daca.models.native)
        self.attn = attn
        if attn is None:
            self.pos = torch.arange(total)[None]
        else:
            self.pos = (attn.long().cumsum(-1) - 1).clamp_min(0)
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

    def _call(self, cache, ids, mask, pos, keep) -> Tensor:
        pos = pos.to(ids.device).expand(ids.shape[0], -1)
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
        """The cache itself (all rows, cropped to ``length``), or a copy of ``rows``' first
        ``length`` positions."""
        from transformers import DynamicCache

        if rows is None:
            if length is not None:
                self._crop_to(self.cache, length)
            return self.cache
        stop = length if length is not None else self.cache.get_seq_length()
        layers = [
            (lay.keys[rows, :, :stop], lay.values[rows, :, :stop]) for lay in self.cache.layers
        ]
        return DynamicCache(layers, config=self.base.config)

    def _store(self, cache, rows: Tensor | None) -> None:
        """Keep the positions outside the query span of ``cache`` as the cache of ``rows``."""
        cache = self._outside_query(cache)
        if rows is None:
            self.cache = cache
            return
        for mine, new in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys[rows], mine.values[rows] = new.keys, new.values

    @staticmethod
    def _crop_to(cache, length: int) -> None:
        extra = cache.get_seq_length() - length
        if extra > 0:  # transformers' crop takes the number of positions to drop, negated
            cache.crop(-extra)

    def _outside_query(self, cache):
        """From a cache of every position, what later block steps do not recompute: the prefix
        (positions before ``a``), and for ``dual`` the suffix after the block."""
        from transformers import DynamicCache

        a, cut_from = self.a, self.P + self.hi
        if self.mode == "prefix":
            self._crop_to(cache, a)
            return cache
        cut = lambda t: torch.cat([t[..., :a, :], t[..., cut_from:, :]], dim=-2)  # noqa: E731
        layers = [(cut(layer.keys), cut(layer.values)) for layer in cache.layers]
        return DynamicCache(layers, config=self.base.config)

    def refresh(self, inp: Tensor, lo: int, hi: int, end: int, rows: Tensor | None = None):
        """Full forward of ``inp`` [B', P+L] (the batch's ``rows``); logits of completion
        positions lo..end-1. A refresh of some rows keeps the block of the last full one."""
        from transformers import DynamicCache

        a = self._query_start(lo)
        if rows is not None:
            self._check_block("refresh", lo, hi)
        cache = DynamicCache(config=self.base.config)
        keep = torch.arange(a, self.P + end, device=inp.device)
        mask, pos = self._inputs(rows, 0)
        logits = self._call(cache, inp, mask, pos, keep)[:, self.P + lo - a :]
        self.a, self.hi = a, hi
        self._store(cache, rows)
        return logits

    def refresh_suffix(self, inp: Tensor, lo: int, hi: int, end: int, rows=None) -> Tensor:
        """A partial refresh (``trace_refresh="suffix"``): the block and everything after it
        recomputed against the cached prompt and earlier blocks (kept from the last full
        refresh); logits of positions lo..end-1. ``dual`` then caches the new suffix keys."""
        a, P = self._check_block("refresh_suffix", lo, hi), self.P
        cache = self._rows_of(rows, a)  # dual: [prefix, suffix] -> prefix
        keep = torch.arange(0, P + end - a, device=inp.device)
        mask, pos = self._inputs(rows, a)
        logits = self._call(cache, inp[:, a:], mask, pos, keep)[:, P + lo - a :]
        self._store(cache, rows)
        return logits

    def block(self, inp: Tensor, lo: int, hi: int, rows: Tensor | None = None) -> Tensor:
        """One block step on the cache of the last refresh: logits of positions lo..hi-1."""
        a, P = self._check_block("block", lo, hi), self.P
        end = P + hi if self.mode == "dual" else inp.shape[1]
        mask, pos = self._inputs(rows, a)
        if mask is not None and self.mode == "dual":
            mask = torch.cat([mask[:, :a], mask[:, P + hi :], mask[:, a : P + hi]], dim=1)
        cache = self._rows_of(rows)
        keep = torch.arange(0, P + hi - a, device=inp.device)
        logits = self._call(cache, inp[:, a:end], mask, pos[:, : end - a], keep)[:, P + lo - a :]
        if rows is None:  # a copy of some rows is dropped; the cache itself is cropped back
            cache.crop(-(end - a))
        return logits


def _forward_kind(block_cache, i: int, traced: bool, refresh_every, trace_refresh) -> str:
    """Which forward a step runs (docs/rollouts.md): "full" (no cache, a block start, every
    ``refresh_every``-th step of a block, a recorded step), "suffix" (a recorded step with
    ``trace_refresh="suffix"``) or "block"."""
    if block_cache is None or i == 0 or (refresh_every is not None and i % refresh_every == 0):
        return "full"
    if traced:
        return "full" if trace_refresh == "full" else "suffix"
    return "block"


def _check_prompts(prompt_ids: Tensor, attention_mask: Tensor | None) -> None:
    if prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids must be [B, P], got shape {tuple(prompt_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != prompt_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != prompt_ids shape "
            f"{tuple(prompt_ids.shape)}"
        )


class _Sampler:
    """One call of ``generate``: x, the masked set M, births and each row's clock, updated step by
    step (METHOD.md §1 notation), and the forwards counted (docs/rollouts.md)."""

    def __init__(self, model, prompt_ids, attention_mask, *, mask_id, gen_length, steps,
                 block_length, temperature, cfg_scale, remasking, generator, cache, refresh_every,
                 trace_refresh, parallel_threshold, recorder):  # fmt: skip
        B, P = prompt_ids.shape
        device = prompt_ids.device
        self.model, self.B, self.P, self.L, self.bl = model, B, P, gen_length, block_length
        self.steps, self.k = steps, steps // (gen_length // block_length)
        self.temperature, self.cfg_scale, self.remasking = temperature, cfg_scale, remasking
        self.generator, self.tau, self.recorder = generator, parallel_threshold, recorder
        self.refresh_every, self.trace_refresh = refresh_every, trace_refresh
        masks = torch.full((B, gen_length), mask_id, dtype=torch.long, device=device)
        self.x = torch.cat([prompt_ids, masks], 1)
        self.attn = full_attention_mask(attention_mask, prompt_ids, gen_length)
        if cfg_scale > 0:  # the unconditional half: the same input with the prompt masked
            self.un_prompt = torch.full_like(prompt_ids, mask_id)
            self.attn = None if self.attn is None else torch.cat([self.attn, self.attn])
        self.block_cache = (
            None if cache == "none" else BlockCache(model, cache, self.attn, P, P + gen_length)
        )
        self.masked = torch.ones(B, gen_length, dtype=torch.bool, device=device)  # M_t
        self.birth = torch.full((B, gen_length), -1, dtype=torch.long, device=device)
        self.clock = torch.zeros(B, dtype=torch.long, device=device)  # each row's own step t_b
        self.everyone = torch.ones(B, dtype=torch.bool, device=device)
        suffix = {"suffix": 0} if trace_refresh == "suffix" else {}
        self.forwards = {"full": 0, "block": 0} | suffix
        self.rows_forwarded = 0  # rows run through those forwards (B each without a threshold)
        self.t = 0  # the global step

    def run(self) -> Rollout:
        for c in range(self.L // self.bl):
            self._decode_block(c)
        return self._rollout()

    def _decode_block(self, c: int) -> None:
        """Block c's k steps (fewer under parallel decoding once every row has finished it)."""
        lo, hi = c * self.bl, (c + 1) * self.bl
        start_open = self.masked[:, lo:hi].sum(1)
        schedule = transfer_schedule(start_open, self.k)
        counts = schedule.tolist()
        owed = schedule.cumsum(1)  # commits the schedule requires by the end of each step
        for i in range(self.k):
            active = self.everyone if self.tau is None else self.masked[:, lo:hi].any(1)
            if not bool(active.any()):
                break
            self._step(c, i, active, counts, owed, start_open)

    def _step(self, c, i, active, counts, owed, start_open) -> None:
        """Step i of block c: one forward, candidates, the commits, the trace."""
        lo, hi = c * self.bl, (c + 1) * self.bl
        recorder = self.recorder
        recorded = None if recorder is None else recorder.recorded_rows(self.clock, active)
        traced = recorded is not None and bool(recorded.any())
        # only the current block's logits decide commits; the trace may need later blocks
        reach = recorder.reach_block(self.t, c) if traced else c
        logits = self._logits(lo, hi, (reach + 1) * self.bl, i, active, recorded)
        open_block = self.masked[:, lo:hi]
        x0, confidence = self._candidates(logits, open_block)
        if self.tau is None:
            step_counts = [row[i] for row in counts]
        else:
            due = owed[:, i] - (start_open - open_block.sum(1))
            step_counts = threshold_counts(confidence, self.tau, due, active)
        born = top_confidence_mask(confidence, step_counts)
        block_tokens = self.x[:, self.P + lo : self.P + hi]  # a view: committing writes into x
        block_tokens[born] = x0[born[open_block]]
        self.birth[:, lo:hi] = torch.where(born, self.clock[:, None], self.birth[:, lo:hi])
        if recorder is not None:
            recorder.step(
                block=c,
                reach=reach,
                logits=logits,
                masked=self.masked,
                born=born,
                tokens=block_tokens,
                clock=self.clock,
                recorded=recorded,
                last=self._last_rows(active, born),
            )
        self.masked[:, lo:hi] &= ~born
        self.clock += active.long()
        self.t += 1

    def _logits(self, lo, hi, end, i, active, recorded) -> Tensor:
        """Logits [B, end - lo, V] of completion positions lo..end-1 (guided with cfg_scale > 0).

        Each active row runs the forward it would run alone (``_forward_kind``): under parallel
        decoding rows keep their own clocks, so at one step some rows are recorded (a refresh,
        to ``end``) and others not (a block step, to ``hi``); two forwards then run, each on its
        rows. Rows that are not active (they finished the block) run nothing: their logits are
        0 and never read, as they have nothing left to commit in the block.
        """
        cache, every = self.block_cache, self.refresh_every
        rec = torch.zeros_like(active) if recorded is None else recorded
        kind_rec = _forward_kind(cache, i, True, every, self.trace_refresh)
        kind_plain = _forward_kind(cache, i, False, every, self.trace_refresh)
        groups = [(rec, kind_rec, end), (active & ~rec, kind_plain, hi)]
        groups = [g for g in groups if bool(g[0].any())]
        if len(groups) == 2 and kind_rec == kind_plain:  # one forward serves both
            groups = [(active, kind_rec, end)]
        parts = [(rows, self._forward(rows, kind, lo, hi, w)) for rows, kind, w in groups]
        if len(parts) == 1 and bool(active.all()):
            return parts[0][1]
        first = parts[0][1]
        out = first.new_zeros(self.B, end - lo, first.shape[-1])
        for rows, logits in parts:
            out[rows, : logits.shape[1]] = logits
        return out

    def _forward(self, rows: Tensor, kind: str, lo: int, hi: int, end: int) -> Tensor:
        """One forward of ``kind`` on the batch rows ``rows`` [B] bool: logits [rows, end - lo,
        V] ("block": hi - lo), guided with cfg_scale > 0."""
        x, P, B, cache = self.x, self.P, self.B, self.block_cache
        idx = None if bool(rows.all()) else rows.nonzero().squeeze(1)
        inp = x if self.cfg_scale == 0 else torch.cat([x, torch.cat([self.un_prompt, x[:, P:]], 1)])
        sel = idx if idx is None or self.cfg_scale == 0 else torch.cat([idx, idx + B])
        if sel is not None:
            inp = inp[sel]
        if cache is None:
            attn = self.attn if sel is None or self.attn is None else self.attn[sel]
            logits = forward_logits(self.model, inp, attn, last=inp.shape[1] - P - lo, stop=P + end)
        elif kind == "full":
            logits = cache.refresh(inp, lo, hi, end, sel)
        elif kind == "suffix":
            logits = cache.refresh_suffix(inp, lo, hi, end, sel)
        else:
            logits = cache.block(inp, lo, hi, sel)
        self.forwards[kind] += 1
        self.rows_forwarded += B if idx is None else idx.numel()
        if self.cfg_scale > 0:
            half = logits.shape[0] // 2
            logits = guided_logits(logits[:half], logits[half:], self.cfg_scale)
        return logits

    def _candidates(self, logits: Tensor, open_block: Tensor) -> tuple[Tensor, Tensor]:
        """Candidates x0 [N] of the N masked block positions (row order) and the confidence
        [B, bl] of every block position (-inf where nothing can be committed): computed only
        where they can be committed."""
        cand_logits = logits[:, : self.bl][open_block]  # [N, V]
        x0 = gumbel_argmax(cand_logits, self.temperature, self.generator)
        conf = candidate_confidence(cand_logits, x0, self.remasking, self.generator)
        confidence = torch.full(
            (self.B, self.bl), -math.inf, dtype=conf.dtype, device=open_block.device
        )
        confidence[open_block] = conf
        return x0, confidence

    def _last_rows(self, active: Tensor, born: Tensor) -> Tensor:
        """Rows whose last step this is: every row at step T-1; under parallel decoding, the
        rows that commit their last masked position now."""
        if self.tau is None:
            return self.everyone if self.t == self.steps - 1 else ~self.everyone
        return active & (self.masked.sum(1) == born.sum(1))

    def _rollout(self) -> Rollout:
        x, recorder = self.x, self.recorder
        rollout = Rollout(
            sequences=x,
            completion_ids=x[:, self.P :],
            birth_step=self.birth,
            prompt_length=self.P,
            num_steps=self.steps,
            steps_taken=self.clock,
            forwards=self.forwards,
            rows_forwarded=self.rows_forwarded,
        )
        if recorder is not None:
            recorder.finish(self.clock)
            rollout.recorded_steps = recorder.recorded_steps
            rollout.progress_logp = recorder.progress_logp
            rollout.progress_mask = recorder.progress_mask
            rollout.last_logp, rollout.last_mask = recorder.last_logp, recorder.last_mask
            rollout.trace_peak_bytes = recorder.peak_bytes
        return rollout


@torch.no_grad()
def generate(
    model,
    prompt_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    mask_id: int,
    gen_length: int,
    steps: int,
    block_length: int,
    temperature: float = 0.0,
    cfg_scale: float = 0.0,
    remasking: str = "low_confidence",
    generator: torch.Generator | None = None,
    dps_stride: int | None = None,
    dps_scope: str = "all",
    cache: str = "none",
    refresh_every: int | None = None,
    trace_refresh: str = "full",
    parallel_threshold: float | None = None,
) -> Rollout:
    """Sample completions with LLaDA's semi-autoregressive remasking sampler (METHOD.md §1).

    prompt_ids [B, P] long (left padded, with attention_mask [B, P] marking real tokens) ->
    Rollout. The completion (L = gen_length) is split into blocks of block_length decoded left
    to right with k = steps / num_blocks steps each (per-block schedule: `transfer_schedule`).
    Each step runs one forward of the model (a batch of 2B with cfg_scale > 0, the second half
    with the prompt masked), draws candidates (`gumbel_argmax`), scores them
    (`candidate_confidence`) and commits the most confident masked positions of the current
    block; a committed position is never re-masked. With temperature 0 and low_confidence this
    commits the same tokens in the same order as LLaDA's `generate`; softmax and noise are
    computed only on the masked positions of the current block, which changes no committed
    token. All randomness comes from `generator` (on the model's device). A position is committed
    once even if its candidate is mask_id (LLaDA would then treat it as still masked; a trained
    model never predicts it).

    dps_stride=s records the DPS trace (METHOD.md §2) at recorded steps r_j = j*s, in scope
    dps_scope ("all" or "block"), without an extra forward (`TraceRecorder`); s must be below
    ``steps`` (one recorded step has no interval). The model's train/eval mode is left as the
    caller set it.

    cache (docs/rollouts.md): "none" (a full forward every step, the algorithm above exactly),
    "prefix" or "dual" (`BlockCache`, Llama/Qwen2 models only): a full forward refreshes the
    cache at every block start and at every recorded step, so recorded steps see every masked
    position exactly as with "none"; the other steps run only the block (dual) or the block and
    its suffix (prefix) against cached keys. Cost, L 256, T 128, block 32 (k 16), prompt 128,
    counted in token-forwards (every per-layer cost scales with the query length):
    none 128 full = 49152; dual 8 full + 120 block = 6912 (bound 7.1x), with s = 4
    32 full + 96 block = 15360 (3.2x); prefix 8 full + 120 x (block + suffix, mean 144) = 20352
    (2.4x), with s = 4 26112 (1.9x). ``refresh_every=n`` adds a full refresh at every n-th step
    of a block (steps i = 0, n, 2n, ...): a bound on staleness for decoding in one long block,
    where a refresh per block is a single one. ``trace_refresh="suffix"`` makes a recorded step
    that is not a refresh anyway reuse the cached prompt and earlier blocks and recompute only
    the block and its suffix (``Rollout.forwards["suffix"]``): dual s = 4 above becomes 8 full +
    24 suffix + 96 block = 9600 (5.1x), and the recorded logits are approximate in the prefix
    keys.

    parallel_threshold=τ: each step commits every masked position of the current block whose
    confidence exceeds τ, at least one and at least what LLaDA's schedule still owes (so no block
    takes more than k steps). Rows finish a block at different steps; the batch moves to the next
    block when every row has finished it, and a row that has finished waits: it takes no step
    and runs through no forward. Each row counts its own steps t_b = 0 .. T_b - 1
    (``Rollout.steps_taken``): ``birth_step`` and the recorded steps r_j = j*s are on that
    clock, and each row runs the forward it would run alone (recorded rows a refresh, the others
    a block step), so its trace is the one it would have alone; j >= ceil(T_b / s) is never reached
    (NaN in ``progress_logp``) and `daca.core.dps` leaves such intervals out of the statistics.
    Without parallel_threshold every row takes every step (t_b = t, T_b = T).
    """
    _check_prompts(prompt_ids, attention_mask)
    check_sampler(
        gen_length=gen_length,
        steps=steps,
        block_length=block_length,
        temperature=temperature,
        cfg_scale=cfg_scale,
        remasking=remasking,
        cache=cache,
        refresh_every=refresh_every,
        trace_refresh=trace_refresh,
        parallel_threshold=parallel_threshold,
        dps_stride=dps_stride,
        dps_scope=dps_scope,
        traced=dps_stride is not None,
    )
    recorder = None
    if dps_stride is not None:
        recorder = TraceRecorder(
            batch=prompt_ids.shape[0],
            gen_length=gen_length,
            block_length=block_length,
            num_steps=steps,
            stride=dps_stride,
            scope=dps_scope,
            device=prompt_ids.device,
        )
    sampler = _Sampler(
        model, prompt_ids, attention_mask, mask_id=mask_id, gen_length=gen_length, steps=steps,
        block_length=block_length, temperature=temperature, cfg_scale=cfg_scale,
        remasking=remasking, generator=generator, cache=cache, refresh_every=refresh_every,
        trace_refresh=trace_refresh, parallel_threshold=parallel_threshold, recorder=recorder,
    )  # fmt: skip
    return sampler.run()
