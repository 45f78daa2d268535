"""Per-family knowledge: LoRA target modules and a memory estimate for ``--dry-run``."""

from __future__ import annotations

from daca.config import TrainConfig

# All attention and MLP projections (METHOD.md §5), by family.
LORA_TARGETS = {
    "llada": ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"],
    "dream": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "tiny": ["query", "key", "value", "dense"],
}


def lora_targets(bundle) -> list[str]:
    if bundle.family in LORA_TARGETS:
        return LORA_TARGETS[bundle.family]
    return "all-linear"


def _parameter_count(cfg: TrainConfig) -> tuple[int, int, int, int]:
    """(parameters, hidden size, layers, vocab) from the model's config, without weights."""
    from transformers import AutoConfig

    from daca.models.loading import resolve

    c = AutoConfig.from_pretrained(resolve(cfg.model), trust_remote_code=True)
    h = getattr(c, "hidden_size", None) or c.d_model
    n = getattr(c, "num_hidden_layers", None) or c.n_layers
    v = c.vocab_size
    ff = getattr(c, "intermediate_size", None) or getattr(c, "mlp_hidden_size", None) or 4 * h
    per_layer = 4 * h * h + 3 * h * ff
    return n * per_layer + 2 * v * h, h, n, v


def estimate_memory(cfg: TrainConfig) -> str:
    """Weights, adapter, optimizer, activations, SML views and the DPS trace, per device."""
    try:
        params, h, layers, vocab = _parameter_count(cfg)
    except Exception as e:  # noqa: BLE001 - an estimate, never a reason to fail
        return f"memory estimate unavailable ({type(e).__name__}: {e})"
    gib = 1024**3
    wbytes = 0.5 if cfg.load_in_4bit else (2 if cfg.bf16 else 4)
    weights = params * wbytes
    trainable = layers * 7 * 2 * cfg.lora.r * h if cfg.lora.enabled else params
    optimizer = trainable * (4 + 8)  # fp32 grads + two AdamW moments
    g = cfg.generation
    seq = 256 + g.gen_length  # a typical prompt plus the completion
    b = cfg.per_device_train_batch_size
    views = 1 + (cfg.sml.num_strata if cfg.sml.enabled else 0)
    act_factor = 2 if cfg.gradient_checkpointing else 34
    activations = b * views * seq * h * layers * act_factor * 2 / max(1, cfg.num_generations)
    logits = b * views * g.gen_length * vocab * 4
    snaps = g.steps // cfg.dps.stride + 1 if cfg.dps.enabled else 0
    rows = g.gen_length if cfg.dps.scope == "all" else g.block_length
    trace = b * snaps * rows * vocab * 4 / 2  # rows are freed as tokens are born: ~half held
    parts = {
        "weights": weights,
        "adapter+optimizer": optimizer,
        "activations (per micro-batch of one group)": activations,
        "logits": logits,
        "DPS trace (peak)": trace,
    }
    lines = [f"estimated memory per device ({params / 1e9:.2f} B parameters):"]
    lines += [f"  {k:45s} {v / gib:8.2f} GiB" for k, v in parts.items()]
    lines.append(f"  {'total':45s} {sum(parts.values()) / gib:8.2f} GiB (rough)")
    return "\n".join(lines)
