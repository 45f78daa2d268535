"""Memory over many tiny training steps with DPS and SML on (issue 8, "Leaks").

Runs ``Trainer.train()`` (wd1 + DPS + SML, the whole loop: rollouts, rewards, updates,
metrics.jsonl) for ``--steps`` steps on a small random model in the tiny model's format, and
prints the resident memory (VmRSS) at step 50 and at the end: a leak shows as growth beyond
the noise of the allocator (a few MiB). The run's history (one dict of numbers per step, kept
by design for the checkpoints) is measured and printed beside it.

It also checks, after every rollout, that the DPS trace recorder released its buffers: the
recorder held rows while decoding (``Rollout.trace_peak_bytes`` > 0), holds none after the last
step (``held_bytes`` == 0, no row groups), and is freed when the rollout returns (a weak
reference to it is dead, without a garbage collection: nothing keeps it in a cycle).

    python benchmarks/bench_memory_leak.py            # 500 steps
    python benchmarks/bench_memory_leak.py --quick    # 150 steps
Exit status 1 when the recorder kept anything.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import weakref
from pathlib import Path

import torch

MIB = 1024 * 1024


def rss() -> int:
    """Resident memory of this process in bytes (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def random_tiny_model(folder: Path) -> Path:
    """A small random tiny LLaDA in the shipped models' format."""
    from transformers.utils import logging as hf_logging

    from daca.models.tiny import new_tiny, save_tiny

    hf_logging.disable_progress_bar()
    model, tok = new_tiny(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, seed=0)
    return save_tiny(folder, model, tok)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 500)")
    ap.add_argument("--quick", action="store_true", help="150 steps")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    steps = args.steps or (150 if args.quick else 500)
    if steps <= 50:
        ap.error("--steps must be > 50 (memory is compared from step 50 on)")
    torch.set_num_threads(args.threads)

    from daca.core import sampler
    from daca.tasks import Task, get_task, register_task
    from daca.train import rollout as rollout_module
    from daca.train import trainer as trainer_module
    from daca.train.config import load_config

    sudoku = get_task("sudoku")

    def ones(prompts, completions, **kw):
        return [c.count("1") / 16 for c in completions]

    register_task(
        "ones",
        lambda: Task(
            name="ones",
            load=sudoku.load,
            chat_prompt=sudoku.chat_prompt,
            compact_prompt=sudoku.compact_prompt,
            reward_funcs=[ones],
            score=lambda completions, **kw: ones(None, completions),
            columns=sudoku.columns,
        ),
    )

    # Spies: every recorder (weakly), its state after the last step, each rollout's peak.
    recorders: list[weakref.ref] = []
    at_end: list[tuple[int, int]] = []  # (held_bytes, row groups) after the last step
    peaks: list[int] = []
    problems: list[str] = []

    class Recorder(sampler.TraceRecorder):
        def __init__(self, **kw):
            super().__init__(**kw)
            recorders.append(weakref.ref(self))

        def finish(self, steps_taken):
            at_end.append((self.held_bytes, len(self.groups)))  # after the last step
            super().finish(steps_taken)

    sampler.TraceRecorder = Recorder  # generate() looks the class up at each call
    generate = rollout_module.generate  # the training rollout calls it

    def spy_generate(*a, **kw):
        out = generate(*a, **kw)
        if kw.get("dps_stride") is not None:
            peaks.append(out.trace_peak_bytes)
        return out

    rollout_module.generate = spy_generate
    make_rollout = trainer_module.Trainer._make_rollout
    samples: dict[int, int] = {}

    def checked_rollout(self, step, micro):
        made = len(recorders)
        out = make_rollout(self, step, micro)
        alive = [r for r in recorders[made:] if r() is not None]
        if alive:
            problems.append(f"step {step}: {len(alive)} trace recorder(s) alive after the rollout")
        if at_end and at_end[-1] != (0, 0):
            problems.append(f"step {step}: recorder holds {at_end[-1]} (bytes, groups) at the end")
        if step + 1 in (1, 50, steps // 2, steps) or (step + 1) % 50 == 0:
            samples[step + 1] = rss()
        return out

    trainer_module.Trainer._make_rollout = checked_rollout

    out = Path(tempfile.mkdtemp(prefix="bench-memory-leak-"))
    model = random_tiny_model(out / "model")
    cfg = load_config(
        None,
        [
            f"model={model}",
            f"output_dir={out}",
            "name=leak",
            "task=ones",
            "device=cpu",
            "method=wd1",
            "dps.enabled=true",
            "dps.stride=2",
            "sml.enabled=true",
            "sml.num_strata=4",
            "per_device_train_batch_size=8",
            "num_generations=4",
            "train_size=100",
            "eval_size=4",
            "eval_every=0",
            f"max_steps={steps}",
            f"save_every={steps}",
            "save_rollouts_every=0",
            "tensorboard=false",
            "generation.steps=8",
            "generation.gen_length=16",
            "generation.block_length=8",
        ],
    )
    before = rss()
    trainer = trainer_module.Trainer(cfg, progress=False)
    trainer.train()
    history_bytes = len(json.dumps(trainer.history).encode())

    at50, last = samples[50], samples[steps]
    print(f"\n{steps} steps of wd1 + DPS (stride 2) + SML (K=4), batch 8, threads {args.threads}")
    print(f"resident memory before building the trainer: {before / MIB:8.1f} MiB")
    for s in sorted(samples):
        print(f"  after step {s:4d}: {samples[s] / MIB:8.1f} MiB")
    growth = last - at50
    print(
        f"growth from step 50 to step {steps}: {growth / MIB:+.2f} MiB "
        f"({100 * growth / at50:+.2f} %); the run's history holds {history_bytes / MIB:.2f} MiB "
        f"as JSON ({steps} dicts, kept by design)"
    )
    print(
        f"DPS trace recorder: {len(recorders)} rollouts recorded, peak held "
        f"{max(peaks) / 1024:.1f} KiB (median {sorted(peaks)[len(peaks) // 2] / 1024:.1f} KiB); "
        f"after the last step: max held {max(b for b, _ in at_end)} bytes, "
        f"{max(g for _, g in at_end)} row groups; alive after their rollout: "
        f"{sum(r() is not None for r in recorders)}"
    )
    if problems or len(peaks) != len(recorders) or min(peaks) <= 0:
        print("FAIL: " + "; ".join(problems[:5] or ["no trace recorded"]))
        return 1
    print("recorder buffers released after every rollout: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
