"""Quantization: weight formats (int4, int8, AWQ, GGUF, FP8), quantized linears, the FP8 KV cache."""
