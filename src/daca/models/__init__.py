"""Model adapters: ``load(name_or_path)`` returns the model, its tokenizer and mask id."""

from daca.models.loading import LoadedModel, load

__all__ = ["LoadedModel", "load"]
