"""Time overhead of recording the DPS trace (METHOD.md §2: no extra forward pass).

`generate` with dps_stride=s (scope "all" and "block") against `generate` without it, same
random model, prompts and seed, on a model whose forward dominates as it does at scale (issue 2:
a random 4-layer d=256 ModernBERT, vocab 4096, L=128, 64 steps, block 32; `--full`). Runs are
interleaved (none, all, block, none, ...) and the median of each is compared, since the CPU is
shared: the ratio is of process CPU time (one thread, so waiting for a shared core does not
count; wall-clock ratio printed too), and the time spent inside the recorder is measured
directly (the rest of the sampler runs the same code path). Also checks that recording changes
no token. Target ratio <= 1.03.

    python benchmarks/bench_dps_overhead.py          # L=64, 32 steps (about a minute)
    python benchmarks/bench_dps_overhead.py --full   # L=128, 64 steps
"""

import argparse
import statistics
import time

import torch

from daca.core import sampler
from daca.core.sampler import generate
from daca.models.tiny import build_model, tiny_config

recorder_seconds = [0.0]  # CPU time spent inside the trace recorder (instrumentation)
_step = sampler.TraceRecorder.step


def _timed_step(self, **kwargs):
    start = time.process_time()
    _step(self, **kwargs)
    recorder_seconds[0] += time.process_time() - start


sampler.TraceRecorder.step = _timed_step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the issue's size: L=128, 64 steps")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stride", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    V, B, P, bl = 4096, 2, 16, 32
    L, T = (128, 64) if args.full else (64, 32)
    model = build_model(
        tiny_config(V, hidden_size=256, num_layers=4, num_heads=4, intermediate_size=512), seed=0
    )
    prompt = torch.randint(0, V - 1, (B, P), generator=torch.Generator().manual_seed(0))
    kw = dict(mask_id=V - 1, gen_length=L, steps=T, block_length=bl, temperature=0.9)
    variants = {"none": {}, "all": dict(dps_stride=args.stride, dps_scope="all")}
    variants["block"] = dict(dps_stride=args.stride, dps_scope="block")
    times = {name: [] for name in variants}
    walls = {name: [] for name in variants}
    in_recorder = {name: [] for name in variants}
    sequences = {}
    generate(model, prompt, **(kw | dict(gen_length=bl, steps=2)))  # warm-up
    for _ in range(args.reps):
        for name, extra in variants.items():
            recorder_seconds[0] = 0.0
            start, cpu = time.perf_counter(), time.process_time()
            out = generate(model, prompt, generator=torch.Generator().manual_seed(0), **kw, **extra)
            times[name].append(time.process_time() - cpu)
            walls[name].append(time.perf_counter() - start)
            in_recorder[name].append(recorder_seconds[0])
            sequences.setdefault(name, out.sequences)
            assert torch.equal(out.sequences, sequences["none" if "none" in sequences else name])
    print(
        f"model d=256 x 4 layers, V={V}, B={B}, P={P}, L={L}, T={T}, block {bl}, "
        f"stride {args.stride}, {args.reps} interleaved reps, {args.threads} threads"
    )
    base, base_wall = statistics.median(times["none"]), statistics.median(walls["none"])
    for name, ts in times.items():
        med, wall = statistics.median(ts), statistics.median(walls[name])
        rec = statistics.median(in_recorder[name])
        print(
            f"{name:>5}: CPU median {med:6.3f} s, ratio {med / base:.3f}x | wall {wall:6.3f} s,"
            f" ratio {wall / base_wall:.3f}x | in the recorder {rec:.3f} s"
            f" CPU = {rec / base:.2%} of the plain run"
        )
    print("recording changed no token (same seed, same sequences); target ratio <= 1.03x")


if __name__ == "__main__":
    main()
