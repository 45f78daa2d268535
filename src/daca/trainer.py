"""The GRPO trainer for masked diffusion LMs: three base methods with the DACA plug-in.

One step = one rollout of ``per_device_train_batch_size × gradient_accumulation_steps``
completions per process, scored and turned into group advantages (and DPS multipliers),
then ``num_iterations`` (μ) optimizer updates on it, each accumulating gradients over the
micro-batches. Every random draw comes from a generator seeded by (seed, step, rank, ...), so
a run resumed from a checkpoint continues exactly. METHOD.md §4 is the law.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from daca import dps, likelihood, objectives
from daca.checkpoint import latest_checkpoint, write_atomically
from daca.config import TrainConfig, to_dict, validate
from daca.evaluation import evaluate, rollout
from daca.models.loading import LoadedModel, load
from daca.models.prompts import completion_mask, prompt_texts
from daca.rewards import score_rewards
from daca.tasks import get_task


def _seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across runs and processes)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def _gen(device, *parts: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(_seed(*parts))


@dataclass
class RolloutBatch:
    """One micro-batch of completions with what the updates need."""

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    rewards: Tensor
    advantages: Tensor
    multipliers: Tensor | None
    old_logp: list[Tensor] = field(default_factory=list)  # one per inner iteration
    ref_logp: list[Tensor] = field(default_factory=list)


class Trainer:
    """``Trainer(config).train()`` runs the configured RL job; ``daca train`` calls it."""

    def __init__(self, config: TrainConfig, *, resume: bool = False, progress: bool = True):
        from accelerate import Accelerator
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.cfg = config
        cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
        # One scheduler step per optimizer step (accelerate's default steps it once per
        # process); accumulate() skips the all-reduce (and DeepSpeed's step) between micro-batches.
        self.acc = Accelerator(
            cpu=cpu,
            mixed_precision="bf16" if config.bf16 else "no",
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            step_scheduler_with_optimizer=False,
        )
        validate(config, self.acc.num_processes)
        self.rank, self.world = self.acc.process_index, self.acc.num_processes
        self.run_dir = Path(config.output_dir) / config.name
        self.progress = progress and self.acc.is_main_process
        self._preflight(resume)

        self.task = get_task(config.task)
        self.bundle = self._load_model()
        self.train_rows = self.task.load(
            split="train", path=config.data_file, limit=config.train_size, seed=config.seed
        )
        self.eval_rows = self.task.load(
            split="test", path=config.eval_file, limit=config.eval_size, seed=config.seed
        )
        if not self.train_rows:
            raise ValueError(f"task {config.task}: no training rows")
        self.ref_model = None
        if config.beta > 0 and not config.lora.enabled:
            self.ref_model = copy.deepcopy(self.bundle.model).eval().requires_grad_(False)

        params = [p for p in self.bundle.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.weight_decay,
        )
        warm = max(1, config.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm)
        )
        if self.acc.state.deepspeed_plugin is not None:
            # No dataloader to infer these from; DeepSpeed clips gradients itself.
            ds = self.acc.state.deepspeed_plugin.deepspeed_config
            ds["train_micro_batch_size_per_gpu"] = config.per_device_train_batch_size
            ds["gradient_clipping"] = config.max_grad_norm
        self.model, self.optimizer, self.scheduler = self.acc.prepare(
            self.bundle.model, self.optimizer, self.scheduler
        )
        self._perm_epoch, self._perm = -1, []
        self.step = 0
        self.history: list[dict] = []
        self.evals: list[dict] = []
        if resume:
            self._resume()

    # ----------------------------------------------------------------- setup
    def _preflight(self, resume: bool) -> None:
        """Find an unwritable output folder before any model is loaded."""
        if self.acc.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / ".write-test"
            try:
                probe.write_bytes(b"x" * 4096)
                probe.unlink()
            except OSError as e:
                raise OSError(f"cannot write to the output folder {self.run_dir}: {e}") from e
            if not resume and (self.run_dir / "metrics.jsonl").exists():
                raise FileExistsError(
                    f"{self.run_dir} already holds a run; resume it with "
                    f"`daca train --resume {self.run_dir}` or choose another name=..."
                )
            (self.run_dir / "config.yaml").write_text(_yaml(to_dict(self.cfg)))
        self.acc.wait_for_everyone()

    def _load_model(self) -> LoadedModel:
        cfg = self.cfg
        dtype = torch.bfloat16 if cfg.bf16 else None
        if cfg.load_in_4bit:
            from daca.models.quant import load_4bit

            bundle = load_4bit(cfg.model, device=self.acc.device)
        else:
            bundle = load(cfg.model, device=self.acc.device, dtype=dtype)
        if cfg.gradient_checkpointing:
            from daca.models.families import enable_gradient_checkpointing

            enable_gradient_checkpointing(bundle.model)
        if cfg.lora.enabled:
            from peft import LoraConfig, get_peft_model

            from daca.models.families import lora_targets

            lcfg = LoraConfig(
                r=cfg.lora.r,
                lora_alpha=cfg.lora.alpha,
                lora_dropout=cfg.lora.dropout,
                target_modules=cfg.lora.target_modules or lora_targets(bundle),
            )
            bundle.model = get_peft_model(bundle.model, lcfg)
        bundle.model.train()
        return bundle

    # ----------------------------------------------------------------- data
    def _prompts_for(self, step: int, micro: int) -> list[dict]:
        """This rank's prompts of one micro-batch: a seeded permutation per epoch, cut in
        consecutive global batches, each split across ranks (so the position in the data
        follows from the step alone, and a resumed run reads the same prompts)."""
        cfg = self.cfg
        per_rank = cfg.per_device_train_batch_size // cfg.num_generations
        n = len(self.train_rows)
        start = (step * cfg.gradient_accumulation_steps + micro) * per_rank * self.world
        start += self.rank * per_rank
        rows = []
        for i in range(start, start + per_rank):
            epoch, pos = divmod(i, n)
            rows.append(self.train_rows[self._permutation(epoch)[pos]])
        return rows

    def _permutation(self, epoch: int) -> list[int]:
        if self._perm_epoch != epoch:
            perm = list(range(len(self.train_rows)))
            random.Random(_seed(self.cfg.seed, epoch)).shuffle(perm)
            self._perm_epoch, self._perm = epoch, perm
        return self._perm

    # ----------------------------------------------------------------- estimators
    def _token_logp(self, model, batch: RolloutBatch, seed: int) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs for the ratio (or wd1's likelihood) and wd1's SML term."""
        cfg, device = self.cfg, batch.prompt_ids.device
        common = dict(mask_id=self.bundle.mask_id, attention_mask=batch.prompt_mask)
        args = (model, batch.prompt_ids, batch.completion_ids)
        if cfg.method == "gdpo":
            base = likelihood.elbo_token_terms(
                *args, quadrature=cfg.quadrature, generator=_gen(device, seed, 1), **common
            )
        else:
            base = likelihood.mean_field_logp(
                *args, p_mask_prompt=cfg.p_mask_prompt, generator=_gen(device, seed, 1), **common
            )
        if not cfg.sml.enabled:
            return base, None
        sml = likelihood.stratified_logp(
            *args,
            num_strata=cfg.sml.num_strata,
            strata=cfg.sml.strata,
            generator=_gen(device, seed, 2),
            **common,
        )
        if cfg.method == "wd1":
            return base, sml
        return objectives.sml_enriched(base, sml), None

    @contextlib.contextmanager
    def _reference(self):
        """The reference policy: the adapter-disabled base under LoRA, else a frozen copy."""
        if self.ref_model is not None:
            yield self.ref_model
        else:
            with self.acc.unwrap_model(self.model).disable_adapter():
                yield self.model

    # ----------------------------------------------------------------- one step
    def _make_rollout(self, step: int, micro: int) -> tuple[RolloutBatch, dict]:
        cfg, G = self.cfg, self.cfg.num_generations
        rows = [r for r in self._prompts_for(step, micro) for _ in range(G)]
        model = self.acc.unwrap_model(self.model)
        model.eval()
        t0 = time.perf_counter()
        with torch.no_grad():
            texts, out, prompt_mask = rollout(
                self.bundle_for(model),
                self.task,
                rows,
                cfg.generation,
                generator=_gen(self.acc.device, cfg.seed, step, micro, self.rank, 7),
                dps_stride=cfg.dps.stride if cfg.dps.enabled else None,
                dps_scope=cfg.dps.scope,
            )
        model.train()
        t1 = time.perf_counter()
        columns = {c: [r.get(c) for r in rows] for c in self.task.columns}
        prompts = prompt_texts(self.bundle, self.task, rows)
        per_func, rewards, errors = score_rewards(
            self.task.reward_funcs,
            self.task.reward_weights,
            prompts,
            texts,
            columns,
            on_error=cfg.on_reward_error,
        )
        t2 = time.perf_counter()
        device = self.acc.device
        rewards = rewards.to(device)
        adv = objectives.group_advantages(rewards, G, scale=cfg.scale_rewards)
        stats = {
            "reward": rewards.mean().item(),
            "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "advantage_abs": adv.abs().mean().item(),
            "reward_errors": errors,
            "time_rollout": t1 - t0,
            "time_reward": t2 - t1,
        }
        for f, func in enumerate(self.task.reward_funcs):
            stats[f"reward/{getattr(func, '__name__', f)}"] = per_func[:, f].mean().item()
        multipliers, normed = None, None
        if cfg.dps.enabled:
            multipliers, normed, dstats = self._dps_multipliers(out)
            stats.update(dstats)
        every = cfg.save_rollouts_every
        if micro == 0 and every and (step + 1) % every == 0 and self.acc.is_main_process:
            self._record_rollout(
                step + 1, prompts[:G], out, rewards[:G], adv[:G], multipliers, normed
            )
        batch = RolloutBatch(
            prompt_ids=out.sequences[:, : out.prompt_length],
            prompt_mask=prompt_mask,
            completion_ids=out.completion_ids,
            completion_mask=completion_mask(self.bundle, out.completion_ids),
            rewards=rewards,
            advantages=adv,
            multipliers=multipliers,
        )
        return batch, stats

    def bundle_for(self, model) -> LoadedModel:
        b = copy.copy(self.bundle)
        b.model = model
        return b

    def _dps_multipliers(self, out) -> tuple[Tensor, Tensor, dict]:
        """δ from the trace, z-scored with the global batch's statistics (METHOD.md §2)."""
        cfg = self.cfg.dps
        deltas = dps.progress_deltas(
            out.progress_logp,
            out.progress_mask,
            cfg.last_step,
            last_logp=out.last_logp,
            last_mask=out.last_mask,
            recorded_steps=out.recorded_steps,
            num_steps=out.num_steps,
        )
        local = deltas.shape[0]
        everything = self.acc.gather(deltas.contiguous()) if self.world > 1 else deltas
        normed = dps.normalize(everything, axis=cfg.norm_axis)
        normed = normed[self.rank * local : (self.rank + 1) * local]
        mult = dps.token_multipliers(
            normed, out.birth_step, out.recorded_steps, cfg.lam, clamp_min=cfg.clamp_min
        )
        stats = {
            "dps/delta_mean": everything.mean().item(),
            "dps/delta_std": everything.std().item() if everything.numel() > 1 else 0.0,
            "dps/multiplier_min": mult.min().item(),
            "dps/multiplier_max": mult.max().item(),
            "dps/multiplier_std": mult.std().item(),
        }
        return mult, normed, stats

    def _record_rollout(self, step, prompts, out, rewards, adv, multipliers, normed) -> None:
        """The first group of this step's rollout, for ``daca inspect``."""
        G = len(prompts)
        tok = self.bundle.tokenizer
        record = {
            "step": step,
            "task": self.cfg.task,
            "method": self.cfg.method,
            "lam": self.cfg.dps.lam if self.cfg.dps.enabled else 0.0,
            "prompts": prompts,
            "tokens": [tok.convert_ids_to_tokens(r) for r in out.completion_ids[:G].tolist()],
            "birth_step": out.birth_step[:G].tolist(),
            "num_steps": out.num_steps,
            "rewards": rewards.tolist(),
            "advantages": adv.tolist(),
        }
        if multipliers is not None:
            record["recorded_steps"] = out.recorded_steps.tolist()
            record["multipliers"] = multipliers[:G].tolist()
            record["norm_deltas"] = normed[:G].tolist()
        folder = self.run_dir / "rollouts"
        folder.mkdir(exist_ok=True)
        tmp = folder / f"step-{step:07d}.json.tmp"
        tmp.write_text(json.dumps(record))
        tmp.replace(folder / f"step-{step:07d}.json")

    def _loss(self, batch: RolloutBatch, it: int, seed: int) -> tuple[Tensor, dict]:
        cfg = self.cfg
        logp, sml = self._token_logp(self.model, batch, seed)
        mask = batch.completion_mask
        if cfg.method == "wd1":
            return objectives.wd1_loss(
                logp,
                batch.advantages,
                mask,
                num_generations=cfg.num_generations,
                psi=cfg.psi,
                token_multipliers=batch.multipliers,
                sml_logp=sml,
                eta=cfg.sml.eta if cfg.sml.enabled else 0.0,
            )
        old = batch.old_logp[it] if batch.old_logp else logp.detach()
        ref = batch.ref_logp[it] if batch.ref_logp else None
        if cfg.method == "diffu_grpo":
            return objectives.diffu_grpo_loss(
                logp,
                old,
                batch.advantages,
                mask,
                epsilon=cfg.epsilon,
                beta=cfg.beta,
                ref_logp=ref,
                token_multipliers=batch.multipliers,
            )
        return objectives.gdpo_loss(
            logp,
            old,
            batch.advantages,
            mask,
            epsilon=cfg.epsilon,
            beta=cfg.beta,
            ref_token_terms=ref,
            token_multipliers=batch.multipliers,
        )

    def train_step(self) -> dict:
        cfg, step = self.cfg, self.step
        gas, mu = cfg.gradient_accumulation_steps, cfg.num_iterations
        # accelerate keeps this in a process-wide singleton: another Trainer may have changed it.
        self.acc.gradient_accumulation_steps = gas
        batches, stats_list = [], []
        for micro in range(gas):
            batch, stats = self._make_rollout(step, micro)
            batches.append(batch)
            stats_list.append(stats)
        t0 = time.perf_counter()
        seeds = [
            [_seed(cfg.seed, step, m, it, self.rank, 11) for it in range(mu)] for m in range(gas)
        ]
        if cfg.method != "wd1":
            # Old and reference log-probs once per rollout, with the μ iterations' mask seeds.
            with torch.no_grad():
                for m, batch in enumerate(batches):
                    if mu > 1:
                        batch.old_logp = [
                            self._token_logp(self.model, batch, s)[0] for s in seeds[m]
                        ]
                    if cfg.beta > 0:
                        with self._reference() as ref:
                            batch.ref_logp = [self._token_logp(ref, batch, s)[0] for s in seeds[m]]
        update_stats: list[dict] = []
        for it in range(mu):
            for m, batch in enumerate(batches):
                # accumulate() divides the loss by gas and syncs gradients on the last micro-batch.
                with self.acc.accumulate(self.model):
                    loss, metrics = self._loss(batch, it, seeds[m][it])
                    self.acc.backward(loss)
                metrics = {k: float(v) for k, v in metrics.items()}
                metrics["loss"] = loss.item()
                update_stats.append(metrics)
            grad_norm = self.acc.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        stats = _mean_dicts(stats_list)
        stats.update(_mean_dicts(update_stats))
        stats["grad_norm"] = float("nan") if grad_norm is None else float(grad_norm)
        stats["time_update"] = t1 - t0
        stats["lr"] = self.scheduler.get_last_lr()[0]
        if self.world > 1:
            stats = self._global_stats(stats)
        self.step += 1
        stats["step"] = self.step
        return stats

    def _global_stats(self, stats: dict) -> dict:
        """The step's numbers over all processes (every rank logs the same): the extreme of
        ``*_min``/``*_max`` and of times (the slowest rank), the mean of the rest (equal local
        batches, so the mean of means is the global mean)."""
        keys = sorted(stats)
        local = torch.tensor([[float(stats[k]) for k in keys]], dtype=torch.float64)
        every = self.acc.gather(local.to(self.acc.device)).cpu()  # [world, K]
        out = {}
        for i, k in enumerate(keys):
            col = every[:, i]
            if k.endswith("_min"):
                out[k] = col.min().item()
            elif k.endswith("_max") or k.startswith("time_"):
                out[k] = col.max().item()
            else:
                out[k] = col.mean().item()
        return out

    # ----------------------------------------------------------------- evaluation
    def evaluate(self) -> float:
        """Held-out metric at temperature 0, each rank scoring its share of the rows."""
        model = self.acc.unwrap_model(self.model)
        rows = self.eval_rows[self.rank :: self.world]
        # Pad to equal counts: a sharded model (FSDP) runs collectives in every forward.
        per_rank = -(-len(self.eval_rows) // self.world)
        res = evaluate(
            self.bundle_for(model),
            self.task,
            rows + self.eval_rows[: per_rank - len(rows)],
            self.cfg.generation,
            batch_size=self.cfg.eval_batch_size,
            temperature=0.0,
        )
        scores = res.scores[: len(rows)]
        total = torch.tensor([sum(scores), len(scores)], dtype=torch.float64)
        if self.world > 1:
            total = self.acc.reduce(total.to(self.acc.device), reduction="sum").cpu()
        return (total[0] / total[1]).item()

    # ----------------------------------------------------------------- checkpoints
    def save(self) -> None:
        rng = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
        }
        self.acc.wait_for_everyone()
        # Every rank takes part: a sharded model (FSDP) gathers its full weights here.
        weights = self.acc.get_state_dict(self.model)
        if self.acc.is_main_process:

            def write(folder: Path):
                model = self.acc.unwrap_model(self.model)
                model.save_pretrained(folder / "model", state_dict=weights)
                torch.save(
                    {
                        "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict(),
                        "step": self.step,
                        "history": self.history,
                        "evals": self.evals,
                    },
                    folder / "trainer_state.pt",
                )

            write_atomically(self.run_dir, self.step, write, keep=self.cfg.save_total_limit)
        # Each rank's RNG state beside the checkpoint (the run itself draws from seeded
        # generators; these restore anything that used the global RNG).
        self.acc.wait_for_everyone()
        latest = latest_checkpoint(self.run_dir)
        if latest is not None and latest[0] == self.step:
            torch.save(rng, latest[1] / f"rng_state_{self.rank}.pt")
        self.acc.wait_for_everyone()

    def _resume(self) -> None:
        found = latest_checkpoint(self.run_dir)
        if found is None:
            raise FileNotFoundError(f"{self.run_dir}: no complete checkpoint to resume from")
        step, folder = found
        state = torch.load(folder / "trainer_state.pt", weights_only=False)
        model = self.acc.unwrap_model(self.model)
        _load_weights(model, folder / "model")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.history, self.evals = state["step"], state["history"], state["evals"]
        rng_file = folder / f"rng_state_{self.rank}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=False)
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
        if self.acc.is_main_process:
            # metrics.jsonl may hold steps past the checkpoint: rewrite it from the state.
            _rewrite_jsonl(self.run_dir / "metrics.jsonl", self.history)

    # ----------------------------------------------------------------- the loop
    def train(self) -> dict:
        from daca.run_logging import RunLogger

        cfg = self.cfg
        logger = RunLogger(
            self.run_dir, cfg, enabled=self.acc.is_main_process, progress=self.progress
        )
        if not self.evals:
            self.evals.append({"step": 0, "held_out": self.evaluate()})
            logger.log_eval(self.evals[-1])
        start_step = self.step
        logger.start(total=cfg.max_steps, initial=start_step, held_out=self.evals[-1]["held_out"])
        try:
            while self.step < cfg.max_steps:
                stats = self.train_step()
                self.history.append(stats)
                logger.log_step(stats)
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.max_steps:
                    self.evals.append({"step": self.step, "held_out": self.evaluate()})
                    logger.log_eval(self.evals[-1])
                if self.step % cfg.save_every == 0 and self.step < cfg.max_steps:
                    self.save()
            if self.evals[-1]["step"] != self.step:
                self.evals.append({"step": self.step, "held_out": self.evaluate()})
                logger.log_eval(self.evals[-1])
            self.save()
        finally:
            logger.close()
        summary = {
            "run_dir": str(self.run_dir),
            "steps": self.step,
            "held_out_before": self.evals[0]["held_out"],
            "held_out_after": self.evals[-1]["held_out"],
            "task": cfg.task,
            "method": cfg.method,
        }
        if self.acc.is_main_process:
            logger.finish(self.history, self.evals, summary)
        return summary


def _mean_dicts(dicts: list[dict]) -> dict:
    keys = {k for d in dicts for k in d}
    return {k: sum(d[k] for d in dicts if k in d) / sum(1 for d in dicts if k in d) for k in keys}


def _load_weights(model, folder: Path) -> None:
    """Load weights saved by ``save_pretrained`` (full model or PEFT adapter) in place."""
    from safetensors.torch import load_file

    adapter = folder / "adapter_model.safetensors"
    if adapter.is_file():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(adapter))
        return
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no weights")
    state = {}
    for f in files:
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied weights are saved once; anything else missing is an error.
    real_missing = [k for k in missing if "decoder" not in k and "lm_head" not in k]
    if real_missing or unexpected:
        raise RuntimeError(f"{folder}: missing {real_missing[:5]}, unexpected {unexpected[:5]}")


def _rewrite_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def _yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


def train(config: TrainConfig, *, resume: bool = False, progress: bool = True) -> dict:
    """Run ``config`` from a notebook or script; returns the summary."""
    return Trainer(config, resume=resume, progress=progress).train()
