"""The CUDA C kernels, shipped as package data (``folio.cuda``); ``folio.core.executor.kernels.cuda_kernels`` loads them."""

# In a checkout this folder is also importable as a top-level ``cuda`` (pytest and ``python -m``
# put the repository root on the import path). As a plain package it would hide NVIDIA's ``cuda``
# namespace package (``cuda.pathfinder``, which CuPy imports); extend_path merges the two.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
