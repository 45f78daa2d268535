"""The models shipped with daca, by name: where they lie and which one a task's ``"tiny"`` means.

Names only (no model code), so that the configuration can resolve ``model=tiny`` without
importing the model loader.
"""

from __future__ import annotations

from pathlib import Path

TINY_PATH = Path(__file__).resolve().parent / "assets" / "tiny"
# One tiny model per embedded task (the tiny model is too small to learn both Sudoku and
# Countdown well at once); the trace tasks' models answer in 64 tokens, in two blocks.
SHIPPED = {
    "tiny": TINY_PATH,
    "tiny-countdown": TINY_PATH.parent / "tiny-countdown",
    "tiny-sudoku-trace": TINY_PATH.parent / "tiny-sudoku-trace",
    # The same architecture and task stopped early in pretraining (step 120, inside the jump in
    # which the answer is learned): a start with room to learn by RL (docs/results.md, headroom).
    "tiny-sudoku-trace-early": TINY_PATH.parent / "tiny-sudoku-trace-early",
    "tiny-countdown-trace": TINY_PATH.parent / "tiny-countdown-trace",
}
# The shipped model that ``"tiny"`` means for a task (others: ``"tiny"``, the Sudoku model).
TASK_MODELS = {
    "countdown": "tiny-countdown",
    "countdown-public": "tiny-countdown",
    "sudoku-trace": "tiny-sudoku-trace",
    "countdown-trace": "tiny-countdown-trace",
}


def tiny_for_task(name_or_path: str | None, task: str) -> str | None:
    """``"tiny"`` means the shipped model of the task (``TASK_MODELS``)."""
    if name_or_path not in (None, "", "tiny"):
        return name_or_path
    return TASK_MODELS.get(task, name_or_path)
