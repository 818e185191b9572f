"""The FP8 KV cache (``--kv-cache-dtype fp8``): an e4m3 pool over K and V in a rotated basis, with
per-channel K scales and a K mean shift, and one V scale per layer (``KVScales``).

A write stores a K element as ``(k - k_shift) / k_scale`` and a V element as ``v / v_scale``,
saturated to the e4m3 range (+-448) and rounded to nearest even; a read multiplies by the scale.
Each of ``k_scale``, ``v_scale`` and ``k_shift`` is an fp32 ``[num_kv_heads, head_dim]`` array (V's
holds one value). The pool costs one byte per element: half of bf16/fp16, a quarter of fp32, so
the same byte budget holds twice (four times) the blocks.

More in docs/modules.md (folio/core/executor/kernels/kv_quant.py).
"""

from __future__ import annotations

from typing import NamedTuple

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


class KVScales(NamedTuple):
    """One layer's fp8 pool parameters, fp32 ``[num_kv_heads, head_dim]`` each: a K element is
    stored as ``(k - k_shift) / k_scale``, a V element as ``v / v_scale``; read back as stored x scale
    (the shift is not added back: see the module docstring)."""

    k: torch.Tensor
    v: torch.Tensor
    k_shift: torch.Tensor

    def summary(self) -> tuple[float, float]:
        """(largest K scale, largest V scale): what the executor's stats report per layer."""
        return float(self.k.max()), float(self.v.max())


def split_scales(kv_scales) -> tuple[torch.Tensor | float, torch.Tensor | float, torch.Tensor | None]:
    """(k_scale, v_scale, k_shift or None) of a layer's ``KVScales`` or of a plain (k_scale,
    v_scale) pair (floats or tensors: one scale for the layer, or per head and channel)."""
    if isinstance(kv_scales, KVScales):
        return kv_scales
    k_scale, v_scale = kv_scales
    return k_scale, v_scale, None


def quantize(x: torch.Tensor, scale, shift: torch.Tensor | None = None) -> torch.Tensor:
    """(x - shift) / scale, saturated to +-448, rounded to the nearest e4m3 (ties to even). ``scale``
    (and ``shift``) is a float or a tensor broadcast against x's last dims ([num_kv_heads, head_dim])."""
    x = x.float()
    if shift is not None:
        x = x - shift
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    """Pool entries as ``dtype``: e4m3 times its scale (in fp32, then rounded once), others cast.
    ``scale`` broadcasts against x (a caller with heads before positions shapes it to match)."""
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
    return r.to(dtype=dtype, device=device).contiguous()  # QR's Q is column-major; kernels read rows


def kv_scales_from(k: torch.Tensor, v: torch.Tensor, shift: bool = True) -> KVScales:
    """A layer's scales from its calibration K and V, ``[tokens, num_kv_heads, head_dim]`` each: K's
    shift is its per-channel mean over the tokens (``shift``; else zeros), K's scale per channel
    (``scale_for`` of the shifted channel's amax); V's one scale for the layer."""
    k, v = k.float(), v.float()
    k_shift = k.mean(0) if shift else torch.zeros_like(k[0])
    k_amax = (k - k_shift).abs().amax(0)
    k_scale = torch.where(k_amax > 0, CALIBRATION_MARGIN * k_amax / FP8_MAX, torch.ones_like(k_amax))
    v_scale = torch.full_like(k_shift, scale_for(v.abs().max().item()))
    return KVScales(k_scale.contiguous(), v_scale.contiguous(), k_shift.contiguous())


class DeviceScales:
    """fp8 pool scales as the CUDA kernels read them: fp32 ``[num_kv_heads, head_dim]`` arrays,
    contiguous, on the pool's device. A layer's ``KVScales`` are used as they are (they outlive every
    launch and CUDA graph that reads them); a float, or a tensor of another shape, dtype or device,
    is spread once and kept (with its source, so that its id stays its own)."""

    def __init__(self):
        self._spread: dict[tuple, tuple] = {}

    def pointers(self, k_cache: torch.Tensor, kv_scales, with_shift: bool = False) -> tuple[int, ...]:
        """(k_scale, v_scale[, k_shift]) addresses for a pool; 0 (null) for a pool of the
        activations' type, and for a layer without a K shift."""
        if k_cache.dtype != FP8_DTYPE:
            return (0,) * (3 if with_shift else 2)
        shape = tuple(k_cache.shape[2:])
        parts = split_scales(kv_scales)
        parts = parts if with_shift else parts[:2]
        return tuple(0 if t is None else self.tensor(t, shape, k_cache.device).data_ptr() for t in parts)

    def tensor(self, value, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        if isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.device == device \
                and tuple(value.shape) == shape and value.is_contiguous():
            return value
        key = (value_key(value), shape, str(device))
        if key not in self._spread:
            spread = torch.as_tensor(value, dtype=torch.float32).expand(shape).contiguous().to(device)
            self._spread[key] = (value, spread)
        return self._spread[key][1]


def value_key(value) -> tuple:
    """A float scale by value, a tensor by identity and address (a layer's scales stay put)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value.data_ptr(), tuple(value.shape), str(value.dtype))
    return ("float", float(value))


def scales_key(kv_scales) -> tuple:
    """A hashable key for a layer's scales (launch arguments are cached by it)."""
    return tuple(None if t is None else value_key(t) for t in split_scales(kv_scales))


def scales_fingerprint(kv_scales) -> str:
    """A short digest of one layer's scales (a KVScales, or a (k, v) pair of floats): the bytes in an
    fp8 pool mean the same on two sides (a KV transfer, the disk tier) only where these agree."""
    import hashlib
    import struct

    digest = hashlib.sha256()
    for t in split_scales(kv_scales):
        if t is None:
            digest.update(b"-")
        elif isinstance(t, torch.Tensor):
            t = t.detach().float().cpu().contiguous()
            digest.update(repr(tuple(t.shape)).encode() + t.numpy().tobytes())
        else:
            digest.update(struct.pack("<f", float(t)))
    return digest.hexdigest()[:16]


def set_kv_scales(model, scales: list[KVScales]) -> None:
    for layer, kv_scales in zip(model.layers, scales):
        layer.self_attn.kv_scales = kv_scales
