"""One forward of a left-padded batch: the native path against the bucketed path.

A random LLaDA-architecture model (``daca.models.native.LLaDAForDiffusionLM``: a Llama block,
bidirectional) of a size where compute dominates on a CPU (4 layers, d 512, vocabulary 32 000)
scores a batch of prompts of 8 distinct lengths (40 … 180 tokens, left padded) each followed by
a completion of masks, two ways:

- native: one forward of the whole batch, with the attention mask and positions counted from
  each row's first real token (what LLaDA and Dream get now that they run on transformers'
  own classes);
- bucketed: ``daca.models.loading.bucketed_forward``, one forward per distinct prompt length
  on the real tokens only (what LLaDA's remote code needed, since it passed no mask to
  attention).

Both must give each row the same logits (asserted per row, float32, to 1e-4); the script prints
the median time of each over a few interleaved repeats and the ratio bucketed / native. The
native batch also computes the padded positions (here 40 % more tokens than the buckets see),
so the ratio weighs that against eight smaller, less efficient forwards.

    python benchmarks/bench_padding.py            # 2 rows per length, 5 repeats (~40 s, 1 core)
    python benchmarks/bench_padding.py --quick    # d 256, 2 layers, 1 row per length, 3 repeats
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from daca.models.native import LLaDAForDiffusionLM, llama_config
from daca.models.padding import bucketed_forward

FULL = dict(layers=4, d=512, heads=8, mlp=1376, rows_per_length=2, reps=5)
QUICK = dict(layers=2, d=256, heads=4, mlp=688, rows_per_length=1, reps=3)
VOCAB, MASK_ID, PAD_ID = 32000, 31999, 0


def random_llada(size: dict, seed: int = 0) -> LLaDAForDiffusionLM:
    """A random LLaDA of ``size`` in float32; the seed fixes the weights without touching the
    global RNG."""
    hub = {
        "model_type": "llada", "d_model": size["d"], "n_layers": size["layers"],
        "n_heads": size["heads"], "n_kv_heads": size["heads"], "mlp_hidden_size": size["mlp"],
        "vocab_size": VOCAB, "embedding_size": VOCAB, "max_sequence_length": 512,
        "rope_theta": 500000.0, "weight_tying": False, "mask_token_id": MASK_ID,
        "pad_token_id": PAD_ID,
    }  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LLaDAForDiffusionLM(llama_config(hub, attn_implementation="sdpa"))
    return model.eval()


def padded_batch(lengths, rows_per_length, completion, generator):
    """Prompts of the given lengths (random tokens), left padded, then ``completion`` masks."""
    width = max(lengths) + completion
    rows = [n for n in lengths for _ in range(rows_per_length)]
    ids = torch.full((len(rows), width), PAD_ID)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(rows):
        ids[i, width - completion - n : width - completion] = torch.randint(
            1, MASK_ID, (n,), generator=generator
        )
        ids[i, width - completion :] = MASK_ID
        mask[i, width - completion - n :] = 1
    return ids, mask


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller model, fewer rows and repeats")
    ap.add_argument("--completion", type=int, default=64, help="masked tokens after each prompt")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    size = QUICK if args.quick else FULL
    model = random_llada(size)
    lengths = [40 + 20 * i for i in range(8)]  # 40, 60, …, 180: 8 distinct lengths
    ids, mask = padded_batch(
        lengths, size["rows_per_length"], args.completion, torch.Generator().manual_seed(0)
    )
    paths = {
        "native": lambda: model(ids, attention_mask=mask).logits,
        "bucketed": lambda: bucketed_forward(model, ids, attention_mask=mask).logits,
    }
    logits = {name: run() for name, run in paths.items()}  # also the warm-up
    real = mask.bool()
    worst = 0.0
    for r in range(ids.shape[0]):
        a, b = logits["native"][r, real[r]], logits["bucketed"][r, real[r]]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, r=r: f"row {r}: {m}")
        worst = max(worst, (a - b).abs().max().item())
    times = {name: [] for name in paths}
    for rep in range(size["reps"]):
        order = list(paths) if rep % 2 == 0 else list(reversed(paths))  # interleaved
        for name in order:
            start = time.perf_counter()
            paths[name]()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    params = sum(p.numel() for p in model.parameters())
    print(
        f"bench_padding: LLaDA {size['layers']} layers d {size['d']} V {VOCAB} "
        f"({params / 1e6:.1f} M), {ids.shape[0]} rows, prompts {lengths[0]}..{lengths[-1]} "
        f"(8 lengths) + {args.completion} masks, {real.sum().item()} real of {ids.numel()} "
        f"tokens; native {med['native'] * 1e3:.0f} ms, bucketed {med['bucketed'] * 1e3:.0f} ms "
        f"(median of {size['reps']}, {args.threads} thread); bucketed / native = "
        f"{med['bucketed'] / med['native']:.2f}x; same logits per row (max |Δ| {worst:.1e})"
    )


if __name__ == "__main__":
    main()
