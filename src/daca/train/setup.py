"""The start of a run, before any step: a writable output folder, the task's rows, prompts that
fit the model, a working sandbox for code tasks, and the model (4-bit, gradient checkpointing,
LoRA as configured). Every problem found here is an ``InputError`` naming what to change."""

from __future__ import annotations

from dataclasses import asdict

import torch

from daca.models.loading import LoadedModel, ModelFolderError, load, load_4bit
from daca.models.prompts import fit_prompts, prompt_token_ids
from daca.tasks import sandbox
from daca.tasks.formats import DataUnavailable
from daca.tasks.prompts import prompt_texts
from daca.train.checkpointing import write_text_atomically, yaml_text
from daca.train.config import to_dict
from daca.train.errors import InputError
from daca.train.seeds import adapter_seed


class SetupSteps:
    """The setup part of ``Trainer`` (a mixin: it reads the trainer's ``cfg``, ``acc``,
    ``run_dir``, ``task``, ``train_rows``, ``eval_rows``, ``bundle`` and ``prompt_limit``)."""

    def _preflight(self, resume: bool) -> None:
        """Find an unwritable output folder before any model is loaded (a real write)."""
        failed = None
        if self.acc.is_main_process:
            probe = self.run_dir / ".write-test"
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                probe.write_bytes(b"x" * 4096)
                probe.unlink()
            except OSError as e:
                failed = InputError(
                    f"cannot write to the output folder {self.run_dir} "
                    f"({e.strerror or e}); set output_dir=... to a writable folder with free "
                    f"space (or fix its permissions)"
                )
            if failed is None and not resume and (self.run_dir / "metrics.jsonl").exists():
                # through the check below: every rank raises, none waits in a collective
                failed = FileExistsError(
                    f"{self.run_dir} already holds a run; resume it with "
                    f"`daca train --resume {self.run_dir}` or choose another name=..."
                )
            if failed is None:
                write_text_atomically(self.run_dir / "config.yaml", yaml_text(to_dict(self.cfg)))
        if self._anywhere(failed is not None):
            raise failed or InputError(f"the main process cannot write to {self.run_dir}")

    def _check_sandbox(self) -> None:
        """A task that runs model-written code stops here, before any model loads, when no
        working isolation exists and unsafe execution was not asked for (``sandbox: unsafe``)."""
        if not self.task.executes_code:
            return
        if self.cfg.sandbox == "unsafe":
            sandbox.allow_unsafe_execution()
        try:
            sandbox.isolation_available()
        except sandbox.SandboxUnavailable as e:
            raise InputError(f"task={self.cfg.task}: {e}") from None

    def _load_rows(self, split: str, path: str | None, limit: int) -> list[dict]:
        """The task's rows; a bad file is an InputError naming it (the loaders name the line)."""
        try:
            rows = self.task.load(split=split, path=path, limit=limit, seed=self.cfg.seed)
        except DataUnavailable as e:
            key = "data_file" if split == "train" else "eval_file"
            raise InputError(f"{self._source(split)}: {e.reason}; set {key}=FILE") from None
        except (ValueError, OSError, KeyError) as e:
            raise InputError(f"cannot read {self._source(split)}: {e}") from None
        if not rows:
            raise InputError(f"{self._source(split)} holds no rows")
        return rows

    def _source(self, split: str) -> str:
        """Where a split's rows come from, in the config's words."""
        key, path = (
            ("data_file", self.cfg.data_file)
            if split == "train"
            else ("eval_file", self.cfg.eval_file)
        )
        return f"{key}={path}" if path else f"task {self.cfg.task}'s {split} split"

    def _check_prompts(self) -> None:
        """Every prompt fits the model, or (truncate_prompts) how many will be cut is said."""
        if self.prompt_limit is None:
            return
        cut = []
        for split, rows in (("train", self.train_rows), ("test", self.eval_rows)):
            try:
                texts = prompt_texts(self.bundle, self.task, rows)
            except ValueError as e:
                raise InputError(f"task={self.cfg.task} with model={self.cfg.model}: {e}") from None
            ids = prompt_token_ids(self.bundle, texts)
            try:
                _, n = fit_prompts(
                    ids, self.prompt_limit, truncate=self.cfg.truncate_prompts, texts=texts
                )
            except ValueError as e:
                raise InputError(f"{self._source(split)}: {e}") from None
            cut.append((n, len(rows), split))
        if any(n for n, _, _ in cut) and self.acc.is_main_process:
            counts = " and ".join(f"{n} of {total} {split}" for n, total, split in cut)
            limit = self.prompt_limit
            print(f"truncate_prompts: {counts} prompts keep only their last {limit} tokens")

    def _load_model(self) -> LoadedModel:
        cfg = self.cfg
        dtype = torch.bfloat16 if cfg.bf16 else None
        if cfg.load_in_4bit:
            from daca.models.quant import prepare_for_training

            bundle = load_4bit(cfg.model, device=self.acc.device, dtype=dtype or torch.float32)
            bundle.model = prepare_for_training(bundle.model)
        else:
            try:
                bundle = load(cfg.model, device=self.acc.device, dtype=dtype)
            except ModelFolderError as e:  # a folder daca refuses: one line, exit 2
                raise InputError(f"model={cfg.model}: {e}") from None
        bundle.meta["generation"] = asdict(cfg.generation)  # checkpoints evaluate with these
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
            with torch.random.fork_rng(devices=[]):  # the adapter's initial A: seeded
                torch.manual_seed(adapter_seed(cfg.seed))
                bundle.model = get_peft_model(bundle.model, lcfg)
        bundle.model.train()
        return bundle
