"""``torch.compile`` on the CPU (issue 34, "Speed"; docs/rollouts.md): the shipped tiny trace
model compiled (inductor, static shapes) against eager, on the update's work (the SML
likelihood, K = 4, forward + backward, 16 sequences of P 48 + L 64) and on the rollout's
forwards (batch 8: a full forward of P + L positions, and one of 32 positions, the size of a
cached block step). Prints the speed-up of each (median of interleaved rounds, CPU time, one
thread, compile time excluded) and the largest difference from eager: the project keeps
compile only where it is faster and exact.

    python benchmarks/bench_compile.py           # 7 rounds (compiling takes about a minute)
    python benchmarks/bench_compile.py --quick   # 3 rounds
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from daca.core.likelihood import stratified_logp
from daca.core.modeling import forward_logits
from daca.models import load
from daca.shipped import SHIPPED


def workloads(bundle, generator: torch.Generator) -> dict:
    """name -> (function of a model returning a tensor, whether it runs a backward)."""
    V = bundle.model.config.vocab_size
    prompt, completion = (torch.randint(5, V - 5, (16, n), generator=generator) for n in (48, 64))
    full = torch.randint(5, V - 5, (8, 48 + 64), generator=generator)
    block = full[:, :32].clone()

    def sml(model):
        logp = stratified_logp(
            model, prompt, completion, mask_id=bundle.mask_id, num_strata=4,
            generator=torch.Generator().manual_seed(1),
        )  # fmt: skip
        logp.sum().backward()
        return logp.detach()

    return {
        "update: SML K=4, forward + backward": sml,
        "rollout: full forward, 8 x 112": lambda m: forward_logits(m, full).detach(),
        "rollout: forward of 8 x 32": lambda m: forward_logits(m, block).detach(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of 7")
    ap.add_argument("--model", default="tiny-sudoku-trace")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bundle = load(str(SHIPPED.get(args.model, args.model)))
    eager = bundle.model.float().train()
    compiled = torch.compile(eager, dynamic=False)
    rounds = 3 if args.quick else 7
    for name, fn in workloads(bundle, torch.Generator().manual_seed(0)).items():
        with torch.set_grad_enabled(name.startswith("update")):
            reference = fn(eager)
            start = time.time()
            diff = (fn(compiled) - reference).abs().max().item()  # compiles here
            compile_s = time.time() - start
            times = {"eager": [], "compiled": []}
            for r in range(rounds):
                for variant in ("eager", "compiled")[r % 2 :] + ("eager", "compiled")[: r % 2]:
                    eager.zero_grad()
                    start = time.process_time()
                    fn(eager if variant == "eager" else compiled)
                    times[variant].append(time.process_time() - start)
        ratio = statistics.median(times["eager"]) / statistics.median(times["compiled"])
        print(
            f"{name:40s} compiled {ratio:5.2f}x eager; max |diff| {diff:.1e} "
            f"({'exact' if diff == 0 else 'not exact'}); compiling took {compile_s:.0f} s"
        )


if __name__ == "__main__":
    main()
