"""Cases for the W4A16 kernels of cuda/quant_gemm.cu, shared by the emulated and the GPU tests:
``awq_matmul`` (through a launcher) against x @ the dequantized weights in fp32."""

from __future__ import annotations

import torch

from folio.core.executor.quant.formats import int4_to_awq, quantize_int4
from folio.core.executor.quant.gpu import AwqLinear, awq_matmul

# fp32 accumulation in another order, and the output rounded to the activation dtype
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def random_awq(n: int, k: int, group_size: int, seed: int = 0):
    """An ``Int4Weight`` with random codes, zero points and scales on AutoAWQ's grid (fp16 scales)."""
    g = torch.Generator().manual_seed(seed)
    w = quantize_int4(torch.randn(n, k, generator=g) * 0.05, group_size)
    w.scale = w.scale.half().float()  # what an AWQ folder holds
    zero_points = torch.randint(0, 16, w.scale.shape, generator=g).float()
    w.zero = (8.0 - zero_points) * w.scale
    return w


def check_awq_matmul(launcher, dtype, rows: int, n: int, k: int, group_size: int, device="cpu", seed: int = 0):
    w = random_awq(n, k, group_size, seed)
    packed = {name: t.to(device) for name, t in int4_to_awq(w).items()}
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(device)
    got = awq_matmul(launcher, x, packed["qweight"], packed["qzeros"], packed["scales"], group_size)
    want = x.float() @ w.dequantize().to(device).t()
    assert got.dtype == dtype and got.shape == (rows, n)
    scale = want.abs().max().item()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol * scale, rtol=tol)


def check_awq_linear(launcher, dtype, device="cpu"):
    """The layer: 3-D input, bias, both paths."""
    w = random_awq(96, 128, 32, seed=5)
    bias = torch.randn(96).to(dtype).to(device)
    layer = AwqLinear(w, bias, launcher, torch.device(device))
    for rows in (2, 12):
        x = torch.randn(rows, 3, 128).to(dtype).to(device)
        want = (x.float() @ w.dequantize().to(device).t() + bias.float())
        got = layer(x)
        assert got.shape == (rows, 3, 96)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)
