"""LLaDA's masked-diffusion sampler, recording the Denoising Progress Scores trace.

METHOD.md §1 (the sampler) and the recording half of §2 (DPS): the trace is read off the logits
the sampler computes anyway, so recording costs no extra forward pass, only the memory of the
log-probability rows it must hold until the tokens they score are known (see `TraceRecorder`).

Notation (METHOD.md §1): steps t = 0 .. T-1, x_t the input of step t, M_t the completion positions
masked in x_t, birth(n) the step that commits position n, x*_n the final token at n.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from daca.modeling import forward_logits, full_attention_mask

REMASKING = ("low_confidence", "random")
SCOPES = ("all", "block")


@dataclass
class Rollout:
    """What `generate` returns. B rows, prompt length P, completion length L, T steps.

    sequences:      [B, P+L] long, the prompt (left padded as given) ++ the completion.
    completion_ids: [B, L] long, x_T restricted to the completion (x*).
    birth_step:     [B, L] long, birth(n): the step t that committed position n (METHOD.md §1).
    prompt_length:  P.
    With ``dps_stride=s`` (METHOD.md §2), R = ceil(T / s) recorded steps r_j = j*s:
    recorded_steps: [R] long, the r_j.
    progress_logp:  [B, R, L] float32, l[j, n] = log p(x*_n | x_{r_j}); 0 off progress_mask.
    progress_mask:  [B, R, L] bool, n in M_{r_j} (and in the recording scope at r_j).
    last_logp:      [B, L] float32, log p(x*_n | x_{T-1}) (last_step="measured"); 0 off last_mask.
    last_mask:      [B, L] bool, n in M_{T-1}.
    num_steps:      T.
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
    trace_peak_bytes: int = 0


def transfer_schedule(num_masked: Tensor, steps: int) -> Tensor:
    """Tokens to commit at each step of a block: [B] -> [B, steps] long (METHOD.md §1).

    A block with n masked positions and k steps commits n // k per step, the first n % k steps
    one more (LLaDA's linear schedule), so the block is complete after its last step.
    """
    base = (num_masked // steps)[:, None]
    extra = torch.arange(steps, device=num_masked.device)[None, :] < (num_masked % steps)[:, None]
    return base + extra.long()


def guided_logits(cond: Tensor, uncond: Tensor, cfg_scale: float) -> Tensor:
    """Classifier-free guidance, METHOD.md §1: un + (cfg + 1) * (cond - un)."""
    return uncond + (cfg_scale + 1) * (cond - uncond)


def gumbel_argmax(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """Candidate tokens x0 [...] from logits [..., V] (METHOD.md §1).

    temperature 0: plain argmax. Otherwise LLaDA's Gumbel-max in float64,
    argmax exp(l) / (-log U)^temperature, U ~ Uniform(0, 1) (low-precision noise is a known defect).
    """
    if temperature == 0:
        return logits.argmax(-1)
    u = torch.rand(logits.shape, dtype=torch.float64, generator=generator, device=logits.device)
    return (logits.double().exp() / (-torch.log(u)) ** temperature).argmax(-1)


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
    """Held logits rows of one snapshot j for the masked positions of one block.

    rows [N, V] (the logits' dtype) with their float32 logsumexp [N], so that
    log p = rows[i, x*] - lse[i]; slot [B, block_length] maps a position to its row (-1: none).
    """

    def __init__(self, j: int, rows: Tensor, slot: Tensor):
        self.j, self.rows, self.slot = j, rows, slot
        self.lse = torch.logsumexp(rows.float(), dim=-1)
        self.live = rows.shape[0]

    def logp_at(self, tokens: Tensor) -> Tensor:
        """log p(tokens) at each position's row: [B, bl] -> [B, bl] (garbage where no row)."""
        idx = self.slot.clamp_min(0)
        return self.rows[idx, tokens].float() - self.lse[idx]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in (self.rows, self.lse, self.slot))

    def compact(self) -> None:
        """Keep only the live rows (one copy of them)."""
        alive = self.slot >= 0
        keep = self.slot[alive]
        self.rows, self.lse = self.rows[keep], self.lse[keep]
        self.slot = torch.full_like(self.slot, -1)
        self.slot[alive] = torch.arange(keep.numel(), device=keep.device)


class TraceRecorder:
    """Records the DPS trace (METHOD.md §2) from logits the sampler already computed.

    At a recorded step r_j the log-probability rows of the masked positions in scope (scope "all":
    M_{r_j}; "block": M_{r_j} within the block being decoded) are needed later at x*_n, which is
    known only at birth(n). Positions born at r_j itself are gathered at once; the others keep
    their logits row (dtype of the logits, e, bytes per entry) plus a float32 logsumexp, grouped
    per (snapshot, block). At each step the rows of the positions just born are gathered from
    every held snapshot and released: a group is compacted (one copy of its live rows) when at
    most half of its rows are live, and dropped when none is, so every row is copied O(1) times.
    Rows of later blocks are never touched until their block is decoded.

    Peak memory, per sequence, with k = T / num_blocks steps per block. The live rows after step t
    are sum_{j: r_j <= t} |M_{t+1} ∩ scope_j|, that is
        scope "all":   (floor(t / s) + 1) * |M_{t+1}|
        scope "block": #{j : r_j in the current block, r_j <= t} * |M_{t+1} ∩ current block|.
    With the uniform schedule (k divides block_length) |M_{t+1}| = L (T - t - 1) / T, and the
    peak of the live rows is, in closed form (continuous t, s <= k for "block"),
        "all":   L (T + s - 1)^2 / (4 s T)            ≈ L T / (4 s)             (at t ≈ T/2)
        "block": block_length (k + s - 1)^2 / (4 s k) ≈ block_length k / (4 s) (mid-block).
    Held rows exceed the live ones only in the current block's groups, by less than their live
    rows (the halving rule), so held ≤ live + (number of snapshots) * |M_{t+1} ∩ current block|;
    under "block" each of the ceil(k / s) groups of a block holds at most block_length rows.
    Bytes = rows * (V * e + 4) + (groups held) * B * block_length * 8 (the index), for B rows.
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

    def needs_all_positions(self, t: int) -> bool:
        """Whether step t needs the logits of every completion position (else the block's)."""
        return self.scope == "all" and t % self.s == 0

    def step(
        self,
        t: int,
        block: int,
        logits: Tensor,
        masked: Tensor,
        born: Tensor,
        tokens: Tensor,
        num_born: int,
    ) -> None:
        """Record step t of the given block.

        logits [B, W, V]: the logits the sampler used at step t for completion positions
        block*bl .. block*bl + W - 1 (W = L - block*bl when `needs_all_positions(t)`, else bl);
        masked [B, L]: M_t; born [B, bl]: the positions of the block committed at step t
        (num_born of them in all); tokens [B, bl]: the block after the commit (x* where born).
        """
        bl, lo, hi = self.bl, block * self.bl, (block + 1) * self.bl
        self._release(block, born, tokens, num_born)
        recorded = t % self.s == 0
        if recorded or t == self.T - 1:  # positions born now: x* is known, gather at once
            now = token_logp(logits[:, :bl][born], tokens[born])
        if recorded:
            j = t // self.s
            in_scope = masked.clone()
            if self.scope == "block":
                in_scope[:, :lo] = False
                in_scope[:, hi:] = False
            self.progress_mask[:, j] = in_scope
            self.progress_logp[:, j, lo:hi][born] = now
            keep = masked[:, lo:hi] & ~born
            rows = logits[:, :bl][keep]
            if rows.shape[0]:
                slot = torch.full(keep.shape, -1, dtype=torch.long, device=keep.device)
                slot[keep] = torch.arange(rows.shape[0], device=keep.device)
                self.groups.setdefault(block, []).append(_Rows(j, rows, slot))
            if self.scope == "all":  # later blocks are still fully masked: hold all their rows
                B, V = logits.shape[0], logits.shape[-1]
                for c in range(block + 1, self.L // bl):
                    part = logits[:, (c - block) * bl : (c - block + 1) * bl]
                    rows = part.clone(memory_format=torch.contiguous_format).view(B * bl, V)
                    slot = torch.arange(B * bl, device=logits.device).view(B, bl)
                    self.groups.setdefault(c, []).append(_Rows(j, rows, slot))
        if t == self.T - 1:  # M_{T-1} is born at the last step
            self.last_mask.copy_(masked)
            self.last_logp[:, lo:hi][born] = now
        self.held_bytes = sum(g.nbytes for gs in self.groups.values() for g in gs)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _release(self, block: int, born: Tensor, tokens: Tensor, num_born: int) -> None:
        """Gather l[j, n] of the positions born in this block from every snapshot; free them.

        Every position born at t > r_j was masked at r_j, so it has a row in each held group.
        """
        groups = self.groups.get(block)
        if not groups or num_born == 0:
            return
        lo, hi = block * self.bl, (block + 1) * self.bl
        js = [g.j for g in groups]
        vals = torch.stack([g.logp_at(tokens) for g in groups], dim=1)  # [B, G, bl]
        self.progress_logp[:, js, lo:hi] = torch.where(
            born[:, None], vals, self.progress_logp[:, js, lo:hi]
        )
        kept = []
        for g in groups:
            g.slot.masked_fill_(born, -1)
            g.live -= num_born
            if g.live == 0:
                continue
            if 2 * g.live <= g.rows.shape[0]:
                g.compact()
            kept.append(g)
        if kept:
            self.groups[block] = kept
        else:
            del self.groups[block]


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
) -> Rollout:
    """Sample completions with LLaDA's semi-autoregressive remasking sampler (METHOD.md §1).

    prompt_ids [B, P] long (left padded, with attention_mask [B, P] marking real tokens) ->
    Rollout. The completion (L = gen_length) is split into blocks of block_length decoded left
    to right with steps / num_blocks steps each (per-block schedule: `transfer_schedule`). Each
    step runs one forward of the model (a batch of 2B with cfg_scale > 0, the second half with the
    prompt masked), draws candidates (`gumbel_argmax`), scores them (`candidate_confidence`) and
    commits the most confident masked positions of the current block; a committed position is
    never re-masked. With temperature 0 and low_confidence this commits the same tokens in the
    same order as LLaDA's `generate`; softmax and noise are computed only on the masked positions
    of the current block, which changes no committed token. All randomness comes from
    `generator` (on the model's device). A position is committed once even if its candidate is
    mask_id (LLaDA would then treat it as still masked; a trained model never predicts it).

    dps_stride=s records the DPS trace (METHOD.md §2) at recorded steps r_j = j*s, in scope
    dps_scope ("all" or "block"), without an extra forward (`TraceRecorder`). The model's
    train/eval mode is left as the caller set it.
    """
    if prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids must be [B, P], got shape {tuple(prompt_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != prompt_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != prompt_ids shape "
            f"{tuple(prompt_ids.shape)}"
        )
    if min(gen_length, steps, block_length) < 1:
        raise ValueError(
            f"gen_length, steps and block_length must be >= 1, got {gen_length}, {steps}, "
            f"{block_length}"
        )
    if gen_length % block_length:
        raise ValueError(f"gen_length {gen_length} is not divisible by block_length {block_length}")
    num_blocks = gen_length // block_length
    if steps % num_blocks:
        raise ValueError(f"steps {steps} is not divisible by the number of blocks {num_blocks}")
    if remasking not in REMASKING:
        raise ValueError(f"remasking must be one of {REMASKING}, got {remasking!r}")
    if dps_scope not in SCOPES:
        raise ValueError(f"dps_scope must be one of {SCOPES}, got {dps_scope!r}")
    if dps_stride is not None and (isinstance(dps_stride, bool) or dps_stride < 1):
        raise ValueError(f"dps_stride must be None or an integer >= 1, got {dps_stride!r}")
    if temperature < 0 or cfg_scale < 0 or math.isnan(temperature) or math.isnan(cfg_scale):
        raise ValueError(f"temperature and cfg_scale must be >= 0, got {temperature}, {cfg_scale}")

    B, P = prompt_ids.shape
    L, bl, device = gen_length, block_length, prompt_ids.device
    k = steps // num_blocks
    x = torch.cat([prompt_ids, torch.full((B, L), mask_id, dtype=torch.long, device=device)], 1)
    attn = full_attention_mask(attention_mask, prompt_ids, L)
    if cfg_scale > 0:  # the unconditional half: the same input with the prompt masked
        un_prompt = torch.full_like(prompt_ids, mask_id)
        attn = None if attn is None else torch.cat([attn, attn])
    masked = torch.ones(B, L, dtype=torch.bool, device=device)  # M_t
    birth = torch.full((B, L), -1, dtype=torch.long, device=device)
    recorder = None
    if dps_stride is not None:
        recorder = TraceRecorder(
            batch=B,
            gen_length=L,
            block_length=bl,
            num_steps=steps,
            stride=dps_stride,
            scope=dps_scope,
            device=device,
        )

    for c in range(num_blocks):
        lo, hi = c * bl, (c + 1) * bl
        counts = transfer_schedule(masked[:, lo:hi].sum(1), k).tolist()
        for i in range(k):
            t = c * k + i
            # only the current block's logits decide commits; the trace may need all of them
            end = P + (L if recorder is not None and recorder.needs_all_positions(t) else hi)
            if cfg_scale > 0:
                inp = torch.cat([x, torch.cat([un_prompt, x[:, P:]], 1)])
                both = forward_logits(model, inp, attn)
                logits = guided_logits(both[:B, P + lo : end], both[B:, P + lo : end], cfg_scale)
            else:
                logits = forward_logits(model, x, attn)[:, P + lo : end]
            # candidates and confidences only where they can be committed: masked block positions
            open_block = masked[:, lo:hi]
            cand_logits = logits[:, :bl][open_block]  # [N, V], N masked positions in row order
            x0 = gumbel_argmax(cand_logits, temperature, generator)
            conf = candidate_confidence(cand_logits, x0, remasking, generator)
            confidence = torch.full((B, bl), -math.inf, dtype=conf.dtype, device=device)
            confidence[open_block] = conf
            born = top_confidence_mask(confidence, [row[i] for row in counts])
            block_tokens = x[:, P + lo : P + hi]  # a view: committing writes into x
            block_tokens[born] = x0[born[open_block]]
            birth[:, lo:hi].masked_fill_(born, t)
            if recorder is not None:
                recorder.step(
                    t, c, logits, masked, born, block_tokens, sum(row[i] for row in counts)
                )
            masked[:, lo:hi] &= ~born

    rollout = Rollout(
        sequences=x, completion_ids=x[:, P:], birth_step=birth, prompt_length=P, num_steps=steps
    )
    if recorder is not None:
        if recorder.groups:  # every position is born, so nothing may remain held
            raise RuntimeError("trace recorder still holds rows after the last step")
        rollout.recorded_steps = recorder.recorded_steps
        rollout.progress_logp = recorder.progress_logp
        rollout.progress_mask = recorder.progress_mask
        rollout.last_logp, rollout.last_mask = recorder.last_logp, recorder.last_mask
        rollout.trace_peak_bytes = recorder.peak_bytes
    return rollout
