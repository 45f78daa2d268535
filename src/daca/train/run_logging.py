"""What a run leaves behind: metrics.jsonl, TensorBoard, optional wandb, a progress bar,
a summary table and PNG plots (``curves.png``, redrawn at every evaluation)."""

from __future__ import annotations

import json
from pathlib import Path

from daca.train.config import TrainConfig, to_dict


class RunLogger:
    """``history`` and ``evals`` are the trainer's lists (read, never changed here): the plots
    are drawn from them."""

    def __init__(
        self,
        run_dir: Path,
        cfg: TrainConfig,
        *,
        enabled: bool,
        progress: bool,
        history: list[dict] | None = None,
        evals: list[dict] | None = None,
    ):
        self.run_dir, self.cfg, self.enabled = Path(run_dir), cfg, enabled
        self.history = history if history is not None else []
        self.evals = evals if evals is not None else []
        self._no_matplotlib_said = False
        self.bar = None
        self.progress = progress and enabled
        self.tb = None
        self.wandb = None
        self.held_out = float("nan")
        if not enabled:
            return
        self.metrics = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()
        self.evals_file = open(self.run_dir / "evals.jsonl", "a")  # noqa: SIM115
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                print("tensorboard is not installed: pip install 'daca-grpo[train]'")
        if cfg.wandb:
            import wandb

            self.wandb = wandb.init(project="daca", name=cfg.name, config=to_dict(cfg))

    def start(self, total: int, initial: int, held_out: float) -> None:
        self.held_out = held_out
        if self.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=self.cfg.name, unit="step")

    def log_step(self, stats: dict) -> None:
        if not self.enabled:
            return
        step = stats["step"]
        if step % self.cfg.log_every == 0:
            self.metrics.write(json.dumps(stats) + "\n")
            self.metrics.flush()
        for k, v in stats.items():
            if self.tb is not None and k != "step":
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(stats, step=step)
        if self.bar is not None:
            self.bar.update(1)
            took = stats["time_rollout"] + stats["time_reward"] + stats["time_update"]
            self.bar.set_postfix(
                reward=f"{stats['reward']:.3f}",
                held_out=f"{self.held_out:.3f}",
                s_step=f"{took:.2f}",
            )

    def log_eval(self, record: dict) -> None:
        self.held_out = record["held_out"]
        if not self.enabled:
            return
        self.evals_file.write(json.dumps(record) + "\n")
        self.evals_file.flush()
        if self.tb is not None:
            self.tb.add_scalar("held_out", record["held_out"], record["step"])
        if self.wandb is not None:
            self.wandb.log({"held_out": record["held_out"]}, step=record["step"])
        self.plot()

    def plot(self) -> None:
        """Redraw ``curves.png`` from the steps and evaluations so far (main process only)."""
        if not self.enabled:
            return
        try:
            plot_run(self.run_dir, self.history, self.evals, self.cfg)
        except ImportError:
            if not self._no_matplotlib_said:
                print("matplotlib is not installed: no plots (pip install 'daca-grpo[train]')")
            self._no_matplotlib_said = True

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if not self.enabled:
            return
        self.metrics.close()
        self.evals_file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()

    def finish(self, history: list[dict], evals: list[dict], summary: dict) -> None:
        """Plots and the summary table (main process only)."""
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        self.history, self.evals = history, evals
        self.plot()
        print(summary_table(history, evals, summary))


def summary_table(history: list[dict], evals: list[dict], summary: dict) -> str:
    first = history[: max(1, len(history) // 10)]
    last = history[-max(1, len(history) // 10) :]

    def avg(rows, key):
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    step_time = (
        avg(history, "time_rollout") + avg(history, "time_reward") + avg(history, "time_update")
    )
    rows = [
        ("task / method", f"{summary['task']} / {summary['method']}"),
        ("steps", str(summary["steps"])),
        ("held-out before", f"{summary['held_out_before']:.4f}"),
        ("held-out after", f"{summary['held_out_after']:.4f}"),
        ("held-out change", f"{summary['held_out_after'] - summary['held_out_before']:+.4f}"),
        ("train reward, first 10 % of steps", f"{avg(first, 'reward'):.4f}"),
        ("train reward, last 10 % of steps", f"{avg(last, 'reward'):.4f}"),
        ("mean step time (s)", f"{step_time:.3f}"),
        ("run folder", summary["run_dir"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def plot_run(run_dir: Path, history: list[dict], evals: list[dict], cfg: TrainConfig) -> None:
    """Training reward per step and the held-out metric with its 95 % interval, written to
    ``curves.png`` atomically (a viewer never sees half a file)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = [h["step"] for h in history]
    rewards = [h["reward"] for h in history]
    k = max(1, len(rewards) // 20)
    ax1.plot(steps, rewards, alpha=0.35 if k > 1 else 1.0, label="per step")
    smooth = [
        sum(rewards[max(0, i - k + 1) : i + 1]) / len(rewards[max(0, i - k + 1) : i + 1])
        for i in range(len(rewards))
    ]
    if k > 1:
        ax1.plot(steps, smooth, label=f"mean of {k}")
    ax1.set(xlabel="step", ylabel="training reward", title=f"{cfg.task}: {cfg.method} reward")
    ax1.set_ylim(*honest_limits(rewards, [0.0] * len(rewards)))
    if rewards:
        ax1.legend(loc="best")
    eval_steps = [e["step"] for e in evals]
    held_out = [e["held_out"] for e in evals]
    ci = [e.get("held_out_ci95", 0.0) for e in evals]
    ci = [0.0 if c != c else c for c in ci]  # NaN (one example): no interval to draw
    ax2.errorbar(eval_steps, held_out, yerr=ci, marker="o", capsize=3, label="mean ± 95 % interval")
    ax2.set_ylim(*honest_limits(held_out, ci))
    ax2.set(xlabel="step", ylabel="held-out metric (temperature 0)", title="held-out")
    if any(ci):
        ax2.legend(loc="best")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    tmp = run_dir / "curves.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(run_dir / "curves.png")


def honest_limits(values: list[float], half_widths: list[float]) -> tuple[float, float]:
    """A y-range that does not magnify noise: the whole [0, 1] for values that are fractions
    (every metric and reward of the shipped tasks), else the data padded so that the axis is no
    narrower than a tenth of the largest magnitude or the widest interval."""
    finite = [(v, h) for v, h in zip(values, half_widths, strict=True) if v == v]
    if not finite:
        return -0.02, 1.02
    lo, hi = min(v - h for v, h in finite), max(v + h for v, h in finite)
    if all(0 <= v <= 1 for v, _ in finite):
        return min(-0.02, lo), max(1.02, hi)
    span = max(hi - lo, 0.1 * max(abs(lo), abs(hi)), 2 * max(half_widths, default=0.0), 1e-6)
    middle = (lo + hi) / 2
    return middle - 0.55 * span, middle + 0.55 * span
