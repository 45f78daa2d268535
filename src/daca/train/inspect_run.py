"""``daca inspect RUN_DIR [--step N]``: see which commitments DPS credited.

Each completion token of the recorded group is drawn coloured by its DPS multiplier (blue below
1, red above), with its birth step beneath, beside the δ̄ curve over the denoising intervals and
the group's rewards; a PNG and an HTML page.
"""

from __future__ import annotations

import html
import json
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


def _colour(m: float, lo: float, hi: float) -> tuple[float, float, float]:
    """White at 1, red towards the largest multiplier, blue towards the smallest."""
    if m >= 1:
        a = 0.0 if hi <= 1 else min(1.0, (m - 1) / (hi - 1))
        return (1.0, 1 - 0.75 * a, 1 - 0.75 * a)
    a = 0.0 if lo >= 1 else min(1.0, (1 - m) / (1 - lo))
    return (1 - 0.75 * a, 1 - 0.75 * a, 1.0)


def render_png(rec: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens, births = rec["tokens"], rec["birth_step"]
    mults = rec.get("multipliers") or [[1.0] * len(t) for t in tokens]
    lo = min(min(r) for r in mults)
    hi = max(max(r) for r in mults)
    G, L = len(tokens), len(tokens[0])
    fig = plt.figure(figsize=(max(8, 0.5 * L + 5), 0.7 * G + 2.2))
    ax = fig.add_axes([0.03, 0.08, 0.62, 0.8])
    for g in range(G):
        y = G - 1 - g
        for n in range(L):
            ax.add_patch(plt.Rectangle((n, y), 0.95, 0.9, color=_colour(mults[g][n], lo, hi)))
            ax.text(
                n + 0.47,
                y + 0.55,
                tokens[g][n].replace("[EOS]", "·"),
                ha="center",
                va="center",
                fontsize=9,
                family="monospace",
            )
            ax.text(
                n + 0.47,
                y + 0.15,
                str(births[g][n]),
                ha="center",
                va="center",
                fontsize=5,
                color="0.35",
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
    ax.set_title(
        f"step {rec['step']} · {rec['task']} · {rec['method']} · λ={rec['lam']}"
        f" · colour: multiplier [{lo:.2f}, {hi:.2f}], small digits: birth step",
        fontsize=8,
        loc="left",
    )
    if "norm_deltas" in rec:
        ax2 = fig.add_axes([0.72, 0.2, 0.25, 0.65])
        for g, row in enumerate(rec["norm_deltas"]):
            ax2.plot(rec["recorded_steps"], row, marker=".", label=f"#{g}")
        ax2.axhline(0, color="0.6", lw=0.5)
        ax2.set(xlabel="recorded step r_j", ylabel="normalised δ̄_j", title="progress per interval")
        ax2.legend(fontsize=6)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_html(rec: dict, path: Path, png_name: str) -> None:
    tokens, births = rec["tokens"], rec["birth_step"]
    mults = rec.get("multipliers") or [[1.0] * len(t) for t in tokens]
    lo = min(min(r) for r in mults)
    hi = max(max(r) for r in mults)
    rows = []
    for g in range(len(tokens)):
        cells = []
        for n, tok in enumerate(tokens[g]):
            r, gg, b = (int(255 * c) for c in _colour(mults[g][n], lo, hi))
            tip = f"birth step {births[g][n]}, multiplier {mults[g][n]:.3f}"
            cells.append(
                f'<span title="{tip}" style="background:rgb({r},{gg},{b})">'
                f"{html.escape(tok.replace('[EOS]', '·'))}<sub>{births[g][n]}</sub></span>"
            )
        rows.append(
            f"<tr><td>{html.escape(rec['prompts'][g])}</td><td class=t>{''.join(cells)}"
            f"</td><td>{rec['rewards'][g]:.3f}</td><td>{rec['advantages'][g]:+.3f}</td></tr>"
        )
    page = f"""<!doctype html><meta charset="utf-8"><title>daca inspect, step {rec["step"]}</title>
<style>body{{font-family:sans-serif}} .t span{{font-family:monospace;padding:2px 3px;margin:1px;
display:inline-block}} sub{{color:#666;font-size:60%}} td{{padding:4px 8px}}</style>
<h3>Step {rec["step"]}: {html.escape(rec["task"])}, {html.escape(rec["method"])},
λ = {rec["lam"]}</h3>
<p>Each token is coloured by its DPS multiplier (red above 1, blue below; range {lo:.3f} to
{hi:.3f}); the subscript is the denoising step that committed it. Hover for values.</p>
<table><tr><th>prompt</th><th>completion</th><th>reward</th><th>advantage</th></tr>
{"".join(rows)}</table><p><img src="{png_name}" style="max-width:100%"></p>
"""
    path.write_text(page)
