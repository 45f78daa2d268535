"""A task's rows as the prompt texts a loaded model reads: the tiny models the task's compact
character prompt (``prompt_format`` "compact"), chat models its chat prompt through the
tokenizer's chat template (``daca.models.prompts.render_chat``). Here, not in ``daca.models``:
it reads a ``Task``, and the tasks sit a floor above the models."""

from __future__ import annotations

from daca.models.loading import LoadedModel
from daca.models.prompts import ChatTemplateError, render_chat
from daca.tasks import Task


def prompt_texts(bundle: LoadedModel, task: Task, rows: list[dict]) -> list[str]:
    if bundle.prompt_format == "compact":
        if task.compact_prompt is None:
            raise ValueError(f"the tiny model has no prompt format for task {task.name!r}")
        return [task.compact_prompt(r) for r in rows]
    tok = bundle.tokenizer
    texts = []
    for r in rows:
        message = [{"role": "user", "content": task.chat_prompt(r)}]
        if getattr(tok, "chat_template", None):
            try:
                texts.append(render_chat(tok, message))
            except ChatTemplateError as e:
                raise ChatTemplateError(f"{bundle.path or bundle.name}: {e}") from None
        else:
            texts.append(message[0]["content"])
    return texts
