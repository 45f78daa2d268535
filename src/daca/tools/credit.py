"""``daca credit RUN_DIR``: does DPS credit the right tokens? The mean DPS multiplier by role.

Read off the rollouts a run recorded (``save_rollouts_every``; each record is one group of
completions with its tokens, multipliers and advantages): every completion token gets roles from
its text (``token_roles``) and the table gives, per role, the mean multiplier of its tokens in
all completions, and apart in those with positive and with negative advantage (the sign decides
whether a larger multiplier pushes the token up or down). Roles:

- ``reasoning`` / ``answer``: the text inside ``<reasoning>`` / ``<answer>`` tags; ``other``:
  the rest (tags, newlines, text outside them); padding and end-of-sequence are left out.
- for a task that reasons before it answers (``Task.trace_steps``): ``step right`` /
  ``step wrong`` (the tokens of a step of the reasoning, right or wrong against the solver or
  arithmetic), ``first step`` / ``later steps``.

A policy that does not change between the recorded steps (``learning_rate=0``) gives a table
free of learning noise: the credit of one model (docs/results.md shows it for an untrained and a
trained model).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from daca.tasks.credit_labels import completion_of, record_special_tokens, token_spans

ROLES = ("reasoning", "answer", "other", "step right", "step wrong", "first step", "later steps")
# Which completions a column counts: all, or those of positive / negative advantage.
SIGNS = ("all", "A > 0", "A < 0")


def load_records(run_dir: Path, first: int | None = None, last: int | None = None) -> list[dict]:
    """The run's recorded rollouts with ``first <= step <= last`` (all by default), by step."""
    folder = Path(run_dir) / "rollouts"
    files = sorted(folder.glob("step-*.json")) if folder.is_dir() else []
    records = [json.loads(f.read_text()) for f in files]
    records = [
        r
        for r in records
        if (first is None or r["step"] >= first) and (last is None or r["step"] <= last)
    ]
    if not records:
        span = "" if first is None and last is None else f" in steps {first}..{last}"
        raise FileNotFoundError(
            f"{run_dir}: no recorded rollouts{span} (train with save_rollouts_every > 0)"
        )
    if not any("multipliers" in r for r in records):
        raise ValueError(f"{run_dir}: its rollouts carry no DPS multipliers (a run with DPS off)")
    return records


def _inside(text: str, open_tag: str, close_tag: str) -> tuple[int, int] | None:
    start = text.find(open_tag)
    if start < 0:
        return None
    start += len(open_tag)
    end = text.find(close_tag, start)
    return start, end if end >= 0 else len(text)


def token_roles(
    tokens: list[str], special: set[str], steps: list[tuple[int, int, bool]] | None = None
) -> list[set[str]]:
    """The roles of each token (``ROLES``; empty for a special token). ``steps``: the
    reasoning's steps as (start, end, right) character spans (``Task.trace_steps``)."""
    spans = token_spans(tokens, special)
    text = completion_of(tokens, special)
    reasoning = _inside(text, "<reasoning>", "</reasoning>")
    answer = _inside(text, "<answer>", "</answer>")
    roles = []
    for span in spans:
        if span is None:
            roles.append(set())
            continue
        mid = (span[0] + span[1] - 1) / 2  # a token lies where its middle character lies
        found = set()
        for name, region in (("reasoning", reasoning), ("answer", answer)):
            if region is not None and region[0] <= mid < region[1]:
                found.add(name)
        if not found:
            found.add("other")
        for i, (start, end, right) in enumerate(steps or ()):
            if start <= mid < end:
                found.add("step right" if right else "step wrong")
                found.add("first step" if i == 0 else "later steps")
        roles.append(found)
    return roles


@dataclass
class RoleCredit:
    role: str
    sign: str  # one of SIGNS
    mean: float
    tokens: int


def credit_rows(records: list[dict], trace_steps=None) -> list[RoleCredit]:
    """The mean multiplier per (role, sign of the advantage) over every recorded token.
    ``trace_steps(completion, row) -> [(start, end, right)]`` gives the step roles."""
    cells: dict[tuple[str, str], list[float]] = {}
    for rec in records:
        if "multipliers" not in rec:
            continue
        special = record_special_tokens(rec)
        columns = rec.get("columns", {})
        for g, tokens in enumerate(rec["tokens"]):
            adv = rec["advantages"][g]
            signs = ["all"] + (["A > 0"] if adv > 0 else ["A < 0"] if adv < 0 else [])
            steps = None
            if trace_steps is not None and columns:
                row = {c: v[g] for c, v in columns.items()}
                steps = trace_steps(completion_of(tokens, special), row)
            for roles, m in zip(
                token_roles(tokens, special, steps), rec["multipliers"][g], strict=True
            ):
                for role in roles:
                    for sign in signs:
                        cells.setdefault((role, sign), []).append(m)
    return [
        RoleCredit(role, sign, statistics.fmean(cells[(role, sign)]), len(cells[(role, sign)]))
        for role in ROLES
        for sign in SIGNS
        if (role, sign) in cells
    ]


def credit_table(rows: list[RoleCredit]) -> str:
    """The rows as a Markdown table: one line per role, the columns of SIGNS side by side."""
    by = {(r.role, r.sign): r for r in rows}
    head = " | ".join(f"{s}: mean multiplier (tokens)" for s in SIGNS)
    lines = [f"| role | {head} |", "|---" * (len(SIGNS) + 1) + "|"]
    for role in ROLES:
        cells = [by.get((role, s)) for s in SIGNS]
        if any(cells):
            text = " | ".join(f"{c.mean:.3f} ({c.tokens})" if c else "" for c in cells)
            lines.append(f"| {role} | {text} |")
    return "\n".join(lines) + "\n"


def plot_credit(rows: list[RoleCredit], path: Path, title: str) -> None:
    """Grouped bars: the mean multiplier per role, positive and negative advantage apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = [r for r in ROLES if any(x.role == r for x in rows)]
    by = {(r.role, r.sign): r for r in rows}
    fig, ax = plt.subplots(figsize=(1.3 * len(roles) + 2, 3.6))
    width = 0.27
    for k, sign in enumerate(SIGNS):
        xs = [i + (k - 1) * width for i in range(len(roles))]
        ys = [by[(r, sign)].mean if (r, sign) in by else float("nan") for r in roles]
        ax.bar(xs, ys, width, label="all completions" if sign == "all" else f"those with {sign}")
    ax.axhline(1.0, color="0.4", lw=0.8)
    ax.set_xticks(range(len(roles)), roles, fontsize=8)
    values = [r.mean for r in rows]
    pad = max(0.02, 0.15 * (max(values) - min(values)))
    ax.set_ylim(min(min(values), 1.0) - pad, max(max(values), 1.0) + pad)
    ax.set(ylabel="mean DPS multiplier", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
