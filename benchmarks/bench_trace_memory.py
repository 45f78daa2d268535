"""Peak memory held by the DPS trace recorder (METHOD.md §2), measured against its formula.

For scope "all" and "block" over a grid of (L, V, steps T, stride s), runs `generate` with a
cheap stand-in model (memory depends on the schedule, not on the model) and prints the
recorder's measured peak bytes per sequence next to the `TraceRecorder` docstring formula:
live = max_t sum_j |M_{t+1} ∩ scope_j| rows (a lower bound: what the trace must hold),
bound = live + the halving slack of the current block, and the closed forms
L (T+s-1)^2 / (4sT) ≈ LT/(4s) ("all") and bl (k+s-1)^2 / (4sk) ≈ bl k/(4s) ("block"; s <= k),
k = steps per block, bl = block_length; "block" (which also holds the next block's rows for a
snapshot whose next recorded state lies there, and counts them in live) must stay within
bl * (ceil(k/s) + 2) rows.
Ratio = measured / live.

    python benchmarks/bench_trace_memory.py          # small grid, seconds
    python benchmarks/bench_trace_memory.py --full   # L up to 512, V up to 32768
"""

import argparse
import math

import torch

from daca.core import sampler
from daca.core.sampler import generate, transfer_schedule


class CountingRecorder(sampler.TraceRecorder):
    """The recorder, also counting its held rows per step (instrumentation only)."""

    latest = None

    def __init__(self, **kw):
        super().__init__(**kw)
        self.peak_rows = 0
        CountingRecorder.latest = self

    def step(self, **kwargs):
        super().step(**kwargs)
        self.peak_rows = max(self.peak_rows, self.held_rows)


sampler.TraceRecorder = CountingRecorder  # generate() builds its recorder from this name


class TableModel:
    """logits = token table + position table: a cheap deterministic [B, T, V] model."""

    def __init__(self, vocab, max_len, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.tok = torch.randn(vocab, vocab, generator=g) if vocab <= 4096 else None
        self.pos = torch.randn(max_len, vocab, generator=g)
        self.vocab = vocab

    def __call__(self, input_ids, attention_mask=None):
        logits = self.pos[: input_ids.shape[1]].expand(input_ids.shape[0], -1, -1)
        if self.tok is not None:
            logits = logits + self.tok[input_ids]
        else:  # keep memory small at large V: a per-token shift
            logits = logits + (input_ids[..., None] % 7).float()
        return logits.contiguous()


def live_and_bound_rows(L, T, bl, s, scope):
    """Per sequence: max over steps of the live rows and of live + halving slack."""
    k = T // (L // bl)
    per_step = transfer_schedule(torch.tensor([bl]), k)[0].tolist()
    live, bound, masked_block = 0, 0, bl

    def reach(r: int) -> int:  # the block of r's next recorded state (TraceRecorder.reach_block)
        return min(r + s, T - 1) // k

    for t in range(T):
        i = t % k
        masked_block = (bl if i == 0 else masked_block) - per_step[i]
        if scope == "all":
            snaps, masked = t // s + 1, masked_block + L - (t // k + 1) * bl
            ahead = 0
        else:  # the block's snapshots, one of the previous block's reaching into it, and the
            # next block's rows held by a snapshot here whose next recorded state lies there
            c = t // k
            own = [r for r in range(t - i, t + 1) if r % s == 0]
            before = [r for r in range(0, t - i) if r % s == 0 and reach(r) == c]
            snaps, masked = len(own) + len(before), masked_block
            ahead = bl * sum(reach(r) > c for r in own)
        live = max(live, snaps * masked + ahead)
        bound = max(bound, snaps * (masked + masked_block) + ahead)
    return live, bound


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="larger L and V")
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lengths, vocabs = (
        ([64, 128, 256], [1024, 4096]) if not args.full else ([128, 256, 512], [4096, 32768])
    )
    bl, P, B = 32, 8, args.batch
    print(f"batch {B}, block_length {bl}, float32 logits (e = 4 bytes); rows are per sequence")
    head = f"{'scope':>5} {'L':>4} {'V':>6} {'T':>4} {'s':>3} | {'measured MiB':>12} {'rows':>8}"
    head += f" {'live':>6} {'bound':>6} {'closed':>7} {'ratio':>5}"
    print(head)
    for L in lengths:
        T = L // 2
        k = T // (L // bl)
        for V in vocabs:
            model = TableModel(V, P + L)
            prompt = torch.randint(0, V - 1, (B, P), generator=torch.Generator().manual_seed(0))
            for scope in ("all", "block"):
                for s in (2, 4, 8, 16):
                    out = generate(model, prompt, mask_id=V - 1, gen_length=L, steps=T,
                                   block_length=bl, dps_stride=s, dps_scope=scope)  # fmt: skip
                    rows = CountingRecorder.latest.peak_rows / B
                    live, bound = live_and_bound_rows(L, T, bl, s, scope)
                    if scope == "all":
                        closed = L * (T + s - 1) ** 2 / (4 * s * T)
                    else:
                        closed = bl * (k + s - 1) ** 2 / (4 * s * k) if s <= k else bl * (k - 1) / k
                    ok = live <= rows <= bound
                    if scope == "block":  # ceil(k / s) + 1 chunks of the current block
                        ok &= rows <= bl * (math.ceil(k / s) + 2)  # and one of the next
                    assert ok, (scope, L, V, T, s, rows, live, bound)
                    mib = out.trace_peak_bytes / B / 2**20
                    print(
                        f"{scope:>5} {L:>4} {V:>6} {T:>4} {s:>3} | {mib:>12.2f} {rows:>8.1f}"
                        f" {live:>6} {bound:>6} {closed:>7.0f} {rows / live:>5.2f}"
                    )
    print("measured MiB: peak bytes held per sequence (rows, logsumexp, index); checked:")
    print("live <= measured rows <= bound, and for block rows <= block_length * (ceil(k / s) + 2)")


if __name__ == "__main__":
    main()
