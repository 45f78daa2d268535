"""The method core: small pure functions on tensors, no configuration and no I/O.

``modeling`` (the forward contract every model meets), ``sampler`` (generation with the
denoising trace), ``dps`` (Denoising Progress Scores), ``likelihood`` (mean-field, SML, the
ELBO estimators) and ``objectives`` (group advantages and the base losses). Nothing here imports
from daca outside ``daca.core``.
"""
