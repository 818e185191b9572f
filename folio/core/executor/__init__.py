"""The executor's core, split by concern; ``services/executor`` is its shell.

- ``model/``: model families over shared layers, and loading checkpoints (HF folders, GGUF);
- ``kernels/``: attention and layer backends: the torch reference, the CPU C kernels, CUDA;
- ``sampling/``: the batched sampler, penalties, grammar masks, rejection sampling;
- ``quant/``: weight formats and quantized linears, the FP8 KV cache;
- ``runtime/``: the model runner, the persistent input batch, the KV pool, CUDA graphs, proposers;
- ``parallel/``: tensor parallelism: process groups, sharded loading, worker processes.
"""
