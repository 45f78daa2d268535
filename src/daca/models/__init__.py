"""Models: ``load(name_or_path)`` returns the model, its tokenizer and special ids;
``save_pretrained(bundle, folder)`` writes a complete model folder that ``load`` reads back."""

from daca.models.loading import LoadedModel, load, save_pretrained

__all__ = ["LoadedModel", "load", "save_pretrained"]
