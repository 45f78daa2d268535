"""Recording the Denoising Progress Scores trace (METHOD.md §2) off the sampler's logits.

The trace costs no extra forward pass, only the memory of the log-probability rows it must hold
until the tokens they score are known, and a few tensor operations per step: every step's work
is batched over the held snapshots of a block (`_BlockRows`), so a step's cost does not grow with
the number of snapshots (docs/rollouts.md, "Where a step's time goes").
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def token_logp(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits)[token] at temperature 1, in float32: [..., V], [...] -> [...]."""
    lse = torch.logsumexp(logits.float(), dim=-1)
    return logits.gather(-1, tokens[..., None]).squeeze(-1).float() - lse


class _BlockRows:
    """The held logits rows of one block's positions, one chunk per snapshot (recorded step).

    Chunk g holds rows[g] [N_g, V] (the logits' dtype) and lse[g] [N_g] float32, so that
    log p = rows[g][i, x*] - lse[g][i]; slot [G, B, bl] long maps (chunk, batch row, position in
    the block) to the chunk's row (-1: none); js [G, B] long is the recorded step index j of each
    batch row in that snapshot (-1: not recorded). ``release`` reads every chunk at once.
    """

    def __init__(self):
        self.rows: list[Tensor] = []
        self.lse: list[Tensor] = []
        self.slot: Tensor | None = None
        self.js: Tensor | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_rows(self) -> int:
        return sum(r.shape[0] for r in self.rows)

    @property
    def nbytes(self) -> int:
        """Rows, logsumexps and the index (slot and js) held."""
        held = sum(r.numel() * r.element_size() + 4 * r.shape[0] for r in self.rows)
        return held + self.slot.numel() * 8 + self.js.numel() * 8 if self.rows else 0

    def add(self, js: Tensor, rows: Tensor, slot: Tensor) -> None:
        """Hold one snapshot's rows [N, V] at slot [B, bl] of batch rows recorded as js [B]."""
        self.rows.append(rows)
        self.lse.append(torch.logsumexp(rows.float(), dim=-1))
        first = self.slot is None
        self.slot = slot[None] if first else torch.cat([self.slot, slot[None]])
        self.js = js[None] if first else torch.cat([self.js, js[None]])

    def release(self, born: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Gather log p(x*_n) at every held row of the positions ``born`` [B, bl] (x* =
        ``tokens`` [B, bl] there) and free those rows. Returns (b, j, n, logp), one entry per
        (snapshot, born position) held: batch row, recorded step index, position in the block.

        A chunk is compacted (one copy of its live rows) when at most half of its rows are live,
        and dropped when none is, so every row is copied O(1) times.
        """
        bs, ns = born.nonzero(as_tuple=True)  # [K] each
        if bs.numel() == 0:  # nothing born: nothing to gather or free
            return bs, bs, ns, bs.float()
        slot = self.slot[:, bs, ns]  # [G, K]
        idx = slot.clamp_min(0)
        tok = tokens[bs, ns]
        vals = torch.stack([rows[i, tok] for rows, i in zip(self.rows, idx, strict=True)])
        offsets = torch.tensor([0] + [r.shape[0] for r in self.rows[:-1]]).cumsum(0)
        logp = vals.float() - torch.cat(self.lse)[offsets.to(idx.device)[:, None] + idx]
        g, k = (slot >= 0).nonzero(as_tuple=True)  # a held slot's batch row is recorded (js >= 0)
        b = bs[k]
        out = (b, self.js[g, b], ns[k], logp[g, k])
        self.slot[:, bs, ns] = -1
        self._free(self.slot.flatten(1).ge(0).sum(1).tolist())
        return out

    def _free(self, live: list[int]) -> None:
        """Drop the chunks with no live row, compact those at most half live."""
        keep = [g for g, n in enumerate(live) if n > 0]
        for g in keep:
            if 2 * live[g] <= self.rows[g].shape[0]:
                self._compact(g)
        if len(keep) < len(live):
            self.rows = [self.rows[g] for g in keep]
            self.lse = [self.lse[g] for g in keep]
            index = torch.tensor(keep, dtype=torch.long, device=self.slot.device)
            self.slot, self.js = self.slot[index], self.js[index]

    def _compact(self, g: int) -> None:
        slot = self.slot[g]
        alive = slot >= 0
        keep = slot[alive]
        self.rows[g], self.lse[g] = self.rows[g][keep], self.lse[g][keep]
        slot.fill_(-1)
        slot[alive] = torch.arange(keep.numel(), device=keep.device)


class TraceRecorder:
    """Records the DPS trace (METHOD.md §2) from logits the sampler already computed.

    At a recorded step r_j the log-probability rows of the masked positions in scope are needed
    later at x*_n, which is known only at birth(n). Scope "all": M_{r_j}. Scope "block":
    M_{r_j} within the block being decoded and within the block of the next recorded state
    (r_{j+1}, or the last step T-1 after r_m), so that every interval, also one that crosses
    blocks, compares the two states on a non-empty common set (docs/rollouts.md). Positions born
    at r_j itself are gathered at once; the others keep their logits row (dtype of the logits,
    e bytes per entry) plus a float32 logsumexp, in one chunk per (snapshot, block). At each step
    the rows of the positions just born are gathered from every held snapshot and released: a
    chunk is compacted (one copy of its live rows) when at most half of its rows are live, and
    dropped when none is, so every row is copied O(1) times. Rows of later blocks are never
    touched until their block is decoded.

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
    Held rows exceed the live ones only in the current block's chunks, by less than their live
    rows (the halving rule), so held ≤ live + (number of snapshots) * |M_{t+1} ∩ current block|;
    under "block" each of the ceil(k / s) + 1 chunks of a block holds at most block_length rows.
    Bytes = rows * (V * e + 4) + (chunks held) * B * (block_length + 1) * 8 (the index).
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
        self.groups: dict[int, _BlockRows] = {}  # block -> the rows held for its positions
        self.held_bytes = 0
        self.peak_bytes = 0

    @property
    def held_rows(self) -> int:
        """The logits rows held now, over every block."""
        return sum(g.num_rows for g in self.groups.values())

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
        lo, hi = block * self.bl, (block + 1) * self.bl
        any_recorded, any_last = bool(recorded.any()), bool(last.any())
        self._release(block, born, tokens)
        if any_recorded or any_last:
            gather_now = born & (recorded | last)[:, None]  # positions born now: x* is known
            now = torch.zeros(born.shape, dtype=torch.float32, device=born.device)
            now[gather_now] = token_logp(logits[:, : self.bl][gather_now], tokens[gather_now])
        if any_recorded:
            self._snapshot(block, reach, logits, masked, born, now, clock, recorded)
        if any_last:
            self.last_mask[last] = masked[last]
            self.last_logp[last, lo:hi] = torch.where(born[last], now[last], 0.0)
        self.held_bytes = sum(g.nbytes for g in self.groups.values())
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _snapshot(self, block, reach, logits, masked, born, now, clock, recorded) -> None:
        bl, lo, hi = self.bl, block * self.bl, (block + 1) * self.bl
        rows_b = recorded.nonzero().squeeze(1)
        js = torch.where(recorded, clock // self.s, -1)
        if self.scope == "all":
            in_scope = masked
        else:
            in_scope = torch.zeros_like(masked)
            for c in sorted({block, reach}):
                in_scope[:, c * bl : (c + 1) * bl] = masked[:, c * bl : (c + 1) * bl]
        j_b = js[rows_b]
        self.progress_mask[rows_b, j_b] = in_scope[rows_b]
        self.progress_logp[rows_b, j_b, lo:hi] = torch.where(born, now, 0.0)[rows_b]
        keep = masked[:, lo:hi] & ~born & recorded[:, None]
        self._hold(block, js, logits[:, :bl], keep)
        # Later blocks in scope are still fully masked: hold all their rows.
        later = range(block + 1, reach + 1) if self.scope == "all" else [reach] * (reach > block)
        every = recorded[:, None].expand(-1, bl)
        for c in later:
            self._hold(c, js, logits[:, (c - block) * bl : (c - block + 1) * bl], every)

    def _hold(self, block: int, js: Tensor, logits: Tensor, keep: Tensor) -> None:
        """Hold the rows logits[keep] ([B, bl, V], [B, bl] bool) for positions of ``block``."""
        rows = logits[keep]
        if rows.shape[0] == 0:
            return
        slot = torch.full(keep.shape, -1, dtype=torch.long, device=keep.device)
        slot[keep] = torch.arange(rows.shape[0], device=keep.device)
        self.groups.setdefault(block, _BlockRows()).add(js, rows, slot)

    def _release(self, block: int, born: Tensor, tokens: Tensor) -> None:
        """Write l[j, n] of the positions born in this block from every snapshot; free them.

        Every position born after a snapshot was masked then, so it has a row in each chunk
        that holds its sequence.
        """
        held = self.groups.get(block)
        if held is None:
            return
        b, j, n, logp = held.release(born, tokens)
        self.progress_logp[b, j, block * self.bl + n] = logp
        if not held:
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
