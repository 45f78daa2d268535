"""GPU-memory estimate per device for ``daca train --dry-run``, from the config alone.

The model's size comes from ``daca.models.families.model_shape``: the model built on the meta
device from its config.json (a folder's, a built-in copy for LLaDA-8B and Dream-7B, or the hub
cache's), its parameters and projections read off the module; no weights are loaded. The
estimate follows the trainer's phases: a rollout (no gradients: the forward's logits and the
DPS trace) and an update (activations of every forward in the loss, the log-softmax rows it
keeps), on top of the weights and the trainable state that live throughout. It is a planning
number (±30 %), not a measurement; ``benchmarks/gpu_smoke.sh`` prints measured peaks, and
``benchmarks/bench_memory_planner.py`` checks it against a 4-bit CPU run of a 170 M model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from daca.train.config import TrainConfig
from daca.train.methods import METHODS

PROMPT_TOKENS = 256  # assumed prompt length (d1 truncates prompts at 200 tokens)
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4 bits + double-quantised absmax per 64-block
GIB = 1024**3


@dataclass
class MemoryEstimate:
    """Bytes per device, by part; ``peak`` = resident + the larger of the two phases."""

    model: str
    source: str
    parameters: int
    trainable: int
    active: int = 0  # a mixture of experts: the parameters one token runs through
    resident: dict[str, float] = field(default_factory=dict)  # weights, trainable state
    rollout: dict[str, float] = field(default_factory=dict)
    update: dict[str, float] = field(default_factory=dict)

    @property
    def peak(self) -> float:
        return sum(self.resident.values()) + max(
            sum(self.rollout.values()), sum(self.update.values())
        )


def dps_trace_rows(gen_length: int, steps: int, block_length: int, stride: int, scope: str):
    """Peak held log-probability rows per sequence (``daca.core.trace.TraceRecorder``):
    "all": L (T + s − 1)² / (4 s T); "block": b (k + s − 1)² / (4 s k) with k = T / (L / b) for
    one block, b (k + 2s − 1)² / (4 s k) for several (each block also holds the rows that the
    previous block's last recorded step kept for it, docs/rollouts.md)."""
    if scope == "all":
        return gen_length * (steps + stride - 1) ** 2 / (4 * stride * steps)
    k = steps // (gen_length // block_length)
    carried = stride if gen_length > block_length else 0
    return block_length * (k + stride + carried - 1) ** 2 / (4 * stride * k)


def rollout_logits_rows(g, dps) -> int:
    """Completion rows whose logits a rollout step keeps at most (``daca.core.sampler``'s
    ``_logits``): the current block's, and up to the last block a recorded DPS step traces
    (``TraceRecorder.reach_block``): every later one for scope "all", the blocks that the
    steps up to the next recorded one reach for "block"."""
    L, bl = g.gen_length, g.block_length
    if not dps.enabled:
        return bl
    if dps.scope == "all":
        return L
    k = g.steps // (L // bl)
    return min(L, bl * (1 + (k - 1 + dps.stride) // k))


def estimate(cfg: TrainConfig) -> MemoryEstimate:
    """The memory estimate for ``cfg`` (raises LookupError for an unknown model)."""
    from daca.models.families import model_shape

    shape, source = model_shape(cfg.model)
    g = cfg.generation
    b = cfg.per_device_train_batch_size  # completions per forward, in rollout and update
    T = PROMPT_TOKENS + g.gen_length
    act = 2 if cfg.bf16 else 4  # bytes per activation / logit entry
    h, V, layers = shape.hidden, shape.vocab, shape.layers
    est = MemoryEstimate(cfg.model, source, shape.parameters, 0, shape.active)

    # Weights: NF4 for the layers' projections; embeddings, head, norms and biases in fp32
    # (prepare_model_for_kbit_training upcasts them, as TRL does for the reference codes).
    if cfg.load_in_4bit:
        weights = shape.linear_parameters * NF4_BYTES + shape.other_parameters * 4
        kind = "4-bit NF4, embeddings fp32"
    else:
        weights = shape.parameters * act
        kind = "bf16" if cfg.bf16 else "fp32"
    est.resident[f"weights ({kind})"] = weights
    if cfg.lora.enabled:
        # PEFT keeps adapters in fp32: weights, gradients and two AdamW moments, 4 bytes each.
        est.trainable = shape.lora_parameters(cfg.lora.r, cfg.lora.target_modules)
        est.resident[f"LoRA r={cfg.lora.r} + gradients + AdamW (fp32)"] = est.trainable * 16
    else:
        est.trainable = shape.parameters
        est.resident["gradients + AdamW moments"] = shape.parameters * act * 3
        if cfg.beta > 0:
            est.resident["frozen reference copy"] = weights

    # Logits rows per sequence: the completion's where the head runs on those alone (LLaDA,
    # Dream: ``logits_to_keep``), else every position's; a rollout step keeps fewer.
    rows = g.gen_length if shape.head_on_completion else T
    step_rows = rollout_logits_rows(g, cfg.dps) if shape.head_on_completion else T
    # Rollout: a block's first step's logits (twice with CFG), the DPS trace.
    cfg_factor = 2 if g.cfg_scale > 0 else 1
    est.rollout["rollout logits (one denoising step)"] = cfg_factor * b * step_rows * V * act
    if cfg.dps.enabled:
        held = dps_trace_rows(g.gen_length, g.steps, g.block_length, cfg.dps.stride, cfg.dps.scope)
        est.rollout[f"DPS trace (peak, scope {cfg.dps.scope}, s={cfg.dps.stride})"] = (
            b * held * (V * act + 4)
        )
    # The candidates of a block's first step, every position masked (daca.core.sampler:
    # _candidates, gumbel_argmax, candidate_confidence): a copy of the block's logits rows, then
    # LLaDA's float64 Gumbel-max, whose noise and temporaries peak at 4 float64 tensors of the
    # rows' size (36 bytes per entry measured with an fp32 copy, bench_memory_planner.py), or
    # at temperature 0 the float64 softmax of the confidence alone (2 tensors).
    f64 = 32 if g.temperature > 0 else 16 if g.remasking == "low_confidence" else 0
    bl = min(g.block_length, g.gen_length)
    est.rollout["candidates of one block (float64 Gumbel-max)"] = b * bl * V * (act + f64)

    # Update: every forward of the loss keeps its activations until the backward. Per token and
    # layer ~10 hidden-sized and 4 MLP-sized tensors; with checkpointing, the layer inputs only,
    # plus one layer recomputed at a time.
    per_layer = act * (10 * h + 4 * shape.mlp)
    if cfg.lora.enabled:
        # PEFT saves each adapter's rank-r output of A and, with dropout, its own dropped-out
        # copy of the projection's input (6 hidden- and 1 MLP-sized for Llama; measured: +49 %
        # per layer at d 512, MLP 1536, r 128, bench_memory_planner.py); a routed expert's
        # adapter, for the tokens routed to it alone.
        adapted = shape.adapted(cfg.lora.target_modules)
        inputs = sum(i * seen for (i, _), seen in adapted) if cfg.lora.dropout > 0 else 0
        outputs = cfg.lora.r * sum(seen for _, seen in adapted)
        per_layer += act * (inputs + outputs) / layers
    # A block-causal model's likelihoods run prompt, noised and clean completion in one
    # forward (daca.core.modeling.block_diffusion_mask): L more tokens per sequence.
    Tu = T + g.gen_length if shape.block_causal else T
    if cfg.gradient_checkpointing:
        per_forward, recompute = b * Tu * layers * act * h, b * Tu * per_layer
    else:
        per_forward, recompute = b * Tu * layers * per_layer, 0
    # Each estimator stacks its views in one forward (daca.train.methods: GDPO one per quadrature
    # node, coupled-GRPO 1 + 2λ; SML: K): the largest stacked forward's logits exist at a time;
    # the log-softmax rows of the scored positions are kept in fp32 with their gradient (8 bytes
    # per entry).
    nodes, scored = METHODS[cfg.method].forward_views(cfg)
    K = cfg.sml.num_strata if cfg.sml.enabled else 0
    est.update[f"activations ({nodes} forward{'s' * (nodes > 1)})"] = (
        nodes * per_forward + recompute
    )
    est.update["logits of the largest stacked forward"] = max(nodes, K) * b * rows * V * act
    est.update["log-softmax rows + gradients (fp32)"] = scored * b * g.gen_length * V * 8
    if K:  # K views, each scoring 1/K of the completion
        est.update[f"SML views (K={K}: activations + rows)"] = (
            K * per_forward + b * g.gen_length * V * 8
        )
    return est


def estimate_text(cfg: TrainConfig) -> str:
    """The estimate as printed by ``daca train --dry-run`` (or why there is none)."""
    try:
        est = estimate(cfg)
    except (LookupError, FileNotFoundError, OSError, ValueError) as e:
        return f"memory estimate unavailable: {e}"
    g = cfg.generation
    active = f", {est.active / 1e9:.2f} B active" if est.active < est.parameters else ""
    lines = [
        f"estimated GPU memory per device for {est.model} ({est.parameters / 1e9:.2f} B "
        f"parameters{active}, {est.trainable / 1e6:.1f} M trainable; shape from {est.source}), "
        f"{cfg.per_device_train_batch_size} completions of {PROMPT_TOKENS} prompt (assumed) + "
        f"{g.gen_length} tokens:"
    ]
    for title, part in (("", est.resident), ("rollout: ", est.rollout), ("update: ", est.update)):
        lines += [f"  {title + k:58s} {v / GIB:8.2f} GiB" for k, v in part.items()]
    lines.append(f"  {'peak (resident + larger phase), ±30 %':58s} {est.peak / GIB:8.2f} GiB")
    return "\n".join(lines)
