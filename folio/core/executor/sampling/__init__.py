"""Sampling: the batched sampler, penalties, Philox draws, rejection sampling for speculative
decoding. Grammar masks are ``folio/core/structured/masks.py``; the layout of the sampler's
parameter rows, shared with the C sampler, is ``kernels/sampler_columns.py``."""
