"""Quantized linear layers for CUDA GPUs: AWQ/int4 through folio's W4A16 kernel, FP8 through
``torch._scaled_mm``.

- ``AwqLinear`` holds a projection in AutoAWQ's GEMM layout (``qweight [in, out/8]``,
  ``qzeros [in/g, out/8]`` int32, ``scales [in/g, out]`` fp16) and runs ``cuda/quant_gemm.cu``:
  up to ``GEMV_MAX_ROWS`` rows (decode) through ``awq_gemv`` (fp32 partial sums per K slice,
  summed here), more through the tiled ``awq_gemm`` (split along K, with partial sums, when its
  tiles alone would not fill twice the SMs). Activations stay in the model's dtype.
  Batch-invariant mode (``AwqLinear.batch_invariant``, set by ``--batch-invariant``): every M
  goes through ``awq_gemm`` (its rows' sums do not depend on the other rows), split along K at
  fixed ``INVARIANT_K_SPLIT`` rows whatever M is, the fp32 partials added in split order
  elementwise; so a row's bits do not depend on the batch.
  The kernels launch through a launcher (CuPy on a GPU, the CPU emulation in tests).
- ``Fp8Linear`` holds e4m3 weights with one fp32 scale per output channel (quantized at load
  time) and quantizes each call's activations per token (row), then ``torch._scaled_mm`` with
  rowwise scales and a bf16 output; it needs compute capability 8.9 or newer (``require_fp8``).
  The quantize math is plain torch (``fp8_quantize``), so the CPU tests check it against a
  float emulation of ``_scaled_mm`` (``fp8_reference_mm``).

``loader.py`` calls ``quantize_model_gpu`` on a CUDA device; the LM head stays dense.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.quant.formats import Int4Weight, int4_to_awq

GEMV_MAX_ROWS = 8  # rows up to which awq_gemv (reads the weights once per 2 rows) beats the tile (unmeasured)
GEMM_MIN_SPLIT = 256  # K rows per split of awq_gemm at least
INVARIANT_K_SPLIT = 512  # K rows per split of awq_gemm in batch-invariant mode (fixed; a multiple of GEMM_BK)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_MIN_CAPABILITY = (8, 9)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def check_awq_shape(in_features: int, out_features: int, group_size: int) -> None:
    problems = []
    if out_features % 32:
        problems.append(f"{out_features} output features are not a multiple of 32")
    if group_size % 32 or in_features % group_size:
        problems.append(f"group size {group_size} must be a multiple of 32 dividing {in_features} input features")
    if problems:
        raise ValueError("the W4A16 kernel cannot take this projection: " + "; ".join(problems))


def awq_matmul(launcher, x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group_size: int, invariant: bool = False) -> torch.Tensor:
    """``x [M, K] @ W`` with W in AutoAWQ's GEMM layout -> ``[M, N]`` in x's dtype. ``invariant``:
    batch-invariant (see the module docstring)."""
    m, k = x.shape
    n = scales.shape[1]
    names = ck.quant_names(str(x.dtype).removeprefix("torch."))
    x = x.contiguous()
    if m == 0:
        return x.new_empty(0, n)
    ints = [np.int32(v) for v in (m, n, k, group_size)]
    weights = [_ptr(qweight), _ptr(qzeros), _ptr(scales)]
    if invariant:
        return _awq_gemm_invariant(launcher, names, x, weights, ints, m, n, k)
    if m <= GEMV_MAX_ROWS:
        splits = -(-k // ck.GEMV_K)
        partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        grid = (-(-n // ck.GEMV_COLS), splits, -(-m // ck.GEMV_ROWS))
        launcher.launch(names, "awq_gemv", grid, (ck.GEMV_THREADS, 1, 1),
                        [_ptr(partial), _ptr(x), *weights, *ints], x.device)
        return (partial[0] if splits == 1 else partial.sum(0)).to(x.dtype)
    tiles = -(-n // ck.GEMM_BN) * -(-m // ck.GEMM_BM)
    # split K when the tiles alone leave SMs idle (a batch of 9-64 rows on N = 2048 is 16 tiles),
    # keeping at least GEMM_MIN_SPLIT rows per split
    splits = max(1, min(k // GEMM_MIN_SPLIT, -(-2 * launcher.num_sms // tiles)))
    k_split = ck.GEMM_BK * -(-k // (ck.GEMM_BK * splits))
    splits = -(-k // k_split)
    grid = (-(-n // ck.GEMM_BN), -(-m // ck.GEMM_BM), splits)
    if splits == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        partial = y  # unused
    else:
        partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        y = partial  # unused
    launcher.launch(names, "awq_gemm", grid, (ck.GEMM_THREADS, 1, 1),
                    [_ptr(y), _ptr(partial), _ptr(x), *weights, *ints, np.int32(k_split)], x.device)
    return y if splits == 1 else partial.sum(0).to(x.dtype)


def _awq_gemm_invariant(launcher, names, x, weights, ints, m: int, n: int, k: int) -> torch.Tensor:
    k_split = INVARIANT_K_SPLIT
    splits = -(-k // k_split)
    grid = (-(-n // ck.GEMM_BN), -(-m // ck.GEMM_BM), splits)
    if splits == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        launcher.launch(names, "awq_gemm", grid, (ck.GEMM_THREADS, 1, 1),
                        [_ptr(y), _ptr(y), _ptr(x), *weights, *ints, np.int32(k_split)], x.device)
        return y
    partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    launcher.launch(names, "awq_gemm", grid, (ck.GEMM_THREADS, 1, 1),
                    [_ptr(partial), _ptr(partial), _ptr(x), *weights, *ints, np.int32(k_split)], x.device)
    total = partial[0].clone()
    for s in range(1, splits):  # elementwise, in split order (torch's sum(0) may reduce by shape)
        total += partial[s]
    return total.to(x.dtype)


class AwqLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with W 4-bit in AutoAWQ's GEMM layout, on the W4A16 kernel."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, launcher, device: torch.device):
        super().__init__()
        self.out_features, self.in_features = weight.q.shape
        self.group_size = weight.group_size
        check_awq_shape(self.in_features, self.out_features, self.group_size)
        packed = int4_to_awq(weight)  # raises for zero points off the integer grid
        self.qweight = packed["qweight"].to(device)
        self.qzeros = packed["qzeros"].to(device)
        self.scales = packed["scales"].to(device)
        self.bias = bias
        self.launcher = launcher
        self.batch_invariant = False  # --batch-invariant sets it (kernels/gemm_kernels.make_linears_batch_invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = awq_matmul(self.launcher, x.reshape(-1, self.in_features), self.qweight, self.qzeros, self.scales,
                       self.group_size, invariant=self.batch_invariant)
        y = y.view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, awq g{self.group_size}"


# ---------------------------------------------------------------------------- FP8 (e4m3)
def fp8_quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3: (``q [R, C]`` float8_e4m3fn, ``scale [R, 1]`` fp32) with ``t ~ q * scale``.

    ``scale = max|row| / 448``; values are divided, saturated to +-448 explicitly (e4m3fn has no
    infinity, and what a bare cast does past the range is up to the backend) and rounded to the
    nearest e4m3. Weights
    use it per output channel, activations per token."""
    t32 = t.float()
    scale = (t32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    q = (t32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_reference_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                     out_dtype=torch.bfloat16) -> torch.Tensor:
    """What ``_scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale)`` computes (``x_scale [M, 1]``,
    ``wq [N, K]``, ``w_scale [1, N]``), in float math on any device."""
    return ((xq.float() @ wq.float().t()) * x_scale * w_scale).to(out_dtype)


def require_fp8(device: torch.device) -> None:
    """Raises unless ``device`` is a CUDA GPU of compute capability 8.9 or newer."""
    if device.type != "cuda":
        raise ValueError(f"fp8 weights need a CUDA GPU with FP8 tensor cores (sm_89+); the device is {device}")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"fp8 weights need compute capability 8.9 or newer (sm_89+); {device} is {name}, "
                         f"compute capability {capability[0]}.{capability[1]}")


class Fp8Linear(nn.Module):
    """``y = x @ W.T (+ bias)`` with W e4m3 per output channel and x quantized per token."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if self.in_features % 16 or self.out_features % 16:
            raise ValueError(f"fp8 weights need both sizes multiples of 16 (torch._scaled_mm), not "
                             f"{self.out_features}x{self.in_features}")
        q, scale = fp8_quantize(weight)
        self.weight_q = q  # [N, K] row-major: .t() is the column-major B _scaled_mm wants
        self.weight_scale = scale.t().contiguous()  # [1, N]
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xq, x_scale = fp8_quantize(x.reshape(-1, self.in_features))
        y = torch._scaled_mm(xq, self.weight_q.t(), scale_a=x_scale, scale_b=self.weight_scale,
                             out_dtype=torch.bfloat16)
        y = y.to(x.dtype).view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8 e4m3 per channel"


# ---------------------------------------------------------------------------- swapping layers in
PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def cupy_launcher(device: torch.device):
    try:
        from folio.core.executor.kernels.cuda_backend import CupyLauncher
    except ImportError as e:
        raise ValueError("awq/int4 weights on a GPU run folio's CUDA kernel, which needs CuPy "
                         "(pip install 'folio[cuda12]' or 'folio[cuda13]')") from e
    return CupyLauncher(device)


def quantize_model_gpu(model, method: str, weights: dict[str, Int4Weight] | None = None, launcher=None) -> None:
    """Swap the decoder's projections for ``AwqLinear`` (``awq``/``int4``: ``weights`` by our fused
    names, e.g. ``layers.0.mlp.gate_up_proj``) or ``Fp8Linear`` (``fp8``: from the loaded dense
    weights). The LM head stays dense."""
    device = model.embed_tokens.weight.device
    if method == "fp8":
        require_fp8(device)
    elif launcher is None:
        launcher = cupy_launcher(device)
    for i, layer in enumerate(model.layers):
        for part, attr in PROJECTIONS:
            parent = getattr(layer, part)
            dense = getattr(parent, attr)
            if method == "fp8":
                new = Fp8Linear(dense.weight, dense.bias)
            else:
                new = AwqLinear(weights[f"layers.{i}.{part}.{attr}"], dense.bias, launcher, device)
            setattr(parent, attr, new)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the dense copies are gone
