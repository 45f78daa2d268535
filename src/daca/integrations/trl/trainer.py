"""``DACAGRPOTrainer``: TRL's ``GRPOTrainer`` computing every micro-batch as ``daca train``
computes it (the package docstring, docs/trl.md)."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch
from torch import Tensor
from transformers import GenerationConfig
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing, unwrap_model_for_generation
from trl.trainer.utils import is_async_callable, use_adapter

from daca.core.objectives import group_advantages
from daca.core.sampler import Rollout
from daca.integrations.trl.config import DACAGRPOConfig
from daca.models.loading import LoadedModel, load, write_meta
from daca.models.prompts import left_pad as left_pad_lists
from daca.models.prompts import pad_for_model, up_to_eos
from daca.train.methods import METHODS
from daca.train.rollout import RolloutBatch, dps_multipliers, sample_micro_batch
from daca.train.seeds import step_mask_seeds
from daca.train.update import micro_batch_loss, old_and_reference


def left_pad(ids: list[list[int]], width: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """Prompts (lists of real tokens) left padded to exactly ``width``: ids [B, width] long,
    attention mask [B, width] long (``daca.models.prompts.left_pad``)."""
    if any(len(row) > width for row in ids):
        raise ValueError(f"a prompt has more than prompt_width={width} tokens")
    return left_pad_lists(ids, width, pad_id)


def with_prompt_column(reward_func):
    """``reward_func`` also given the dataset's ``prompt`` column as ``prompt=``.

    TRL passes every column to reward functions but ``prompt``, which comes only as ``prompts``;
    daca's tasks read their columns by name (HumanEval's reward needs ``prompt``).
    """
    if isinstance(reward_func, torch.nn.Module):
        return reward_func
    if is_async_callable(reward_func):

        @functools.wraps(reward_func)
        async def call_async(*args, prompts, **kwargs):
            kwargs.setdefault("prompt", prompts)
            return await reward_func(*args, prompts=prompts, **kwargs)

        return call_async

    @functools.wraps(reward_func)
    def call(*args, prompts, **kwargs):
        kwargs.setdefault("prompt", prompts)
        return reward_func(*args, prompts=prompts, **kwargs)

    return call


@contextlib.contextmanager
def _reference_through_daca():
    """TRL builds the reference policy (``beta > 0`` without PEFT) by loading the policy's path
    again through transformers' Auto classes, which know neither LLaDA's nor Dream's config;
    while the trainer is built, that loader is ``daca.models.load`` (TRL is pinned exactly)."""
    from trl.trainer import grpo_trainer

    original = grpo_trainer.create_model_from_path

    def create_model_from_path(model_id: str, **kwargs):
        if not model_id:
            raise ValueError(
                "beta > 0 without PEFT needs a reference policy, which TRL loads from the "
                "policy's folder; this model was not loaded from one: pass a name or folder, "
                "a daca.models.load result, use PEFT, or set beta=0"
            )
        dtype = kwargs.get("dtype")
        dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
        return load(
            model_id,
            dtype=dtype if isinstance(dtype, torch.dtype) else None,
            quantization_config=kwargs.get("quantization_config"),
        ).model

    grpo_trainer.create_model_from_path = create_model_from_path
    try:
        yield
    finally:
        grpo_trainer.create_model_from_path = original


class DACAGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` for masked diffusion LMs with DACA (the package docstring).

    ``model``: a ``daca.models.load`` result, or a name or path for it ("tiny" is the shipped
    model), which also supplies the tokenizer, mask id, end-of-sequence ids and prompt width;
    or a masked LM module (then pass ``processing_class``). ``args``: a ``DACAGRPOConfig`` with
    its ``method``. Tools, environments and ``rollout_func`` (TRL features for autoregressive
    models) are refused.
    """

    def __init__(self, model, reward_funcs=None, args: DACAGRPOConfig | None = None, **kwargs):
        if not isinstance(args, DACAGRPOConfig):
            raise TypeError(f"args must be a DACAGRPOConfig(method=...), got {type(args).__name__}")
        for name in ("tools", "rollout_func", "environment_factory"):
            if kwargs.get(name):
                raise ValueError(f"DACAGRPOTrainer does not support {name}")
        mask_id, prompt_width, self._daca_bundle = args.mask_id, args.prompt_width, None
        if isinstance(model, str):
            model = load(model)
        if isinstance(model, LoadedModel):
            bundle, model = model, model.model
            kwargs.setdefault("processing_class", bundle.tokenizer)
            mask_id = bundle.mask_id if mask_id is None else mask_id
            prompt_width = bundle.prompt_width if prompt_width is None else prompt_width
            eos_ids = list(bundle.eos_ids)
            bundle.prompt_width = prompt_width  # saved checkpoints load back with this width
            self._daca_bundle = bundle
        else:
            tok = kwargs.get("processing_class")
            eos_ids = [] if tok is None or tok.eos_token_id is None else [tok.eos_token_id]
        if getattr(model, "generation_config", None) is None:
            # TRL reads pad and end-of-sequence ids there; masked LMs have no generation config.
            model.generation_config = GenerationConfig(eos_token_id=eos_ids or None)
        with _reference_through_daca():
            super().__init__(model, reward_funcs, args, **kwargs)
        self.reward_funcs = [with_prompt_column(f) for f in self.reward_funcs]
        self.mask_id = self._tokenizer.mask_token_id if mask_id is None else mask_id
        if self.mask_id is None:
            raise ValueError("no mask token id: set DACAGRPOConfig.mask_id")
        self.prompt_width = prompt_width
        # The registry entry and the daca train config it computes with.
        self.daca_method = METHODS[args.method]
        self.daca_cfg = args.train_config()
        self._rewards_per_func: Tensor | None = None  # every process's, of the latest rollout
        # The latest daca.Rollouts of this process, one per micro-batch (for inspection), with
        # their prompts' attention masks; last_rollout is the last of them.
        self.last_rollouts: list[Rollout] = []
        self.last_rollout = None
        self._prompt_masks: list[Tensor] = []
        # The running rollout's micro-batches and their mask seeds, [micro-batch][iteration]:
        # TRL's split of its generation batch only counts the micro-steps (``_compute_loss``).
        self._batches: list[RolloutBatch] = []
        self._seeds: list[list[int]] = []

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """TRL's save (a native family's ``save_pretrained`` writes its hub layout), plus the
        ``daca.json`` that ``daca.models.load`` reads (prompt format and width, LoRA base)."""
        super()._save(output_dir, state_dict)
        if self._daca_bundle is not None and self.args.should_save:
            folder = Path(output_dir if output_dir is not None else self.args.output_dir)
            write_meta(self._daca_bundle, folder, self.accelerator.unwrap_model(self.model))

    # ----------------------------------------------------------------- the rollout
    def _micro_batches(self, n: int) -> list[tuple[int, slice]]:
        """(index, rows) of each micro-batch of a generation batch of ``n`` rows, in order:
        ``per_device_train_batch_size`` rows each in training; in evaluation one, of index -1,
        so that its seeds never repeat a training rollout's."""
        if not self.model.training:
            return [(-1, slice(0, n))]
        size = self.args.per_device_train_batch_size
        return [(m, slice(start, start + size)) for m, start in enumerate(range(0, n, size))]

    def _rollout_step(self) -> int:
        """``daca train``'s step of the running rollout: TRL counts optimizer steps, μ of them
        (``num_iterations``) per rollout."""
        return self.state.global_step // self.num_iterations

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        """One completion per prompt, per micro-batch as ``daca train`` samples it
        (``daca.train.rollout.sample_micro_batch``), cut after the first end of sequence as TRL
        decodes and measures completions."""
        if images is not None or multimodal_fields:
            raise ValueError("DACAGRPOTrainer supports text prompts only")
        micro_batches = self._micro_batches(len(prompt_ids))
        sampled = [self._sample(prompt_ids[rows], micro) for micro, rows in micro_batches]
        self.last_rollouts = [rollout for rollout, _ in sampled]
        self._prompt_masks = [mask for _, mask in sampled]
        self.last_rollout = self.last_rollouts[-1]
        completion = torch.cat([rollout.completion_ids for rollout in self.last_rollouts])
        keep = up_to_eos(completion, self.eos_token_ids)
        completion_ids = [c[k].tolist() for c, k in zip(completion.cpu(), keep.cpu(), strict=True)]
        return completion_ids, None

    def _sample(self, prompt_ids: list[list[int]], micro: int) -> tuple[Rollout, Tensor]:
        """Micro-batch ``micro``'s rollout of the prompts, left padded to ``prompt_width`` (else
        to the longest; LLaDA 2.x: in whole blocks, ``pad_for_model``), and the prompts'
        attention mask."""
        args = self.args
        pad_id, model = self._tokenizer.pad_token_id, self.accelerator.unwrap_model(self.model)
        ids, att = pad_for_model(model, prompt_ids, pad_id, self.prompt_width)
        ids, att = ids.to(self.accelerator.device), att.to(self.accelerator.device)
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            torch.no_grad(),
        ):
            was_training = unwrapped.training
            unwrapped.eval()
            try:
                rollout = sample_micro_batch(
                    unwrapped,
                    ids,
                    att,
                    self.daca_cfg,
                    step=self._rollout_step(),
                    micro=micro,
                    rank=self.accelerator.process_index,
                    mask_id=self.mask_id,
                )
            finally:
                unwrapped.train(was_training)
        return rollout, att

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards [every process's rows, reward functions], kept for the advantages."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_per_func = rewards
        return rewards

    def _generate_and_score_completions(self, inputs):
        """TRL's rollout and rewards, then what ``daca train``'s step computes before its updates
        (``Trainer.train_step``): the micro-batches with group advantages of the method's
        baseline, DPS multipliers over all of them, and their old and reference log-probs under
        the native mask seeds (``daca.train.update``)."""
        cfg, method = self.daca_cfg, self.daca_method
        output = super()._generate_and_score_completions(inputs)
        training, rank = self.model.training, self.accelerator.process_index
        self._batches = self._rollout_batches(len(inputs))
        if cfg.dps.enabled:
            self._dps_step(self._batches, "train" if training else "eval")
        for batch in self._batches:
            batch.rollout = None  # the trace is read: free it before the updates
        mu = self.num_iterations if training else 1
        micros = [m for m, _ in self._micro_batches(len(inputs))]
        self._seeds = step_mask_seeds(cfg.seed, self._rollout_step(), micros, mu, rank)
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            old_and_reference(
                method, cfg, self.model, self._reference, self._batches, self._seeds, self.mask_id
            )
        return output

    def _rollout_batches(self, n: int) -> list[RolloutBatch]:
        """This process's ``n`` rows as the native trainer's micro-batches: daca's prompts and
        completions, the loss mask (tokens up to the first end of sequence), TRL's rewards (their
        weighted sum) and the group advantages with the method's baseline."""
        cfg, rank = self.daca_cfg, self.accelerator.process_index
        # The weighted sum in float64, as daca.tasks.rewards.score_rewards adds it up.
        per_func = self._rewards_per_func.double()
        rewards = (per_func * self.reward_weights.to(per_func)).nansum(1).float()
        G = self.num_generations if self.model.training else self.num_generations_eval
        baseline = self.daca_method.baseline
        advantages = group_advantages(rewards, G, scale=cfg.scale_rewards, baseline=baseline)
        mine = slice(rank * n, (rank + 1) * n)
        rewards, advantages = rewards[mine], advantages[mine]
        micro_batches = zip(
            self._micro_batches(n), self.last_rollouts, self._prompt_masks, strict=True
        )
        return [
            RolloutBatch(
                prompt_ids=rollout.sequences[:, : rollout.prompt_length],
                prompt_mask=prompt_mask,
                completion_ids=rollout.completion_ids,
                completion_mask=up_to_eos(rollout.completion_ids, self.eos_token_ids),
                rewards=rewards[rows],
                advantages=advantages[rows],
                step=self._rollout_step(),
                rollout=rollout,
            )
            for (_, rows), rollout, prompt_mask in micro_batches
        ]

    def _dps_step(self, batches: list[RolloutBatch], mode: str) -> list[Tensor]:
        """The multipliers of each micro-batch of the optimizer step, z-scored over all of them
        and every process (``daca.train.rollout.dps_multipliers``, as ``daca train``'s
        ``_dps_step``; with ``steps_per_generation = gradient_accumulation_steps`` TRL's
        generation batch is the optimizer step's); the ``dps/*`` metrics go to TRL's log."""
        gather = self.accelerator.gather if self.accelerator.num_processes > 1 else None
        rank = self.accelerator.process_index
        multipliers, _, metrics = dps_multipliers(
            [b.rollout for b in batches],
            self.daca_cfg.dps,
            gather=gather,
            rank=rank,
            completion_masks=[b.completion_mask for b in batches],
        )
        for batch, mult in zip(batches, multipliers, strict=True):
            batch.multipliers = mult
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)
        return multipliers

    # ----------------------------------------------------------------- the update
    @contextlib.contextmanager
    def _reference(self):
        """TRL's reference: its frozen copy, or the adapter-free (or "ref" adapter) PEFT model."""
        if self.ref_model is not None:
            yield self.ref_model
            return
        model = self.accelerator.unwrap_model(self.model)
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            yield self.model

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
    ):
        """TRL's old-policy and reference forwards in ``_generate_and_score_completions``: not
        run. The method computes its own, per inner iteration with its masks, and the loss its
        current log-probs (``_compute_loss``); these zeros are never read."""
        zeros = input_ids.new_zeros((len(input_ids), logits_to_keep), dtype=torch.float)
        return zeros, None, None

    def _iteration(self) -> int:
        """The inner iteration (0 .. mu-1) of the running micro-batch, from TRL's step counter."""
        if not self.model.training:
            return 0
        spg = self.args.steps_per_generation
        return (self._step % (spg * self.num_iterations)) // spg

    def _compute_loss(self, model, inputs):
        """The loss of the running micro-batch as ``daca train`` computes it
        (``daca.train.update.micro_batch_loss``): TRL's ``inputs`` are its split of the
        generation batch, and only its micro-step counter says which of ``_batches`` and which
        inner iteration run. The loss's metrics go to TRL's log."""
        cfg, method, training = self.daca_cfg, self.daca_method, self.model.training
        micro = self._step % self.args.steps_per_generation if training else 0
        it = self._iteration()
        batch, seed = self._batches[micro], self._seeds[micro][it]
        loss, metrics, _ = micro_batch_loss(method, cfg, model, batch, it, seed, self.mask_id)
        mode = "train" if training else "eval"
        for name, value in metrics.items():
            self._metrics[mode][name].append(float(value))
        # TRL's losses come scaled for gradient accumulation (HF's own scaling is off for GRPO).
        return loss / self.current_gradient_accumulation_steps if training else loss
