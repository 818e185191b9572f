"""Quantization: weight formats (int4, int8, AWQ, GGUF, FP8) and quantized linears. The FP8 KV
cache's format, which the attention kernels read and write, is ``kernels/kv_quant.py``."""
