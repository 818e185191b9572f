"""The columns of ``SamplingBatch.params``, one row per sampling row: the layout that the sampler,
the persistent input batch and the CPU sampler kernel (``csrc/sampler.c``) share."""

TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION, TOP_K = range(7)
NUM_PARAMS = 7
