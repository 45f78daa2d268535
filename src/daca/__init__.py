"""daca: DACA-GRPO for masked diffusion language models.

The method core is a set of pure functions on tensors (see METHOD.md in the docs):

>>> from daca import generate, Rollout      # sampler with the denoising trace
>>> from daca import dps                    # Denoising Progress Scores
>>> from daca import likelihood             # mean-field, SML, GDPO ELBO
>>> from daca import objectives             # group advantages and the base methods' losses
"""

from daca.core import dps, likelihood, objectives
from daca.core.sampler import Rollout, generate

__version__ = "0.1.0"
__all__ = ["Rollout", "generate", "dps", "likelihood", "objectives", "__version__"]
