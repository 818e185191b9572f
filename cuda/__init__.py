"""The CUDA C kernels, shipped as package data (``folio.cuda``); ``folio.core.executor.kernels.cuda_kernels`` loads them."""
