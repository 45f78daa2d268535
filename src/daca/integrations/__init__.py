"""Adapters that plug the DACA method core into other trainers (optional extras).

- ``daca.integrations.trl``: TRL's ``GRPOTrainer`` for masked diffusion LMs, computing each
  micro-batch as ``daca train`` does (``pip install daca-grpo[trl]``, pinned to the TRL version
  whose internals it overrides): ``config.py`` (``DACAGRPOConfig``), ``trainer.py``
  (``DACAGRPOTrainer``).
"""
