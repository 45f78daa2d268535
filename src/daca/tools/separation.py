"""Does DPS's signal tell right tokens from wrong ones? AUCs with bootstrap intervals.

``daca credit`` reads recorded rollouts (a run's, or a model's fresh ones). Every token of a
graded unit (``daca.tasks.credit_labels``: a trace step or an answer cell) is right or wrong;
it inherits the interval J(n) of its birth step (METHOD.md §2), and with it two scores:

- ``δ̄``: the raw progress δ_{J(n)} of its completion's trajectory (the record's ``deltas``);
- ``multiplier``: DPS's multiplier 1 + λ·z_{J(n)}, after the per-step z-score (the record's
  DPS multipliers; under the oracle control its ``dps_multipliers``).

The AUC of a score is P(score of a right token > score of a wrong one), ties counting half:
0.5 is no separation, 1 a perfect one. A credit scheme needs more than that: in a completion
of positive advantage the right tokens should be scaled up, in one of negative advantage the
wrong ones. So ``aligned`` is the AUC of the multiplier between tokens whose correctness agrees
with their advantage's sign and those where it disagrees (what the oracle control scales by).
Tokens of one completion share their trajectory, so the 95 % interval is a bootstrap over
completions (a seeded generator), not over tokens.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from daca.tasks.credit_labels import (
    completion_of,
    graded_spans,
    record_special_tokens,
    token_labels,
)

UNITS = ("trace steps", "answer cells", "all units")


@dataclass
class GradedTokens:
    """The graded tokens of some records, one entry per token (numpy arrays)."""

    completion: np.ndarray  # index of its completion
    unit: np.ndarray  # 0 trace step, 1 answer cell
    right: np.ndarray  # bool
    aligned: np.ndarray  # bool: right == (A > 0); only meaningful where A != 0
    signed: np.ndarray  # bool: A != 0
    interval: np.ndarray  # J(n)
    delta: np.ndarray  # raw δ_{J(n)} (NaN when the record has no raw deltas)
    multiplier: np.ndarray  # DPS's multiplier


def graded_tokens(records: list[dict], task) -> GradedTokens:
    """Every graded token of the records' completions with its scores (``GradedTokens``)."""
    cols: dict[str, list] = {k: [] for k in GradedTokens.__dataclass_fields__}
    completion = 0
    for rec in records:
        special = record_special_tokens(rec)
        columns, steps = rec.get("columns", {}), rec["recorded_steps"]
        multipliers = rec.get("dps_multipliers", rec["multipliers"])
        no_deltas = [float("nan")] * len(steps)  # a record from before raw deltas were kept
        for g, tokens in enumerate(rec["tokens"]):
            row = {c: v[g] for c, v in columns.items()}
            trace, cells = graded_spans(task, completion_of(tokens, special), row)
            kinds = token_labels(tokens, special, [(a, b, False) for a, b, _ in cells])
            labels = token_labels(tokens, special, trace + cells)
            adv = rec["advantages"][g]
            deltas = rec["deltas"][g] if "deltas" in rec else no_deltas
            for n, label in enumerate(labels):
                if label == 0:
                    continue
                j = bisect.bisect_right(steps, rec["birth_step"][g][n]) - 1
                cols["completion"].append(completion)
                cols["unit"].append(1 if kinds[n] else 0)
                cols["right"].append(label > 0)
                cols["aligned"].append((label > 0) == (adv > 0))
                cols["signed"].append(adv != 0)
                cols["interval"].append(j)
                cols["delta"].append(deltas[j])
                cols["multiplier"].append(multipliers[g][n])
            completion += 1
    return GradedTokens(**{k: np.asarray(v) for k, v in cols.items()})


def auc(scores: np.ndarray, positive: np.ndarray, weights: np.ndarray | None = None) -> float:
    """P(score of a positive > score of a negative), ties half, each token weighted
    (``weights``: a bootstrap's counts); NaN when either side is empty."""
    w = np.ones(len(scores)) if weights is None else weights.astype(float)
    values, where = np.unique(scores, return_inverse=True)
    pos = np.bincount(where, weights=w * positive, minlength=len(values))
    neg = np.bincount(where, weights=w * ~positive, minlength=len(values))
    total = pos.sum() * neg.sum()
    if total == 0:
        return float("nan")
    below = np.cumsum(neg) - neg
    return float((pos * (below + 0.5 * neg)).sum() / total)


@dataclass
class Separation:
    units: str
    score: str  # "δ̄", "multiplier" or "aligned"
    interval: int | None  # birth interval J, None for all
    positives: int
    negatives: int
    auc: float
    low: float
    high: float


def _bootstrap(tokens: GradedTokens, pick: np.ndarray, score: np.ndarray, positive: np.ndarray,
               weights: np.ndarray) -> tuple[float, float, float]:  # fmt: skip
    """The AUC of ``score`` on the tokens ``pick`` and its 95 % bootstrap interval."""
    s, p = score[pick], positive[pick]
    point = auc(s, p)
    draws = [auc(s, p, w[tokens.completion[pick]]) for w in weights]
    draws = [d for d in draws if d == d]
    if not draws:
        return point, float("nan"), float("nan")
    low, high = np.percentile(draws, [2.5, 97.5])
    return point, float(low), float(high)


def separations(tokens: GradedTokens, *, resamples: int = 1000, seed: int = 0) -> list[Separation]:
    """The AUCs of every unit kind and score, then of ``δ̄`` and the multiplier by birth
    interval (all units), each with its 95 % bootstrap interval over completions."""
    rng = np.random.default_rng(seed)
    count = int(tokens.completion.max()) + 1 if len(tokens.completion) else 0
    weights = [
        np.bincount(rng.integers(0, count, count), minlength=count) for _ in range(resamples)
    ]
    out = []

    def add(units, score, interval, pick, values, positive):
        pick = pick & ~np.isnan(values)
        npos, nneg = int((positive & pick).sum()), int((~positive & pick).sum())
        if npos == 0 or nneg == 0:
            return
        point, low, high = _bootstrap(tokens, pick, values, positive, weights)
        out.append(Separation(units, score, interval, npos, nneg, point, low, high))

    everything = np.ones(len(tokens.unit), dtype=bool)
    for k, units in enumerate(UNITS):
        pick = everything if k == 2 else tokens.unit == k
        add(units, "δ̄", None, pick, tokens.delta, tokens.right)
        add(units, "multiplier", None, pick, tokens.multiplier, tokens.right)
        add(units, "aligned", None, pick & tokens.signed, tokens.multiplier, tokens.aligned)
    for j in sorted(set(tokens.interval.tolist())):
        pick = tokens.interval == j
        add(UNITS[2], "δ̄", j, pick, tokens.delta, tokens.right)
        add(UNITS[2], "multiplier", j, pick, tokens.multiplier, tokens.right)
    return out


@dataclass
class SequenceWeights:
    """What DPS does to whole completions: the mean multiplier of a completion's tokens (up to
    its first end of sequence) for positive and negative advantage, and the net effective
    advantage sum_g A_g m̄_g / sum_g |A_g| (0 without DPS: a group's advantages sum to 0 under
    the mean baseline). A method with one ratio per sequence (GDPO) sees only m̄."""

    positive: float
    negative: float
    net: float
    completions: int


def sequence_weights(records: list[dict], eos: str = "[EOS]") -> SequenceWeights:
    """``SequenceWeights`` of the records' DPS multipliers (DPS's own under the oracle)."""
    pos, neg, net, total = [], [], 0.0, 0.0
    for rec in records:
        multipliers = rec.get("dps_multipliers", rec["multipliers"])
        for g, tokens in enumerate(rec["tokens"]):
            n = tokens.index(eos) + 1 if eos in tokens else len(tokens)
            mean, adv = float(np.mean(multipliers[g][:n])), rec["advantages"][g]
            (pos if adv > 0 else neg if adv < 0 else []).append(mean)
            net, total = net + adv * mean, total + abs(adv)
    return SequenceWeights(
        _mean(pos), _mean(neg), net / total if total else 0.0, len(pos) + len(neg)
    )


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else float("nan")


def sequence_line(w: SequenceWeights) -> str:
    return (
        f"Per completion (the {w.completions} of nonzero advantage): mean DPS multiplier "
        f"{w.positive:.4f} where A > 0, {w.negative:.4f} where A < 0; net effective advantage "
        f"sum A·m̄ / sum |A| = {w.net:+.4f}\n"
    )


_SCORES = {
    "δ̄": "raw δ̄ of its birth interval, right vs wrong",
    "multiplier": "DPS multiplier (per-step z-score), right vs wrong",
    "aligned": "DPS multiplier, agreeing with A's sign vs not",
}


def separation_table(rows: list[Separation]) -> str:
    """Two Markdown tables: the AUCs by unit kind, then by birth interval."""

    def cell(r: Separation) -> str:
        return f"{r.auc:.3f} [{r.low:.3f}, {r.high:.3f}]"

    lines = ["| units | score | tokens (+ / −) | AUC [95 % interval] |", "|---|---|---|---|"]
    for r in rows:
        if r.interval is None:
            lines.append(f"| {r.units} | {_SCORES[r.score]} | {r.positives} / {r.negatives} | "
                         f"{cell(r)} |")  # fmt: skip
    by_j = {(r.interval, r.score): r for r in rows if r.interval is not None}
    if by_j:
        head = "| birth interval J | tokens right / wrong | AUC of δ̄ | AUC of the multiplier |"
        lines += ["", head, "|---|---|---|---|"]
        for j in sorted({j for j, _ in by_j}):
            d, m = by_j.get((j, "δ̄")), by_j.get((j, "multiplier"))
            first = d or m
            lines.append(f"| {j} | {first.positives} / {first.negatives} | "
                         f"{cell(d) if d else ''} | {cell(m) if m else ''} |")  # fmt: skip
    return "\n".join(lines) + "\n"
