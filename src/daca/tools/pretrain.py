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
from daca.tools.pretrain_config import PretrainConfig
from daca.train.config import GenerationConfig
from daca.train.evaluation import evaluate
from daca.train.interrupts import Interrupted, StopSignals, signal_name


def diffusion_noise(
    batch: int,
    length: int,
    *,
    generator: torch.Generator | None = None,
    device=None,
    block_length: int | None = None,
    block_noise: float = 0.0,
    hidden: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Which target positions to mask, and each one's loss weight: (masked [B, L] bool,
    weight [B, L]). LLaDA's SFT noise: one t ~ U(0, 1] per example, each position masked with
    probability t, weight 1/t.

    block_noise=p: a fraction p of the examples is noised as the semi-autoregressive sampler
    sees them instead: a random block k of ``block_length`` holds masks with probability t,
    the blocks before it are clean and those after it wholly masked (weight 1, as at t = 1).
    Without it, a reasoning step learns to copy the answer (visible at small t), which the
    sampler has not written yet when it decodes the reasoning.

    hidden [B, L] bool: positions always masked and left out of the loss (a curriculum that
    teaches the reasoning before the answer: ``answer_positions``)."""
    t = 1.0 - torch.rand(batch, 1, generator=generator, device=device)  # (0, 1]
    masked = torch.rand(batch, length, generator=generator, device=device) < t
    weight = masked / t
    if block_noise > 0:
        pick = torch.rand(batch, 1, generator=generator, device=device) < block_noise
        k = torch.randint(0, length // block_length, (batch, 1), generator=generator, device=device)
        block_of = (torch.arange(length, device=device) // block_length).unsqueeze(0)
        later, earlier = pick & (block_of > k), pick & (block_of < k)
        masked = (masked & ~earlier) | later
        weight = torch.where(later, 1.0, torch.where(earlier, 0.0, weight))
    if hidden is not None:
        masked, weight = masked | hidden, torch.where(hidden, 0.0, weight)
    return masked, weight


def masked_diffusion_loss(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor | None,
    target_ids: Tensor,
    *,
    mask_id: int,
    generator: torch.Generator | None = None,
    **noise,
) -> Tensor:
    """LLaDA's SFT loss: Σ_masked CE(o_n) / t, averaged over the batch's completion tokens
    (``noise``: the options of ``diffusion_noise``)."""
    b, length = target_ids.shape
    masked, weight = diffusion_noise(
        b, length, generator=generator, device=target_ids.device, **noise
    )
    noisy = torch.where(masked, torch.full_like(target_ids, mask_id), target_ids)
    ids = torch.cat([prompt_ids, noisy], dim=1)
    attn = full_attention_mask(prompt_mask, prompt_ids, length)
    logits = forward_logits(model, ids, attn, last=length)
    ce = F.cross_entropy(logits.transpose(1, 2), target_ids, reduction="none")
    return (ce * weight).sum() / (b * length)


def answer_positions(targets: Tensor, answer_id: int) -> Tensor:
    """[B, L] bool: each target's positions from its first ``answer_id`` token on (none where
    the token is absent)."""
    return (targets == answer_id).long().cumsum(dim=1) > 0


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
        ok
        for c, row in zip(completions, rows, strict=True)
        for _, _, ok in task.trace_steps(c, row)
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
    bundle, prior = _initial_model(cfg, names, tasks)
    gen = GenerationConfig(
        gen_length=cfg.gen_length, steps=cfg.steps, block_length=cfg.block_length, temperature=0.0
    )
    run = _Run(cfg, bundle, _encode(bundle, tasks, train, cfg.gen_length), prior)
    held_out = _HeldOut(bundle, tasks, test, gen, history=list(prior["history"]), offset=run.offset)
    start = time.time()
    stop = StopSignals("saving the model at the end of this step")
    with stop:
        metrics = held_out(0)
        log(f"pretraining {cfg.task} from step {run.offset}: Ctrl-C saves the model and stops")
        stop_task = cfg.stop_task if cfg.stop_task in names else names[0]
        step, metrics = _train_loop(
            cfg, run, held_out, metrics, stop, stop_task, deadline, progress
        )
        interrupted = stop.signum
        if interrupted is None and held_out.history[-1]["step"] != run.offset + step:
            metrics = held_out(step)
        final = {n: metrics[n] for n in names}
        steps_right = {n: metrics[f"{n} steps"] for n in names if f"{n} steps" in metrics}
        for n in cfg.also_eval if interrupted is None else ():
            # e.g. countdown-public: the public distribution of the task
            rows = get_task(n).load(split="test", limit=cfg.eval_size, seed=cfg.seed)
            final[n] = evaluate(bundle, get_task(n), rows, gen, batch_size=200).mean
        summary = {
            "generation": asdict(gen),
            "pretrain": asdict(cfg),
            "steps_trained": run.offset + step,
            "seconds": round(prior["seconds"] + time.time() - start, 1),
            "parameters": sum(p.numel() for p in bundle.model.parameters()),
            "held_out": final,
            # the reasoning's steps that are right (Task.trace_steps), tasks with a trace only
            "held_out_steps": steps_right,
            "held_out_step": held_out.history[-1]["step"],
            "eval_size": cfg.eval_size,
            "history": held_out.history,
        }
        out = _save_atomically(cfg.out, bundle.model, bundle.tokenizer, summary)
    summary = {"family": "llada", "prompt_format": "compact", **summary}
    scores = {**final, **{f"{n} steps": v for n, v in steps_right.items()}}
    log(f"saved {out} after {step} steps: " + ", ".join(f"{n} {v:.3f}" for n, v in scores.items()))
    if interrupted is not None:
        folder = shlex.quote(str(out))
        raise Interrupted(
            interrupted,
            f"stopped by {signal_name(interrupted)} after {run.offset + step} steps (model saved "
            f"to {out}, held-out metric of step {held_out.history[-1]['step']}); continue with: "
            f"daca pretrain --init-from {folder} --out {folder} (and the other flags you gave)",
        )
    return summary


def _initial_model(cfg: PretrainConfig, names: list[str], tasks: dict) -> tuple[LoadedModel, dict]:
    """The model to train, and what it was trained on before (``init_from``: its steps, seconds
    and evaluations; a new tiny model of the tasks' compact vocabulary: none)."""
    prior = {"steps_trained": 0, "seconds": 0.0, "history": []}
    if cfg.init_from:
        from daca.models.loading import load

        bundle = load(cfg.init_from)
        prior.update({k: v for k, v in bundle.meta.items() if k in prior})
        return bundle, prior
    model, tokenizer = new_tiny(
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_positions=max(128, 32 + cfg.gen_length),  # a compact prompt is under 32 tokens
        seed=cfg.seed,
        words=tuple(w for n in names for w in tasks[n].compact_vocabulary),
    )
    return _bundle(model, tokenizer), prior


def _encode(bundle: LoadedModel, tasks: dict, train: dict, gen_length: int):
    """Every training example, encoded once: prompt ids, prompt mask, target ids."""
    data = []
    for n, rows in train.items():
        p_ids, p_mask = encode_prompts(bundle, prompt_texts(bundle, tasks[n], rows))
        targets = encode_targets(bundle, supervised_targets(tasks[n], rows), gen_length)
        data.append((p_ids, p_mask, targets))
    return tuple(torch.cat([d[i] for d in data]) for i in range(3))


class _Run:
    """The optimisation: AdamW with a linear warm-up, batches in a seeded shuffled order, the
    loss's masks from a seeded generator, the gradient optionally clipped."""

    def __init__(self, cfg: PretrainConfig, bundle: LoadedModel, data, prior: dict):
        self.cfg, self.bundle, self.model = cfg, bundle, bundle.model
        self.p_ids, self.p_mask, self.targets = data
        self.hidden = None  # the answer's positions, while hide_answer_steps lasts
        if cfg.hide_answer_steps:
            answer_id = bundle.tokenizer.convert_tokens_to_ids("<answer>")
            if answer_id == bundle.tokenizer.unk_token_id:
                raise ValueError(
                    f"hide_answer_steps: {cfg.task}'s completions have no <answer> tag"
                )
            self.hidden = answer_positions(self.targets, answer_id)
        self.steps_taken = 0
        self.gen_torch = torch.Generator().manual_seed(cfg.seed)
        self.order_rng = random.Random(cfg.seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.learning_rate)
        warmup = max(1, cfg.warmup_steps)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda i: min(1.0, (i + 1) / warmup)
        )
        self.offset = int(prior["steps_trained"])  # steps of the model this run continues
        self.index: list[int] = []

    def next_batch(self) -> list[int]:
        """The next ``batch_size`` examples of the shuffled order (reshuffled when it runs out)."""
        size = self.cfg.batch_size
        if len(self.index) < size:
            perm = list(range(len(self.targets)))
            self.order_rng.shuffle(perm)
            self.index += perm
        batch, self.index = self.index[:size], self.index[size:]
        return batch

    def step(self) -> Tensor:
        """One optimizer step on the next batch; returns its loss."""
        batch, model = self.next_batch(), self.model
        model.train()
        loss = masked_diffusion_loss(
            model,
            self.p_ids[batch],
            self.p_mask[batch],
            self.targets[batch],
            mask_id=self.bundle.mask_id,
            generator=self.gen_torch,
            block_length=self.cfg.block_length,
            block_noise=self.cfg.block_noise,
            hidden=self._hidden(batch),
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.schedule.step()
        model.eval()
        self.steps_taken += 1
        return loss

    def _hidden(self, batch: list[int]) -> Tensor | None:
        if self.hidden is None or self.steps_taken >= self.cfg.hide_answer_steps:
            return None
        return self.hidden[batch]


class _HeldOut:
    """The held-out metric of every task (and the step accuracy of trace tasks), appended to
    ``history`` at the continued model's step count."""

    def __init__(self, bundle, tasks, test, gen, *, history: list[dict], offset: int):
        self.bundle, self.tasks, self.test, self.gen = bundle, tasks, test, gen
        self.history, self.offset = history, offset

    def __call__(self, step: int) -> dict:
        metrics = {"step": self.offset + step}
        for n, task in self.tasks.items():
            result = evaluate(self.bundle, task, self.test[n], self.gen, batch_size=200)
            metrics[n] = result.mean
            if task.trace_steps is not None:  # how often the written steps are right
                metrics[f"{n} steps"] = step_accuracy(task, result.completions, self.test[n])
        if self.history and self.history[-1]["step"] == metrics["step"]:
            self.history.pop()  # the continued model's last evaluation, measured again
        self.history.append(metrics)
        return metrics


def _train_loop(cfg, run: _Run, held_out: _HeldOut, metrics, stop, stop_task, deadline, progress):
    """Steps until ``max_steps``, the stopping task's target, the deadline or a stop signal,
    evaluating every ``eval_every`` steps and after the last; returns (steps, last metrics)."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, desc="pretrain", unit="step")
    step = 0
    while step < cfg.max_steps and not stop.requested:
        if cfg.target_accuracy is not None and metrics[stop_task] >= cfg.target_accuracy:
            break
        if deadline is not None and time.time() > deadline:
            break
        loss = run.step()
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
    return step, metrics


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
