"""folio's own quantized GEMM for the CPU (``kernels/csrc/qgemm.c``): weights packed once here, activations
quantized to int8 per block of 32 inside each call, integer dot products (AVX-512 VNNI or AVX2).

Decode on a CPU reads every weight once per step, so its speed is the weights' bytes over the
memory bandwidth: int4 weights with fp16 scales and minima (0.625 bytes a weight, GGUF's Q4_1) and
an int8 LM head (1.0625 bytes). torch's packed int4 kernel, which this replaces on the CPU, spent
45 us on a call that reads 276 KB (SmolLM2's q/k/v projection), a fifth of the bandwidth; the
integer inner loop here keeps up with the memory at one to a few rows, and reads the weights once
for up to 64 rows (batched decode, prefill chunks).

``pack_int4`` and ``pack_int8`` lay a weight out as ``qgemm.c`` reads it (tiles of 16 output rows,
blocks of 32 inputs); ``QGemm`` holds the packed bytes and calls the kernel, with each input block in
two int8 passes (the value, then its rounding error: about 15 bits; one pass, llama.cpp's way, cost
SmolLM2 2.9e-3 of KLD against the dequantized weights where bf16 activations cost under 1e-3) or
one (the LM head, whose top logits are recomputed exactly anyway). Every row of a call is
computed on its own, in one order, on every instruction set: the result of a row does not depend
on the rows beside it (batch invariance) nor on the machine's vector width (AVX-512 and AVX2 give
the same bits; tested).
"""

from __future__ import annotations

import torch

from folio.core.executor.kernels import cpu_kernels
from folio.core.executor.quant.formats import Int4Weight

TILE = 16  # output rows per tile (qgemm.c's TILE)
BLOCK = 32  # inputs per block, each with its own scales


def _aligned_bytes(parts: torch.Tensor) -> torch.Tensor:
    """``parts`` as a flat uint8 tensor at a 64-byte aligned address."""
    flat = parts.contiguous().view(torch.uint8).reshape(-1)
    buf = torch.empty(flat.numel() + 64, dtype=torch.uint8)
    offset = (-buf.data_ptr()) % 64
    out = buf[offset:offset + flat.numel()]
    out.copy_(flat)
    return out


def _tiles(t: torch.Tensor, n: int) -> torch.Tensor:
    """Rows padded with zeros to a multiple of TILE."""
    pad = (-n) % TILE
    return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t


def _block_scales(per_group: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K / group] -> [N, K / 32]: a group of 64 or 128 repeats its scale over its blocks."""
    return per_group.repeat_interleave(group_size // BLOCK, dim=1) if group_size != BLOCK else per_group


def _tile_halves(v: torch.Tensor, tiles: int, blocks: int) -> torch.Tensor:
    """[N_padded, K / 32] fp32 -> [tiles, blocks, 32] bytes: each tile's 16 fp16 values per block."""
    return v.view(tiles, TILE, blocks).permute(0, 2, 1).to(torch.float16).contiguous().view(torch.uint8)


def pack_int4(w: Int4Weight) -> torch.Tensor:
    """``w`` (``(q - 8) scale + zero``) as qgemm.c's int4 blocks: nibbles, fp16 ``d = scale`` and
    fp16 ``m = zero - 8 scale`` (so ``w = d q + m``)."""
    n, k = w.q.shape
    if k % BLOCK or w.group_size % BLOCK:
        raise ValueError(f"qgemm takes inputs in blocks of {BLOCK} (K={k}, group {w.group_size})")
    blocks, tiles = k // BLOCK, (n + TILE - 1) // TILE
    scale = _block_scales(w.scale.float(), w.group_size)
    minimum = _block_scales(w.zero.float(), w.group_size) - 8.0 * scale
    q = _tiles(w.q.to(torch.uint8), n).view(tiles, TILE, blocks, 4, 2, 4)  # [t, r, b, chunk, half, j]
    nibbles = q[..., 0, :] | (q[..., 1, :] << 4)  # [t, r, b, chunk, j]
    nibbles = nibbles.permute(0, 2, 3, 1, 4).reshape(tiles, blocks, 256)
    d = _tile_halves(_tiles(scale, n), tiles, blocks)
    m = _tile_halves(_tiles(minimum, n), tiles, blocks)
    return _aligned_bytes(torch.cat([nibbles, d, m], dim=2))


def pack_int8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """int8 blocks ``w = d q`` (q [N, K] in -127..127, d [N, K / 32]) as qgemm.c's int8 blocks."""
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"qgemm takes inputs in blocks of {BLOCK} (K={k})")
    blocks, tiles = k // BLOCK, (n + TILE - 1) // TILE
    values = _tiles(q.to(torch.int8), n).view(tiles, TILE, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    values = values.reshape(tiles, blocks, 512).view(torch.uint8)
    return _aligned_bytes(torch.cat([values, _tile_halves(_tiles(d.float(), n), tiles, blocks)], dim=2))


def int8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 blocks of 32 (GGUF's Q8_0): q [N, K] int8, d [N, K / 32] with d = max|w| / 127,
    d rounded to fp16 first (as it is stored)."""
    n, k = weight.shape
    groups = weight.float().view(n, k // BLOCK, BLOCK)
    d = (groups.abs().amax(-1) / 127.0).half().float()
    q = torch.where(d[..., None] > 0, torch.round(groups / d.clamp(min=1e-30)[..., None]), 0).clamp(-127, 127)
    return q.to(torch.int8).view(n, k), d


def available() -> bool:
    return cpu_kernels.library() is not None


class QGemm:
    """A packed weight ``[n, k]`` (int4 or int8) and its product with fp32 or bf16 rows."""

    def __init__(self, kind: int, packed: torch.Tensor, n: int, k: int, lib=None, passes: int = 2):
        self.kind, self.packed, self.n, self.k, self.passes = kind, packed, n, k, passes
        self.lib = lib or cpu_kernels.library()
        self._call = self.lib.folio_qgemm
        self._ptr = packed.data_ptr()
        if self.lib.folio_qgemm_threads() < torch.get_num_threads():
            self.lib.folio_qgemm_set_threads(torch.get_num_threads())

    @classmethod
    def int4(cls, w: Int4Weight, lib=None, passes: int = 2) -> QGemm:
        return cls(4, pack_int4(w), *w.q.shape, lib=lib, passes=passes)

    @classmethod
    def int8(cls, q: torch.Tensor, d: torch.Tensor, lib=None, passes: int = 2) -> QGemm:
        return cls(8, pack_int8(q, d), *q.shape, lib=lib, passes=passes)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, threads: int = 0) -> torch.Tensor:
        """x [m, k] (fp32 or bf16, unit stride along k) -> [m, n] in ``out_dtype`` (x's by default)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty((m, self.n), dtype=out_dtype or x.dtype)
        if m:
            self._call(self.kind, m, self.n, self.k, x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16),
                       self._ptr, y.data_ptr(), self.n, int(y.dtype == torch.bfloat16), threads, self.passes)
        return y


def reference(kind: int, x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
              passes: int = 2) -> torch.Tensor:
    """What the kernel computes, in float64, for the tests: x quantized per row and block as the
    kernel does (``xq`` and, with two passes, ``xq2`` of its rounding error times 254), then
    ``sum_b d dot(q, dx xq + dx / 254 xq2) + m sx`` (``m`` None for int8). ``q`` [N, K] (0..15 or
    -127..127), ``d``/``m`` [N, K / 32] as stored (fp16 values)."""
    rows, k = x.shape
    xb = x.float().view(rows, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1)
    dx = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    t = xb * inv[..., None]

    def rnd(v):  # half away from zero, as the kernel's roundf
        return torch.sign(v) * torch.floor(v.abs() + 0.5)

    xq = rnd(t)
    value = dx.double()[..., None] * xq.double()
    if passes > 1:
        xq2 = rnd((t - xq) * 254.0)
        value = value + (dx / 254.0).double()[..., None] * xq2.double()
    qb = q.double().view(q.shape[0], k // BLOCK, BLOCK)
    out = torch.einsum("rbj,nbj,nb->rn", value, qb, d.double())
    if m is not None:
        out += torch.einsum("rb,nb->rn", value.sum(-1), m.double())
    return out
