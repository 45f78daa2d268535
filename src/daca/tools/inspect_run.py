"""``daca inspect RUN_DIR [--step N]``: see which commitments DPS credited.

Each completion token of the recorded group is drawn coloured by its DPS multiplier (blue below
1, red above; a colour bar), with its birth step beneath and a Sudoku puzzle's given cells
framed, beside the δ̄ curve over the denoising intervals and the group's rewards; a PNG and an
HTML page. Padding is left out.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from pathlib import Path


def load_record(run_dir: Path, step: int | None) -> dict:
    folder = Path(run_dir) / "rollouts"
    files = sorted(folder.glob("step-*.json")) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(f"{run_dir}: no recorded rollouts (set save_rollouts_every > 0)")
    if step is None:
        return json.loads(files[-1].read_text())
    wanted = folder / f"step-{step:07d}.json"
    if not wanted.is_file():
        steps = [int(f.stem.split("-")[1]) for f in files]
        raise FileNotFoundError(f"no rollout recorded at step {step}; recorded: {steps}")
    return json.loads(wanted.read_text())


# The most saturated colours, at the smallest and the largest multiplier; white is 1.
_BLUE, _RED = (0.25, 0.25, 1.0), (1.0, 0.25, 0.25)


def _colour(m: float, lo: float, hi: float) -> tuple[float, float, float]:
    """White at 1, red towards the largest multiplier, blue towards the smallest."""
    if m >= 1:
        a = 0.0 if hi <= 1 else min(1.0, (m - 1) / (hi - 1))
        return (1.0, 1 - 0.75 * a, 1 - 0.75 * a)
    a = 0.0 if lo >= 1 else min(1.0, (1 - m) / (1 - lo))
    return (1 - 0.75 * a, 1 - 0.75 * a, 1.0)


def _ink(background: tuple[float, float, float], dim: bool = False) -> str:
    """Black or white text, whichever reads on ``background`` (its relative luminance)."""
    r, g, b = background
    dark = 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.5
    if dim:
        return "0.92" if dark else "0.3"
    return "white" if dark else "black"


def given_positions(rec: dict, g: int) -> set[int]:
    """The completion positions of completion ``g`` that repeat a given cell of its Sudoku
    puzzle (the k-th digit of the completion is cell k); empty for other tasks."""
    if not rec.get("task", "").startswith("sudoku"):
        return set()
    found = re.findall(r"(?<![0-9])[0-4]{16}(?![0-9])", rec["prompts"][g])
    if len(found) != 1:
        return set()
    puzzle, given, cell = found[0], set(), 0
    for n, tok in enumerate(rec["tokens"][g]):
        text = tok.lstrip("▁Ġ ")
        if len(text) == 1 and text.isdigit() and cell < 16:
            if puzzle[cell] != "0":
                given.add(n)
            cell += 1
    return given


def _range(mults: list[list[float]]) -> tuple[float, float]:
    return min(min(r) for r in mults), max(max(r) for r in mults)


@dataclass
class DrawnCell:
    position: int  # in the completion
    text: str
    birth: int
    multiplier: float
    colour: tuple[float, float, float]
    given: bool  # repeats a given cell of the prompt's puzzle


def drawn_cells(rec: dict) -> list[list[DrawnCell]]:
    """Per completion of the group, the cells the pictures draw: every token but padding."""
    tokens, births = rec["tokens"], rec["birth_step"]
    mults = rec.get("multipliers") or [[1.0] * len(t) for t in tokens]
    lo, hi = _range(mults)
    pad = rec.get("pad_token", "[PAD]")
    rows = []
    for g, row in enumerate(tokens):
        given = given_positions(rec, g)
        rows.append(
            [
                DrawnCell(
                    n,
                    tok.replace("[EOS]", "·"),
                    births[g][n],
                    mults[g][n],
                    _colour(mults[g][n], lo, hi),
                    n in given,
                )
                for n, tok in enumerate(row)
                if tok != pad
            ]
        )
    return rows


def render_png(rec: dict, path: Path) -> None:
    """The group's completions as rows of cells: colour = DPS multiplier (colour bar), large
    text = the token, small digits = its birth step (the denoising step that committed it),
    black frame = a Sudoku puzzle's given cell; padding is left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap, TwoSlopeNorm

    mults = rec.get("multipliers") or [[1.0] * len(t) for t in rec["tokens"]]
    lo, hi = _range(mults)
    rows = drawn_cells(rec)
    G, L = len(rows), len(rec["tokens"][0])
    fig = plt.figure(figsize=(max(8, 0.5 * L + 5), 0.7 * G + 2.4))
    ax = fig.add_axes([0.03, 0.1, 0.6, 0.76])
    any_given = any(c.given for row in rows for c in row)
    for g, row in enumerate(rows):
        y = G - 1 - g
        for c in row:
            n = c.position
            ax.add_patch(plt.Rectangle((n, y), 0.95, 0.9, color=c.colour))
            if c.given:
                ax.add_patch(plt.Rectangle((n + 0.04, y + 0.04), 0.87, 0.82, fill=False, lw=1.8))
            ax.text(
                n + 0.47,
                y + 0.55,
                c.text,
                ha="center",
                va="center",
                fontsize=9,
                family="monospace",
                color=_ink(c.colour),
                weight="bold" if c.given else "normal",
            )
            ax.text(
                n + 0.47,
                y + 0.17,
                str(c.birth),
                ha="center",
                va="center",
                fontsize=6.5,
                color=_ink(c.colour, dim=True),
            )
        ax.text(
            L + 0.2,
            y + 0.45,
            f"r={rec['rewards'][g]:.2f}  A={rec['advantages'][g]:+.2f}",
            va="center",
            fontsize=8,
        )
    ax.set_xlim(0, L + 4)
    ax.set_ylim(0, G)
    ax.axis("off")
    prompt = rec["prompts"][0] if len(set(rec["prompts"])) == 1 else ""
    prompt = prompt if len(prompt) <= 60 else prompt[:57] + "..."
    ax.set_title(
        f"step {rec['step']} · {rec['task']} · {rec['method']} · λ={rec['lam']}"
        + (f" · prompt {prompt!r}" if prompt else "")
        + "\nlarge: token · small digits: its birth step (denoising step that committed it)"
        + (" · framed: the puzzle's given cells" if any_given else ""),
        fontsize=8,
        loc="left",
    )
    cmap = LinearSegmentedColormap.from_list("dps", [_BLUE, (1.0, 1.0, 1.0), _RED])
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(lo, 1 - 1e-6), vmax=max(hi, 1 + 1e-6))
    bar = fig.colorbar(
        plt.cm.ScalarMappable(norm=norm, cmap=cmap),
        cax=fig.add_axes([0.645, 0.16, 0.012, 0.64]),
    )
    bar.set_label("DPS multiplier (white: 1)", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    if "norm_deltas" in rec:
        ax2 = fig.add_axes([0.75, 0.2, 0.22, 0.62])
        for g, row in enumerate(rec["norm_deltas"]):
            ax2.plot(rec["recorded_steps"], row, marker=".", label=f"#{g}")
        ax2.axhline(0, color="0.6", lw=0.5)
        ax2.set(xlabel="recorded step r_j", ylabel="normalised δ̄_j", title="progress per interval")
        ax2.legend(fontsize=6)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_html(rec: dict, path: Path, png_name: str) -> None:
    mults = rec.get("multipliers") or [[1.0] * len(t) for t in rec["tokens"]]
    lo, hi = _range(mults)
    rows = []
    for g, drawn in enumerate(drawn_cells(rec)):
        cells = []
        for c in drawn:
            r, gg, b = (int(255 * x) for x in c.colour)
            tip = f"birth step {c.birth}, multiplier {c.multiplier:.3f}"
            frame = ";outline:2px solid black;font-weight:bold" if c.given else ""
            cells.append(
                f'<span title="{tip}" style="background:rgb({r},{gg},{b});'
                f'color:{_ink(c.colour)}{frame}">{html.escape(c.text)}<sub>{c.birth}</sub></span>'
            )
        rows.append(
            f"<tr><td>{html.escape(rec['prompts'][g])}</td><td class=t>{''.join(cells)}"
            f"</td><td>{rec['rewards'][g]:.3f}</td><td>{rec['advantages'][g]:+.3f}</td></tr>"
        )
    page = f"""<!doctype html><meta charset="utf-8"><title>daca inspect, step {rec["step"]}</title>
<style>body{{font-family:sans-serif}} .t span{{font-family:monospace;padding:2px 3px;margin:1px;
display:inline-block}} sub{{opacity:.75;font-size:60%}} td{{padding:4px 8px}}</style>
<h3>Step {rec["step"]}: {html.escape(rec["task"])}, {html.escape(rec["method"])},
λ = {rec["lam"]}</h3>
<p>Each token is coloured by its DPS multiplier (red above 1, blue below; range {lo:.3f} to
{hi:.3f}); the subscript is the denoising step that committed it; a framed, bold token
stands where the puzzle gives the cell. Hover for values.</p>
<table><tr><th>prompt</th><th>completion</th><th>reward</th><th>advantage</th></tr>
{"".join(rows)}</table><p><img src="{png_name}" style="max-width:100%"></p>
"""
    path.write_text(page)
