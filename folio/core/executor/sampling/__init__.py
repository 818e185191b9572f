"""Sampling: the batched sampler, penalties, grammar masks, rejection sampling for speculative decoding."""
