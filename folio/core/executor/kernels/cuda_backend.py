"""The ``cuda`` attention backend: folio's kernels from ``cuda/``, launched with CuPy.

``runner.make_backend`` builds ``CudaAttentionBackend(model_dtype, batch_invariant=...)`` on a CUDA device (``auto``
or ``--attention-backend cuda``). Importing this module raises ImportError when CuPy is missing,
and the runner then falls back to the torch backend. GEMMs stay in torch (with
``--batch-invariant``, ``gemm_kernels`` moves the dense f16/bf16 ones off cuBLAS); this backend only
replaces what paging needs (see ``kernel_backend``): it launches each kernel on torch's current
stream with raw device pointers, so it orders correctly with the model's torch ops and with CUDA
graphs captured on that stream.
"""

from __future__ import annotations

import cupy  # noqa: F401  (the optional dependency: ImportError here means "use torch")
import torch

from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend, make_host_pool

__all__ = ["CudaAttentionBackend", "CupyLauncher", "make_host_pool"]


class CupyLauncher:
    """Launches loader-compiled kernels on torch's current stream of the tensors' device."""

    def __init__(self, device: torch.device | None = None):
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._streams: dict[int, object] = {}

    def _stream(self, device_id: int):
        """CuPy's view of torch's current stream (wrappers cached per stream handle)."""
        current = torch.cuda.current_stream(device_id)
        handle = current.cuda_stream
        if handle not in self._streams:
            if hasattr(cupy.cuda.Stream, "from_external") and hasattr(current, "__cuda_stream__"):
                self._streams[handle] = cupy.cuda.Stream.from_external(current)  # CuPy >= 14
            else:
                self._streams[handle] = cupy.cuda.ExternalStream(handle, device_id)  # CuPy 13
        return self._streams[handle]

    def launch(self, names: ck.KernelNames, kernel: str, grid, block, args, device: torch.device) -> None:
        device_id = device.index if device.index is not None else torch.cuda.current_device()
        self._run(ck.compiled_kernel(getattr(names, kernel), names, device_id), device_id, grid, block, args)

    def launch_from(self, source: str, name_expressions: tuple[str, ...], name: str, grid, block, args,
                    device: torch.device) -> None:
        """Kernel ``name`` of the module compiled from ``source`` with ``name_expressions`` (the
        LoRA and MoE kernels' own modules), on torch's current stream."""
        device_id = device.index if device.index is not None else torch.cuda.current_device()
        self._run(ck.raw_module(source, name_expressions, device_id).get_function(name), device_id, grid, block,
                  args)

    def _run(self, function, device_id: int, grid, block, args) -> None:
        with cupy.cuda.Device(device_id), self._stream(device_id):
            function(tuple(grid), tuple(block), args)


class CudaAttentionBackend(KernelAttentionBackend):
    name = "cuda"

    def __init__(self, model_dtype: torch.dtype, device: torch.device | None = None, split: bool | None = None,
                 kv_dtype: torch.dtype | None = None, batch_invariant: bool = False):
        super().__init__(CupyLauncher(device), model_dtype, split=split, kv_dtype=kv_dtype,
                         batch_invariant=batch_invariant)
