"""Model adapters: load a masked diffusion LM and its tokenizer and mask id."""
