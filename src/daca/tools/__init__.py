"""The run tools, beside the trainer: ``daca compare``'s ablation grid (``compare``), the
pictures of ``daca inspect`` (``inspect_run``), the memory planner of ``daca train --dry-run``
(``memory``), the credit-by-role table of ``daca credit`` (``credit``) and the pretraining of the
tiny models (``pretrain``, ``pretrain_config``). They run
the trainer or read its config and outputs; the trainer imports none of them."""
