"""Sampler speed: `daca.generate` against a plain restatement of LLaDA's `generate`.

The reference computes, every step, full-sequence float64 softmax (and, at temperature > 0,
float64 Gumbel noise) over [B, P+L, V] and a per-row topk, as LLaDA's reference code does; ours
computes them only on the masked positions of the current block (METHOD.md §1). Same random
model (4-layer d=256 ModernBERT, vocab 4096), prompts and schedule. At temperature 0 the script
asserts identical sequences; at temperature 0.9 it only times (the random streams differ).
Runs are interleaved and medians of process CPU time compared (one thread: time spent waiting
for a shared core does not count; wall-clock ratio printed too). Target (reference/ours) >= 1.0.

    python benchmarks/bench_sampler_speed.py          # L=64, 32 steps
    python benchmarks/bench_sampler_speed.py --full   # L=128, 64 steps
"""

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from daca.core.modeling import forward_logits
from daca.core.sampler import generate
from daca.models.tiny import build_model, tiny_config


@torch.no_grad()
def llada_generate(model, prompt, *, mask_id, gen_length, steps, block_length, temperature, gen):
    """LLaDA's generate, restated for a batch (no cfg, low_confidence remasking)."""
    B, P = prompt.shape
    x = torch.full((B, P + gen_length), mask_id)
    x[:, :P] = prompt
    num_blocks = gen_length // block_length
    k = steps // num_blocks
    for nb in range(num_blocks):
        n = (x[:, P + nb * block_length : P + (nb + 1) * block_length] == mask_id).sum(1)
        num_transfer = (n[:, None] // k) + (torch.arange(k)[None] < (n % k)[:, None]).long()
        for i in range(k):
            mask_index = x == mask_id
            logits = forward_logits(model, x)
            if temperature > 0:
                noise = torch.rand(logits.shape, dtype=torch.float64, generator=gen)
                noisy = logits.double().exp() / (-torch.log(noise)) ** temperature
            else:
                noisy = logits
            x0 = noisy.argmax(-1)
            p = F.softmax(logits.double(), dim=-1)
            x0_p = p.gather(-1, x0[..., None]).squeeze(-1)
            x0_p[:, P + (nb + 1) * block_length :] = -math.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -math.inf)
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            for b in range(B):
                transfer[b, confidence[b].topk(int(num_transfer[b, i])).indices] = True
            x[transfer] = x0[transfer]
    return x


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the issue's size: L=128, 64 steps")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    V, B, P, bl = 4096, 2, 16, 32
    L, T = (128, 64) if args.full else (64, 32)
    model = build_model(
        tiny_config(V, hidden_size=256, num_layers=4, num_heads=4, intermediate_size=512), seed=0
    )
    prompt = torch.randint(0, V - 1, (B, P), generator=torch.Generator().manual_seed(0))
    kw = dict(mask_id=V - 1, gen_length=L, steps=T, block_length=bl)
    generate(model, prompt, **(kw | dict(gen_length=bl, steps=2)))  # warm-up
    print(f"model d=256 x 4 layers, V={V}, B={B}, P={P}, L={L}, T={T}, block {bl}")
    for temperature in (0.0, 0.9):
        cpu = {"reference": [], "ours": []}
        wall = {"reference": [], "ours": []}
        for _ in range(args.reps):
            for name in ("reference", "ours"):
                gen = torch.Generator().manual_seed(0)
                start, start_cpu = time.perf_counter(), time.process_time()
                if name == "reference":
                    ref = llada_generate(model, prompt, temperature=temperature, gen=gen, **kw)
                else:
                    ours = generate(model, prompt, temperature=temperature, generator=gen, **kw)
                cpu[name].append(time.process_time() - start_cpu)
                wall[name].append(time.perf_counter() - start)
            if temperature == 0:
                assert torch.equal(ours.sequences, ref), "outputs differ from LLaDA's reference"
        ref_t, our_t = statistics.median(cpu["reference"]), statistics.median(cpu["ours"])
        ref_w, our_w = statistics.median(wall["reference"]), statistics.median(wall["ours"])
        same = "identical outputs (asserted)" if temperature == 0 else "timing only"
        print(
            f"temperature {temperature}: CPU reference {ref_t:.3f} s, ours {our_t:.3f} s, "
            f"speed ratio {ref_t / our_t:.3f}x | wall ratio {ref_w / our_w:.3f}x; {same}"
        )
    print("target speed ratio >= 1.0x")


if __name__ == "__main__":
    main()
