"""``daca export RUN_DIR --out DIR``: a standalone model from one of a run's checkpoints.

Every checkpoint's ``model/`` folder is already a model ``daca.models.load`` accepts; export
copies one out of the run, and for a LoRA run either keeps the adapter (PEFT's own format, its
``daca.json`` naming the base model) or, with ``--merge-lora``, merges it into the base and
writes the full model in its family's hub layout (LLaDA's or Dream's key names and
``config.json``), loadable by daca and by the family's own code alike.
"""

from __future__ import annotations

import sys
from pathlib import Path


def checkpoint_model(run_dir, step: int | None = None) -> Path:
    """The ``model/`` folder of the run's checkpoint at ``step`` (default: the latest)."""
    from daca.train.checkpointing import list_checkpoints

    found = list_checkpoints(Path(run_dir))
    if not found:
        raise FileNotFoundError(f"{run_dir} has no complete checkpoint")
    if step is None:
        return found[-1][1] / "model"
    for s, folder in found:
        if s == step:
            return folder / "model"
    have = ", ".join(str(s) for s, _ in found)
    raise FileNotFoundError(f"{run_dir} has no checkpoint of step {step} (it has {have})")


def export(run_dir, out, *, step: int | None = None, merge_lora: bool = False) -> Path:
    """Write the checkpoint's model to ``out``; a LoRA adapter merged into its base when
    ``merge_lora``. Returns ``out``.

    A QLoRA run's adapter is merged into the base at full precision (its checkpoint's dtype),
    as users deploy it, not into the 4-bit weights it was trained on: the merged model's
    logits differ from the adapter-on-4-bit ones by the base's quantisation error."""
    from daca.models.loading import load, save_pretrained

    bundle = load(str(checkpoint_model(run_dir, step)), base_in_4bit=False if merge_lora else None)
    if merge_lora and hasattr(bundle.model, "merge_and_unload"):
        bundle.model = bundle.model.merge_and_unload()
    return save_pretrained(bundle, out)


def add_arguments(p) -> None:
    p.add_argument("run_dir", help="a run folder of `daca train`")
    p.add_argument("--out", required=True, help="folder to write the model to")
    p.add_argument("--step", type=int, help="which checkpoint (default: the latest)")
    p.add_argument(
        "--merge-lora",
        action="store_true",
        help="merge a LoRA adapter into its base and write the full model",
    )


def run(args) -> int:
    if Path(args.out).exists() and any(Path(args.out).iterdir()):
        print(f"error: {args.out} exists and is not empty", file=sys.stderr)
        return 2
    try:
        out = export(args.run_dir, args.out, step=args.step, merge_lora=args.merge_lora)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
