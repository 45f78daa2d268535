"""``daca pretrain``: train the embedded tiny masked diffusion LM from scratch.

Objective (LLaDA's SFT loss): each completion token is masked with probability t ~ U(0, 1]
(one t per example), and the cross-entropy on the masked tokens is weighted by 1/t. The
prompt stays visible. Training stops at ``max_steps`` or as soon as the held-out metric of
the stopping task reaches ``target_accuracy``: supervised training learns these tasks almost
at once, and RL needs a base model that is above chance but far from perfect.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from daca.core.modeling import forward_logits, full_attention_mask
from daca.models.loading import LoadedModel
from daca.models.prompts import encode_prompts, encode_targets, prompt_texts
from daca.models.tiny import new_tiny, save_tiny
from daca.tasks import get_task
from daca.train.config import GenerationConfig
from daca.train.evaluation import evaluate


@dataclass
class PretrainConfig:
    task: str = "sudoku"  # sudoku | countdown | sudoku-trace | countdown-trace | mix
    out: str = "runs/pretrain-tiny"
    seed: int = 0
    max_steps: int = 1500
    batch_size: int = 128
    learning_rate: float = 1e-3
    eval_every: int = 5
    eval_size: int = 200
    target_accuracy: float | None = 0.40  # stop once the stopping task's held-out metric >= this
    stop_task: str = "sudoku"  # which task's metric the stopping rule reads (mix: sudoku)
    train_size: int = 4000  # generated training examples per task
    max_minutes: float | None = None  # stop (and save) after this much wall time
    init_from: str | None = None  # continue from a saved tiny model (its steps and history)
    also_eval: tuple[str, ...] = ()  # tasks measured on the final model only (held_out)
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 256
    gen_length: int = 16
    steps: int = 8
    block_length: int = 16


def masked_diffusion_loss(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor | None,
    target_ids: Tensor,
    *,
    mask_id: int,
    generator: torch.Generator | None = None,
) -> Tensor:
    """LLaDA's SFT loss: Σ_masked CE(o_n) / t, averaged over the batch's completion tokens."""
    b, length = target_ids.shape
    t = 1.0 - torch.rand(b, 1, generator=generator, device=target_ids.device)  # (0, 1]
    masked = torch.rand(b, length, generator=generator, device=target_ids.device) < t
    noisy = torch.where(masked, torch.full_like(target_ids, mask_id), target_ids)
    ids = torch.cat([prompt_ids, noisy], dim=1)
    attn = full_attention_mask(prompt_mask, prompt_ids, length)
    logits = forward_logits(model, ids, attn)[:, prompt_ids.shape[1] :]
    ce = F.cross_entropy(logits.transpose(1, 2), target_ids, reduction="none")
    return (ce * masked / t).sum() / (b * length)


def supervised_targets(task, rows: list[dict]) -> list[str]:
    """The completion each row teaches: the task's ``reference_completion`` (a trace, then the
    answer) or, without one, the row's solution."""
    if task.reference_completion is None:
        return [r["solution"] for r in rows]
    return [task.reference_completion(r) for r in rows]


def _bundle(model, tokenizer) -> LoadedModel:
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        mask_id=tokenizer.mask_token_id,
        family="llada",
        eos_ids=(tokenizer.eos_token_id,),
        pad_id=tokenizer.pad_token_id,
        prompt_format="compact",
    )


def pretrain(cfg: PretrainConfig, *, progress: bool = True, log=print) -> dict:
    """Train, save the model folder to ``cfg.out`` and return the summary (also in daca.json)."""
    names = ["sudoku", "countdown"] if cfg.task == "mix" else [cfg.task]
    deadline = None if cfg.max_minutes is None else time.time() + 60 * cfg.max_minutes
    tasks = {n: get_task(n) for n in names}
    train = {n: tasks[n].load(split="train", limit=cfg.train_size, seed=cfg.seed) for n in names}
    test = {n: tasks[n].load(split="test", limit=cfg.eval_size, seed=cfg.seed) for n in names}
    stop_task = cfg.stop_task if cfg.stop_task in names else names[0]

    prior = {"steps_trained": 0, "seconds": 0.0, "history": []}
    if cfg.init_from:
        from daca.models.loading import load

        bundle = load(cfg.init_from)
        model, tokenizer = bundle.model, bundle.tokenizer
        prior.update({k: v for k, v in bundle.meta.items() if k in prior})
    else:
        model, tokenizer = new_tiny(
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            intermediate_size=cfg.intermediate_size,
            max_positions=max(128, 32 + cfg.gen_length),  # a compact prompt is under 32 tokens
            seed=cfg.seed,
            words=tuple(w for n in names for w in tasks[n].compact_vocabulary),
        )
        bundle = _bundle(model, tokenizer)
    gen = GenerationConfig(
        gen_length=cfg.gen_length, steps=cfg.steps, block_length=cfg.block_length, temperature=0.0
    )

    # Encode every training example once.
    data = []
    for n in names:
        rows = train[n]
        p_ids, p_mask = encode_prompts(bundle, prompt_texts(bundle, tasks[n], rows))
        targets = encode_targets(bundle, supervised_targets(tasks[n], rows), cfg.gen_length)
        data.append((p_ids, p_mask, targets))
    p_ids = torch.cat([d[0] for d in data])
    p_mask = torch.cat([d[1] for d in data])
    targets = torch.cat([d[2] for d in data])

    gen_torch = torch.Generator().manual_seed(cfg.seed)
    order_rng = random.Random(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    history: list[dict] = list(prior["history"])
    offset = int(prior["steps_trained"])  # steps of the model this run continues

    def held_out(step: int) -> dict:
        metrics = {"step": offset + step}
        for n in names:
            metrics[n] = evaluate(bundle, tasks[n], test[n], gen, batch_size=200).mean
        if history and history[-1]["step"] == metrics["step"]:
            history.pop()  # the continued model's last evaluation, measured again
        history.append(metrics)
        return metrics

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, desc="pretrain", unit="step")
    start = time.time()
    metrics = held_out(0)
    step = 0
    index: list[int] = []
    while step < cfg.max_steps:
        if cfg.target_accuracy is not None and metrics[stop_task] >= cfg.target_accuracy:
            break
        if deadline is not None and time.time() > deadline:
            break
        if len(index) < cfg.batch_size:
            perm = list(range(len(targets)))
            order_rng.shuffle(perm)
            index += perm
        batch, index = index[: cfg.batch_size], index[cfg.batch_size :]
        model.train()
        loss = masked_diffusion_loss(
            model,
            p_ids[batch],
            p_mask[batch],
            targets[batch],
            mask_id=bundle.mask_id,
            generator=gen_torch,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        model.eval()
        step += 1
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            metrics = held_out(step)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", **{n: f"{metrics[n]:.3f}" for n in names})
    if bar is not None:
        bar.close()
    if history[-1]["step"] != offset + step:
        metrics = held_out(step)

    final = {n: metrics[n] for n in names}
    for n in cfg.also_eval:  # e.g. countdown-public: the public distribution of the task
        rows = get_task(n).load(split="test", limit=cfg.eval_size, seed=cfg.seed)
        final[n] = evaluate(bundle, get_task(n), rows, gen, batch_size=200).mean
    summary = {
        "generation": asdict(gen),
        "pretrain": asdict(cfg),
        "steps_trained": offset + step,
        "seconds": round(prior["seconds"] + time.time() - start, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "held_out": final,
        "eval_size": cfg.eval_size,
        "history": history,
    }
    out = save_tiny(cfg.out, model, tokenizer, **summary)
    summary = {"family": "llada", "prompt_format": "compact", **summary}
    log(f"saved {out} after {step} steps: " + ", ".join(f"{n} {v:.3f}" for n, v in final.items()))
    return summary
