"""LLaDA's masked-diffusion sampler, recording the Denoising Progress Scores trace.

METHOD.md §1 (the sampler) and the recording half of §2 (DPS): the trace is read off the logits
the sampler computes anyway, so recording costs no extra forward pass, only the memory of the
log-probability rows it must hold until the tokens they score are known (``daca.core.trace``).
Faster rollouts (docs/rollouts.md, a daca decision): a block KV cache (``daca.core.block_cache``,
over transformers' cache classes) refreshed at every recorded step, and confidence-threshold
parallel decoding.

Notation (METHOD.md §1): steps t = 0 .. T-1, x_t the input of step t, M_t the completion positions
masked in x_t, birth(n) the step that commits position n, x*_n the final token at n.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from daca.core.block_cache import BlockCache
from daca.core.modeling import (
    attention_anchor_of,
    attention_block_of,
    check_completion_begins_block,
    forward_logits,
    full_attention_mask,
)
from daca.core.options import check_sampler
from daca.core.trace import TraceRecorder


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


def _forward_kind(
    block_cache, c: int, i: int, traced: bool, refresh_every, trace_refresh, reads_past: bool
) -> str:
    """Which forward step i of block c runs (docs/rollouts.md): "full" (no cache, a block start,
    every ``refresh_every``-th step of a block, a recorded step), "suffix" (a recorded step with
    ``trace_refresh="suffix"``) or "block". Under block-causal attention (LLaDA 2.x) the cached
    prompt and earlier blocks never go stale, so a later block's start only "extend"s the cache
    by the block just finished, a step that ``reads_past`` the block (a recorded one whose trace
    reaches later blocks) is a "suffix" refresh and every other step a "block" one: all exact."""
    if block_cache is not None and block_cache.attention_block is not None:
        if i == 0:
            return "full" if c == 0 else "extend"
        return "suffix" if reads_past else "block"
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
        # A block-causal model's positions after a step's last read one change nothing before
        # it, so its uncached forwards stop there too (BlockCache._reach); cached, it extends.
        self.block_causal = attention_block_of(model) is not None
        self.masked = torch.ones(B, gen_length, dtype=torch.bool, device=device)  # M_t
        self.birth = torch.full((B, gen_length), -1, dtype=torch.long, device=device)
        self.clock = torch.zeros(B, dtype=torch.long, device=device)  # each row's own step t_b
        self.everyone = torch.ones(B, dtype=torch.bool, device=device)
        suffix = {"suffix": 0} if trace_refresh == "suffix" else {}
        if self.block_cache is not None and self.block_causal:
            suffix = {"extend": 0, "suffix": 0}
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
        c, refresh = lo // self.bl, self.trace_refresh
        kind_rec = _forward_kind(cache, c, i, True, every, refresh, end > hi)
        kind_plain = _forward_kind(cache, c, i, False, every, refresh, False)
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
            if self.block_causal:
                inp, attn = inp[:, : P + end], None if attn is None else attn[:, : P + end]
            logits = forward_logits(self.model, inp, attn, last=inp.shape[1] - P - lo, stop=P + end)
        elif kind == "full":
            logits = cache.refresh(inp, lo, hi, end, sel)
        elif kind == "suffix":
            logits = cache.refresh_suffix(inp, lo, hi, end, sel)
        elif kind == "extend":
            logits = cache.extend(inp, lo, hi, end, sel)
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
    keys. For a block-causal model (LLaDA 2.x) every cached step is exact: one full forward,
    each later block's start an extension by the block just finished, recorded steps suffix
    refreshes (``Rollout.forwards["extend"]``, ``["suffix"]``), or block steps when they read
    nothing past the block; the tokens and trace are those of "none".

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
    block = attention_block_of(model)
    if block is not None and block_length != block:
        raise ValueError(
            f"block_length={block_length}, but the model attends block-causally in blocks of "
            f"{block} (LLaDA 2.x, or config.json's attention_block_size): decode with "
            f"block_length={block}"
        )
    if block is not None:
        P = prompt_ids.shape[1]
        check_completion_begins_block(attention_mask, P, block, attention_anchor_of(model))
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
