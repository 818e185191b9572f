"""The ``cuda`` attention backend's module on a machine without a GPU: it imports (CuPy imports without
one) and names itself, and without CuPy the import fails, which is how the runner knows to fall back
to the torch backend. Its kernels run in the emulation and, on a GPU, in the ``gpu`` tests."""

from __future__ import annotations

import importlib
import sys

import pytest

MODULE = "folio.core.executor.kernels.cuda_backend"


def test_the_backend_imports_without_a_gpu():
    from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend

    backend = importlib.import_module(MODULE)
    assert issubclass(backend.CudaAttentionBackend, KernelAttentionBackend)
    assert backend.CudaAttentionBackend.name == "cuda"


def test_without_cupy_the_import_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    with pytest.raises(ImportError):
        importlib.import_module(MODULE)
