"""Batch-invariant linears on a GPU (``--batch-invariant``): ``cuda/dense_gemm.cu`` in place of cuBLAS.

cuBLAS (``torch.matmul``/``F.linear``) picks its tiles, split-K and reduction order from the
problem's shape, so a row's bits change with the number of rows in the batch. ``dense_gemm``
computes every output element with one fixed tile shape and one K order, whatever M is (see the
kernel's header), so a token's projections do not depend on the batch, its chunk, or prefill vs
decode. ``make_linears_batch_invariant`` swaps a model's dense f16/bf16 projections and its LM
head for ``InvariantLinear`` and puts the W4A16 layers (``quant.gpu.AwqLinear``) in their
invariant mode (``awq_gemm`` for every M, one K split fixed by K, partials summed in order);
``runtime/runner.py`` calls it on a CUDA device when the executor runs with ``--batch-invariant``.
Kernels launch through a launcher (CuPy on a GPU, the CPU emulation in tests/cuda).

Not covered here: fp32 models (no tensor-core instance: their linears stay on cuBLAS), FP8
weights (``torch._scaled_mm``), the experts of a mixture of experts and LoRA deltas.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from folio.core.executor.kernels import cuda_kernels as ck

log = logging.getLogger(__name__)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous with a 16-byte aligned start (the kernel's cp.async copies)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def dense_matmul(launcher, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T -> [M, N]`` in x's dtype (f16/bf16), batch-invariant."""
    m, k = x.shape
    n, k_w = weight.shape
    if k_w != k or weight.dtype != x.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype} do not match")
    if k % 8:
        raise ValueError(f"the batch-invariant GEMM reads rows as 16-byte vectors: K = {k} is not a multiple of 8")
    names = ck.gemm_names(str(x.dtype).removeprefix("torch."))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    x, weight = _aligned(x), _aligned(weight)
    grid = (-(-m // ck.DGEMM_TILE_M), -(-n // ck.DGEMM_TILE_N), 1)
    launcher.launch(names, "dense_gemm", grid, (ck.DGEMM_THREADS, 1, 1),
                    [_ptr(y), _ptr(x), _ptr(weight), np.int32(m), np.int32(n), np.int32(k)], x.device)
    return y


class InvariantLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` through ``dense_matmul`` (the bias added after, per element)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, launcher):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = _aligned(weight.detach())  # shares the loaded (or tied) weight's storage when aligned
        self.bias = bias
        self.launcher = launcher

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = dense_matmul(self.launcher, x.reshape(-1, self.in_features).to(self.weight.dtype), self.weight)
        y = y.view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, batch-invariant GEMM"


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def make_linears_batch_invariant(model, launcher=None, own_mode: tuple[type, ...] = ()) -> int:
    """Swap the decoder's dense f16/bf16 projections (and the LM head, through the model's
    ``packed_lm_head`` hook) for ``InvariantLinear``; set the layers of the ``own_mode`` types
    (W4A16's ``AwqLinear``: the runner passes it, the kernels do not import the quantized layers)
    to their invariant mode. Returns how many layers changed. ``launcher``: default CuPy on the
    model's device."""
    device = model.embed_tokens.weight.device
    if launcher is None:
        from folio.core.executor.kernels.cuda_backend import CupyLauncher

        launcher = CupyLauncher(device)
    changed = 0
    for layer in model.layers:
        for parent in list(layer.modules()):
            for attr in PROJECTIONS:
                module = getattr(parent, attr, None)
                if isinstance(module, own_mode):
                    module.batch_invariant = True
                    changed += 1
                elif type(module) is nn.Linear and _fits(module.weight):
                    setattr(parent, attr, InvariantLinear(module.weight, module.bias, launcher))
                    changed += 1
    if model.packed_lm_head is None:
        weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        if _fits(weight):
            model.packed_lm_head = InvariantLinear(weight, None, launcher)
            model.lm_head = None  # a tied head keeps the embedding table for lookups
            changed += 1
        else:
            log.warning("the LM head (%s, %s) stays on cuBLAS: its logits may change with the batch",
                        weight.dtype, tuple(weight.shape))
    return changed


def _fits(weight: torch.Tensor) -> bool:
    return str(weight.dtype).removeprefix("torch.") in ck.DGEMM_DTYPES and weight.shape[1] % 8 == 0
