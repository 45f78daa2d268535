"""The two errors a run reports to the user (``daca train`` prints them without a traceback)."""

from __future__ import annotations


class InputError(ValueError):
    """Input a run cannot start with (data, prompts, output folder); the message names the
    file and line or the example, and what to change."""


class TrainingError(RuntimeError):
    """A run that had to stop (a failed checkpoint write, non-finite steps); the message says
    why, what is safe on disk and how to go on."""
