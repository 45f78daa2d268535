"""The memory planner against a measured 4-bit run (issue 22, "the estimate is checked").

Writes a random LLaDA checkpoint in the hub's layout (``tests/_hub.write_llada``: LLaDA-8B's
config.json keys, real vocabulary of 126 464 and special-token ids, byte-level tokenizer, chat
template) with mid-size widths: d_model 512, 12 layers, MLP 1536 — 170 M parameters, of which
41 M in the layers' projections (4-bit NF4) and 130 M in the embedding and head (fp32). Its
``max_sequence_length`` is 256 + gen_length, so that with ``truncate_prompts=true`` no prompt
is longer than the planner's assumed 256 tokens.

The estimate is ``daca.tools.memory.estimate`` of the TrainConfig that this command resolves
(what ``daca train --dry-run`` prints, shown in full):

    daca train model=DIR task=countdown load_in_4bit=true lora.enabled=true device=cpu \\
        per_device_train_batch_size=4 num_generations=2 generation.gen_length=64 \\
        generation.block_length=32 generation.steps=8 truncate_prompts=true ...

The measurement is that run's: a child process imports everything training needs, reads its
resident memory (the baseline: an imported but empty process), builds the ``Trainer`` (4-bit
load, prepare_model_for_kbit_training, LoRA, AdamW), resets its peak-RSS mark (clear_refs 5, so
that the loader's transient fp32 copies do not count: on a GPU they live in host memory), runs
``--steps`` real ``Trainer.train_step`` calls (rollout with the DPS trace, rewards, update) and
reads VmHWM. measured = VmHWM - baseline: the weights, the trainable state and the larger
phase's tensors, as the planner counts them (the planner's ``peak``). glibc is told to return
every block over 64 KiB to the system when freed (``MALLOC_MMAP_THRESHOLD_``), so that RSS
follows the live tensors as closely as a GPU allocator's peak does. The prompt length the run
actually had is printed: the planner assumes 256.

    python benchmarks/bench_memory_planner.py            # 3 steps, batch 4
    python benchmarks/bench_memory_planner.py --quick    # 2 steps (11 min on 2 busy cores)
Prints estimate, measured and ratio = estimate / measured; exit status 1 when the ratio is
outside 0.75-1.25.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3
WIDTHS = dict(d_model=512, n_heads=8, n_kv_heads=8, n_layers=12, mlp_hidden_size=1536)
PROMPT_TOKENS = 256  # daca.tools.memory.PROMPT_TOKENS: the model reads no more here


def overrides(model: Path, out: Path, batch: int, gen_length: int, block: int, steps: int):
    """The ``daca train`` overrides of the measured run."""
    return [
        f"model={model}",
        f"output_dir={out}",
        "name=bench",
        "task=countdown",
        "method=wd1",
        "load_in_4bit=true",
        "lora.enabled=true",
        "device=cpu",
        f"per_device_train_batch_size={batch}",
        "num_generations=2",
        "train_size=16",
        "eval_size=2",
        "eval_batch_size=2",
        "save_rollouts_every=0",
        "tensorboard=false",
        f"generation.gen_length={gen_length}",
        f"generation.block_length={block}",
        f"generation.steps={steps}",
        "dps.stride=2",
        "truncate_prompts=true",
    ]


def write_model(folder: Path, gen_length: int) -> Path:
    """The random hub-layout LLaDA of ``WIDTHS``, reading 256 prompt tokens + the completion."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _hub import write_llada

    path = write_llada(folder, seed=0, **WIDTHS)
    config = json.loads((path / "config.json").read_text())
    config["max_sequence_length"] = PROMPT_TOKENS + gen_length
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(args) -> None:
    """The measured run: one JSON line with the baseline, the RSS after setup and the peak."""
    import torch

    torch.set_num_threads(args.threads)
    import bitsandbytes  # noqa: F401 - imported before the baseline, like everything below
    import peft  # noqa: F401
    import transformers  # noqa: F401

    from daca.models import loading  # noqa: F401
    from daca.train.config import load_config
    from daca.train.trainer import Trainer

    cfg = load_config(None, json.loads(args.child))
    baseline = status("VmRSS")
    trainer = Trainer(cfg, progress=False)
    after_setup = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
    prompts, rollout_peaks, update_peaks = [], [], []
    make_rollout = trainer._make_rollout

    def spy(step, micro):  # the rollout's own peak; the rest of the step is the update's
        batch, stats = make_rollout(step, micro)
        rollout_peaks.append(status("VmHWM"))
        Path("/proc/self/clear_refs").write_text("5")
        prompts.append(int(batch.prompt_ids.shape[1]))
        return batch, stats

    trainer._make_rollout = spy
    for _ in range(args.steps):
        trainer.train_step()
        update_peaks.append(status("VmHWM"))
        Path("/proc/self/clear_refs").write_text("5")
    peak = max(rollout_peaks + update_peaks)
    print(
        json.dumps(
            dict(
                baseline=baseline,
                after_setup=after_setup,
                peak=peak,
                rollout_peaks=rollout_peaks,
                update_peaks=update_peaks,
                prompt_tokens=prompts,
            )
        )
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 training steps (default 3)")
    ap.add_argument("--steps", type=int, default=None, help="training steps measured")
    ap.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size")
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--block-length", type=int, default=32, help="the paper's 32")
    ap.add_argument("--denoising-steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # the overrides, as JSON
    args = ap.parse_args()
    args.steps = args.steps or (2 if args.quick else 3)
    if args.child:
        child(args)
        return 0

    from daca.tools.memory import estimate, estimate_text
    from daca.train.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "llada-170m", args.gen_length)
        over = overrides(
            model,
            Path(tmp) / "runs",
            args.batch,
            args.gen_length,
            args.block_length,
            args.denoising_steps,
        )
        cfg = load_config(None, over)
        print("daca train " + " ".join(o.replace(tmp, "$TMP") for o in over))
        print(estimate_text(cfg).replace(tmp, "$TMP"))
        est = estimate(cfg)
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        env["OMP_NUM_THREADS"] = str(args.threads)
        cmd = [sys.executable, __file__, "--child", json.dumps(over)]
        cmd += ["--steps", str(args.steps), "--threads", str(args.threads)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout + done.stderr, file=sys.stderr)
            return 2
        got = json.loads(done.stdout.strip().splitlines()[-1])
    measured = got["peak"] - got["baseline"]
    ratio = est.peak / measured
    base = got["baseline"]
    resident = sum(est.resident.values())
    print(
        f"prompt tokens per rollout: {got['prompt_tokens']} (planner assumes {PROMPT_TOKENS}); "
        f"baseline RSS {base / GIB:.2f} GiB; above it: after setup "
        f"{(got['after_setup'] - base) / GIB:.2f} GiB, peaks by step: rollout "
        + ", ".join(f"{(p - base) / GIB:.2f}" for p in got["rollout_peaks"])
        + f" (estimate {(resident + sum(est.rollout.values())) / GIB:.2f}), update "
        + ", ".join(f"{(p - base) / GIB:.2f}" for p in got["update_peaks"])
        + f" (estimate {(resident + sum(est.update.values())) / GIB:.2f}) GiB"
    )
    print(
        f"estimate {est.peak / GIB:.2f} GiB, measured {measured / GIB:.2f} GiB "
        f"(VmHWM - baseline over {args.steps} steps), ratio estimate/measured {ratio:.2f}"
    )
    return 0 if 0.75 <= ratio <= 1.25 else 1


if __name__ == "__main__":
    sys.exit(main())
