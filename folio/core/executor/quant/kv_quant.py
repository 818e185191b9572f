"""The FP8 KV cache (``--kv-cache-dtype fp8``): an e4m3 pool with per-layer K and V scales, over
K and V in a rotated basis.

vLLM's scheme: each layer has one fp32 scale for K and one for V. A write divides by the scale,
saturates to the e4m3 range (+-448) and rounds to nearest even; a read multiplies by the scale.
The pool costs one byte per element: half of bf16/fp16, a quarter of fp32, so the same byte budget
holds twice (four times) the blocks.

Scales are calibrated once at start, before the pool is sized: the model runs a forward pass over
``CALIBRATION_TEXT`` (a few hundred tokens of prose, code and lists; ids spread over the
vocabulary when the model has no tokenizer) into a scratch pool of the model's dtype, and each
layer's scale is ``CALIBRATION_MARGIN * amax / 448``, amax the largest magnitude of its K (or V)
entries there. The margin leaves room for text whose K/V run larger than the calibration's before
anything saturates; being floating point, e4m3 keeps its relative precision (3 mantissa bits)
across the range, so the margin costs only the few values that fall below its smallest normal
(2^-6 x the scale).

The rotation (QuaRot's, for the KV cache): before the write, each head's q, k and v are multiplied
by one orthogonal ``head_dim x head_dim`` matrix R (the normalised Sylvester-Hadamard matrix when
head_dim is a power of two, else a seeded random orthogonal one), and attention's output by R^T.
(qR).(kR) = q.k and (sum p v R) R^T = sum p v, so the math is unchanged; what changes is e4m3's
error. Its rounding error is relative to each element, so a key whose energy sits in a few channels
(RoPE's slow pairs carry large values that queries share) puts most of a score's error into those
channels' products; rotated, every channel holds about ||k|| / sqrt(head_dim) and the error spreads.
On SmolLM2-135M (2,135 sampled tokens) the rotation took the fp8 pool's mean KLD against fp32 from
7.7e-3 to 4.2e-3 and top-1 agreement from 95.6% to 97.2%; subtracting a calibrated per-channel mean
from K as well gained nothing more. The rotation costs four small matmuls per layer, on fp8 pools only.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
CALIBRATION_MARGIN = 2.0
KV_CACHE_DTYPES = ("auto", "fp8")
CALIBRATION_TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable metal type made "
    "books cheaper than ever before. Within fifty years, presses were at work in more than two hundred "
    "cities across Europe.\n\n"
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = len(items) // 2\n"
    "    return merge(merge_sort(items[:middle]), merge_sort(items[middle:]))\n\n"
    "Shopping list: 3 onions, 2 carrots, 1 kg of potatoes, olive oil, salt, pepper and fresh parsley.\n"
    "Q: What is the capital of Australia? A: Canberra, not Sydney, although many people guess Sydney.\n"
    "SELECT name, age FROM users WHERE age > 30 ORDER BY name;\n"
    "Dear hiring manager, I am writing to apply for the position of data engineer advertised on your site."
)


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type: ``auto`` = the model's dtype, ``fp8`` = e4m3."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; choose {' or '.join(KV_CACHE_DTYPES)}")
    return FP8_DTYPE if kv_cache_dtype == "fp8" else model_dtype


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale, saturated to +-448, rounded to the nearest e4m3 (ties to even)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Pool entries as ``dtype``: e4m3 times its scale (in fp32, then rounded once), others cast."""
    if x.dtype != FP8_DTYPE:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """An fp8 pool's bytes as uint8 (torch's CPU index ops, index_copy_ and gathers, have no e4m3
    kernels; the bytes move the same); other pools as they are."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes gathered through ``raw`` back as the pool's dtype."""
    return t.view(dtype) if t.dtype != dtype else t


def scale_for(amax: float) -> float:
    """The fp32 scale for a tensor whose largest magnitude is ``amax`` (1.0 for an all-zero one)."""
    scale = CALIBRATION_MARGIN * amax / FP8_MAX if amax > 0 else 1.0
    return float(torch.tensor(scale, dtype=torch.float32))


def rotation(head_dim: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> torch.Tensor:
    """An orthogonal ``[head_dim, head_dim]`` matrix: Sylvester's Hadamard matrix over sqrt(head_dim)
    when head_dim is a power of two, else the Q of a seeded Gaussian matrix's QR."""
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        r = h / head_dim**0.5
    else:
        gen = torch.Generator().manual_seed(head_dim)
        r, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
    return r.to(dtype=dtype, device=device)


def set_kv_scales(model, scales: list[tuple[float, float]]) -> None:
    for layer, kv_scales in zip(model.layers, scales):
        layer.self_attn.kv_scales = kv_scales
