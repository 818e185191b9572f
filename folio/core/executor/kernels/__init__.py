"""Attention and layer backends: the torch reference, the CPU C kernels (``csrc/``), the CUDA kernels (``folio.cuda``)."""
