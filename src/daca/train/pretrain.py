"""``daca pretrain``: train the embedded tiny masked diffusion LM from scratch.

Objective (LLaDA's SFT loss): each completion token is masked with probability t ~ U(0, 1]
(one t per example), and the cross-entropy on the masked tokens is weighted by 1/t. The
prompt stays visible. Training stops at ``max_steps`` or as soon as the held-out metric of
the stopping task reaches ``target_accuracy``: supervised training learns these tasks almost
at once, and RL needs a base model that is above chance but far from perfect. SIGINT or SIGTERM
saves the model of the last finished step and raises ``Interrupted`` (``--init-from`` continues).
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import Tensor

from daca.core.modeling import forward_logits, full_attention_mask
from daca.models.loading import LoadedModel
from daca.models.prompts import encode_prompts, encode_targets
from daca.models.tiny import new_tiny, save_tiny
from daca.tasks import get_task
from daca.tasks.prompts import prompt_texts
from daca.train.config import GenerationConfig
from daca.train.evaluation import evaluate
from daca.train.interrupts import Interrupted, StopSignals, signal_name
from daca.train.pretrain_config import PretrainConfig


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


def step_accuracy(task, completions: list[str], rows: list[dict]) -> float:
    """The fraction of the steps written in the completions' reasoning that are right
    (``Task.trace_steps``); 0 when no step is written."""
    right = [
        ok for c, row in zip(completions, rows, strict=True) for ok in task.trace_steps(c, row)
    ]
    return sum(right) / len(right) if right else 0.0


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
    """Train, save the model folder to ``cfg.out`` and return the summary (also in daca.json).

    An ``out`` that holds a model is replaced only when it is the model continued
    (``init_from``): a new model never overwrites an earlier one (FileExistsError)."""
    _check_out(cfg)
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
    warmup = max(1, cfg.warmup_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup))
    history: list[dict] = list(prior["history"])
    offset = int(prior["steps_trained"])  # steps of the model this run continues

    def held_out(step: int) -> dict:
        metrics = {"step": offset + step}
        for n in names:
            result = evaluate(bundle, tasks[n], test[n], gen, batch_size=200)
            metrics[n] = result.mean
            if tasks[n].trace_steps is not None:  # how often the written steps are right
                metrics[f"{n} steps"] = step_accuracy(tasks[n], result.completions, test[n])
        if history and history[-1]["step"] == metrics["step"]:
            history.pop()  # the continued model's last evaluation, measured again
        history.append(metrics)
        return metrics

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, desc="pretrain", unit="step")
    start = time.time()
    stop = StopSignals("saving the model at the end of this step")
    with stop:
        metrics = held_out(0)
        log(f"pretraining {cfg.task} from step {offset}: Ctrl-C saves the model and stops")
        step = 0
        index: list[int] = []
        while step < cfg.max_steps and not stop.requested:
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
            if cfg.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            schedule.step()
            model.eval()
            step += 1
            if step % cfg.eval_every == 0 or step == cfg.max_steps:
                metrics = held_out(step)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(
                    loss=f"{loss.item():.3f}",
                    **{k: f"{v:.3f}" for k, v in metrics.items() if k != "step"},
                )
        if bar is not None:
            bar.close()
        interrupted = stop.signum
        if interrupted is None and history[-1]["step"] != offset + step:
            metrics = held_out(step)
        final = {k: v for k, v in metrics.items() if k != "step"}
        for n in cfg.also_eval if interrupted is None else ():
            # e.g. countdown-public: the public distribution of the task
            rows = get_task(n).load(split="test", limit=cfg.eval_size, seed=cfg.seed)
            final[n] = evaluate(bundle, get_task(n), rows, gen, batch_size=200).mean
        summary = {
            "generation": asdict(gen),
            "pretrain": asdict(cfg),
            "steps_trained": offset + step,
            "seconds": round(prior["seconds"] + time.time() - start, 1),
            "parameters": sum(p.numel() for p in model.parameters()),
            "held_out": final,
            "held_out_step": history[-1]["step"],
            "eval_size": cfg.eval_size,
            "history": history,
        }
        out = _save_atomically(cfg.out, model, tokenizer, summary)
    summary = {"family": "llada", "prompt_format": "compact", **summary}
    log(f"saved {out} after {step} steps: " + ", ".join(f"{n} {v:.3f}" for n, v in final.items()))
    if interrupted is not None:
        folder = shlex.quote(str(out))
        raise Interrupted(
            interrupted,
            f"stopped by {signal_name(interrupted)} after {offset + step} steps (model saved to "
            f"{out}, held-out metric of step {history[-1]['step']}); continue with: daca pretrain "
            f"--init-from {folder} --out {folder} (and the other flags you gave)",
        )
    return summary


def _check_out(cfg: PretrainConfig) -> None:
    from pathlib import Path

    out = Path(cfg.out)
    continued = cfg.init_from is not None and Path(cfg.init_from).resolve() == out.resolve()
    if (out / "daca.json").is_file() and not continued:
        raise FileExistsError(
            f"--out {out} already holds a model; choose another --out, or continue that model "
            f"with --init-from {out} --out {out}"
        )


def _save_atomically(folder, model, tokenizer, summary: dict):
    """``save_tiny`` into a temporary folder renamed into place: an interrupted save leaves the
    earlier model (``--init-from`` may name this very folder) or the new one, never a mix."""
    from pathlib import Path

    folder = Path(folder)
    tmp, old = folder.with_name(folder.name + ".tmp"), folder.with_name(folder.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    save_tiny(tmp, model, tokenizer, **summary)
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old)
    else:
        os.replace(tmp, folder)
    return folder
