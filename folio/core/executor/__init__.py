"""The executor's core, split by concern; ``services/executor`` is its shell. Lowest first (each
folder imports only the ones above it in this list; ``tests/test_layout.py`` checks it):

- ``parallel/``: tensor parallelism's primitives: a rank's slice of the model, process groups;
- ``kernels/``: attention and layer backends: the torch reference, the CPU C kernels, CUDA; the
  FP8 KV format and the sampler's parameter columns they share with their callers;
- ``quant/``, ``sampling/``, ``lora/``: weight formats and quantized linears; the batched sampler,
  penalties, rejection sampling; multi-LoRA (none of the three imports another);
- ``model/``: model families over shared layers, and loading checkpoints (HF folders, GGUF, a
  rank's shard);
- ``runtime/``: the model runner, the persistent input batch, CUDA graphs, proposers,
  the tensor-parallel worker group.
"""
