"""Attention and layer backends: the torch reference, the CPU C kernels (``csrc/``), the CUDA kernels
(``folio.cuda``), and the layouts they share with their callers: the FP8 KV cache
(``kv_quant.py``), the sampler's parameter columns (``sampler_columns.py``)."""
