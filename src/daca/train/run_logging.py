"""What a run leaves behind: metrics.jsonl, TensorBoard, optional wandb, a progress bar,
a summary table and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from daca.train.config import TrainConfig, to_dict


class RunLogger:
    def __init__(self, run_dir: Path, cfg: TrainConfig, *, enabled: bool, progress: bool):
        self.run_dir, self.cfg, self.enabled = Path(run_dir), cfg, enabled
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
        try:
            plot_run(self.run_dir, history, evals, self.cfg)
        except ImportError:
            print("matplotlib is not installed: no plots (pip install 'daca-grpo[train]')")
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = [h["step"] for h in history]
    rewards = [h["reward"] for h in history]
    ax1.plot(steps, rewards, alpha=0.35, label="per step")
    k = max(1, len(rewards) // 20)
    smooth = [
        sum(rewards[max(0, i - k + 1) : i + 1]) / len(rewards[max(0, i - k + 1) : i + 1])
        for i in range(len(rewards))
    ]
    ax1.plot(steps, smooth, label=f"mean of {k}")
    ax1.set(xlabel="step", ylabel="training reward", title=f"{cfg.task}: {cfg.method} reward")
    ax1.legend()
    ax2.plot([e["step"] for e in evals], [e["held_out"] for e in evals], marker="o")
    ax2.set(xlabel="step", ylabel="held-out metric (temperature 0)", title="held-out")
    fig.tight_layout()
    fig.savefig(run_dir / "curves.png", dpi=110)
    plt.close(fig)
