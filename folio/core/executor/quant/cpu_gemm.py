"""Quantized weights for the CPU kernels (``kernels/csrc/quant.c``): GGUF's block types repacked into
tiles of 16 rows, and their product with fp32 or bf16 rows through int8 activations.

``PackedWeight`` is a projection's weight as the kernels read it: one or more parts stacked along the
output rows (a fused q/k/v may mix types, as a Q4_K_M file's do), each a type's tiles. It is made
from a GGUF tensor's raw blocks (``from_gguf``: lossless, in C), or from folio's own int4/int8
weights (``from_int4``: Q4_1's tiles, ``from_int8``: Q8_0's). ``QGemm`` multiplies with it,
quantizing each call's rows to int8 per block of 32 in one pass or two (docs/quantization.md).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from folio.core.executor.kernels import cpu_kernels
from folio.core.executor.quant.formats import Int4Weight

TILE = 16  # output rows per tile (folio.h's FOLIO_TILE)
BLOCK = 32  # inputs per block of the activations (and of the simple types)
# GGML's type ids, as folio.h names them; the types the kernels read
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
         "IQ4_NL": 20, "IQ4_XS": 23}
TYPE_NAMES = {v: k for k, v in TYPES.items()}
UNITS = {t: 256 if t in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS") else 32 for t in TYPES}  # inputs per unit


def available() -> bool:
    return cpu_kernels.library() is not None


def _lib(lib=None):
    lib = lib or cpu_kernels.library()
    if lib is None:
        raise RuntimeError("the CPU kernels are unavailable (no C compiler)")
    return lib


def _aligned_bytes(parts: torch.Tensor) -> torch.Tensor:
    """``parts`` as a flat uint8 tensor at a 64-byte aligned address."""
    flat = parts.contiguous().view(torch.uint8).reshape(-1)
    out = _aligned_empty(flat.numel())
    out.copy_(flat)
    return out


def _aligned_empty(nbytes: int) -> torch.Tensor:
    buf = torch.empty(nbytes + 64, dtype=torch.uint8)
    offset = (-buf.data_ptr()) % 64
    return buf[offset:offset + nbytes]


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
    """``w`` (``(q - 8) scale + zero``) as Q4_1's tiles: nibbles, fp16 ``d = scale`` and fp16
    ``m = zero - 8 scale`` (so ``w = d q + m``)."""
    n, k = w.q.shape
    if k % BLOCK or w.group_size % BLOCK:
        raise ValueError(f"the kernels take inputs in blocks of {BLOCK} (K={k}, group {w.group_size})")
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
    """int8 blocks ``w = d q`` (q [N, K] in -127..127, d [N, K / 32]) as Q8_0's tiles."""
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"the kernels take inputs in blocks of {BLOCK} (K={k})")
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


@dataclass
class WeightPart:
    type: int  # TYPES' id
    n: int  # rows
    tiles: torch.Tensor  # uint8, 64-byte aligned


class PackedWeight:
    """A projection's weight [n, k] for the kernels: parts stacked along the rows."""

    def __init__(self, parts: list[WeightPart], k: int):
        if not 1 <= len(parts) <= cpu_kernels.MAX_PARTS:
            raise ValueError(f"a weight of {len(parts)} parts (at most {cpu_kernels.MAX_PARTS})")
        self.parts, self.k = parts, k
        self.n = sum(p.n for p in parts)
        self._struct = None

    @classmethod
    def from_int4(cls, w: Int4Weight) -> PackedWeight:
        return cls([WeightPart(TYPES["Q4_1"], w.q.shape[0], pack_int4(w))], w.q.shape[1])

    @classmethod
    def from_int8(cls, q: torch.Tensor, d: torch.Tensor) -> PackedWeight:
        return cls([WeightPart(TYPES["Q8_0"], q.shape[0], pack_int8(q, d))], q.shape[1])

    @classmethod
    def from_gguf(cls, type_name: str, raw: np.ndarray, k: int, order: np.ndarray | None = None,
                  lib=None) -> PackedWeight:
        """GGUF rows ``raw`` ([n, bytes a row] uint8, the file's blocks) of a ``type_name`` tensor with
        ``k`` inputs, losslessly; tile row i is raw row ``order[i]`` (None: i)."""
        lib = _lib(lib)
        if type_name not in TYPES:
            raise ValueError(f"GGUF type {type_name} has no kernel; folio's are {', '.join(TYPES)}")
        kind = TYPES[type_name]
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        n = raw.shape[0]
        size = lib.folio_tiles_bytes(kind, n, k)
        if size < 0:
            raise ValueError(f"a {type_name} weight of {k} inputs is not whole units of {UNITS[type_name]}")
        tiles = _aligned_empty(size)
        if order is not None:
            order = np.ascontiguousarray(order, dtype=np.int64)
        cpu_kernels.check(lib, lib.folio_repack(kind, n, k, raw.ctypes.data, raw.shape[1],
                                                None if order is None else order.ctypes.data, tiles.data_ptr(), size))
        return cls([WeightPart(kind, n, tiles)], k)

    @staticmethod
    def cat(weights: list[PackedWeight]) -> PackedWeight:
        """Stacked along the rows (fused q/k/v, gate/up): the parts side by side, nothing copied
        (the kernels share one call's work over every part's tiles)."""
        if len({w.k for w in weights}) != 1:
            raise ValueError("fused projections with different inputs")
        return PackedWeight([p for w in weights for p in w.parts], weights[0].k)

    @property
    def types(self) -> list[str]:
        """The parts' types, each once, in order."""
        return list(dict.fromkeys(TYPE_NAMES[p.type] for p in self.parts))

    @property
    def nbytes(self) -> int:
        return sum(p.tiles.numel() for p in self.parts)

    @property
    def struct(self) -> cpu_kernels.Weight:
        """folio.h's ``folio_weight`` for these parts (made once; the tensors outlive it)."""
        if self._struct is None:
            parts = [cpu_kernels.Part(type=p.type, n=p.n, nbytes=p.tiles.numel(), data=p.tiles.data_ptr())
                     for p in self.parts]
            self._struct = cpu_kernels.Weight(n=self.n, k=self.k, num_parts=len(parts),
                                              parts=(cpu_kernels.Part * cpu_kernels.MAX_PARTS)(*parts))
        return self._struct

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_struct": None}  # addresses of this process

    def rows(self, ids: torch.Tensor, lib=None) -> torch.Tensor:
        """Rows ``ids`` of the weight, fp32 [len(ids), k]: the values GGUF's own dequantization gives
        (an embedding lookup). The kernel refuses an id outside the weight (IndexError)."""
        lib = _lib(lib)
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty((ids.numel(), self.k), dtype=torch.float32)
        if len(self.parts) == 1:  # an embedding table: one call
            p = self.parts[0]
            cpu_kernels.check(lib, lib.folio_dequant_rows(p.type, p.n, self.k, p.tiles.data_ptr(), p.tiles.numel(),
                                                          ids.data_ptr(), ids.numel(), out.data_ptr()))
            return out
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.n):
            raise IndexError(f"rows outside the weight's {self.n}")
        start = 0
        for p in self.parts:
            mine = (ids >= start) & (ids < start + p.n)
            if bool(mine.any()):
                local = (ids[mine] - start).contiguous()
                part = torch.empty((local.numel(), self.k), dtype=torch.float32)
                cpu_kernels.check(lib, lib.folio_dequant_rows(p.type, p.n, self.k, p.tiles.data_ptr(), p.tiles.numel(),
                                                              local.data_ptr(), local.numel(), part.data_ptr()))
                out[mine] = part
            start += p.n
        return out

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.n))


class QGemm:
    """``y = x W^T`` for a ``PackedWeight`` W, activations in ``passes`` int8 passes (1 or 2)."""

    def __init__(self, weight: PackedWeight, passes: int = 2, lib=None):
        if passes not in (1, 2):
            raise ValueError(f"passes must be 1 or 2, not {passes}")
        self.weight, self.passes = weight, passes
        self.lib = _lib(lib)
        self.n, self.k = weight.n, weight.k
        self._wref = ctypes.byref(weight.struct)
        cpu_kernels.check(self.lib, self.lib.folio_check_weight(self._wref))
        if self.lib.folio_threads() < torch.get_num_threads():
            self.lib.folio_set_threads(torch.get_num_threads())

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, threads: int = 0) -> torch.Tensor:
        """x [m, k] (fp32 or bf16 CPU rows) -> [m, n] in ``out_dtype`` (x's by default)."""
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"x must be [rows, {self.k}], not {list(x.shape)}")
        if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
            raise TypeError(f"x must be fp32 or bf16 on the CPU, not {x.dtype} on {x.device}")
        out_dtype = out_dtype or x.dtype
        if out_dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"the output must be fp32 or bf16, not {out_dtype}")
        if x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty((m, self.n), dtype=out_dtype)
        if m:
            bf16 = torch.bfloat16
            xm = cpu_kernels.Matrix(data=x.data_ptr(), rows=m, cols=self.k, stride=x.stride(0), dtype=int(x.dtype == bf16))
            ym = cpu_kernels.Matrix(data=y.data_ptr(), rows=m, cols=self.n, stride=self.n, dtype=int(out_dtype == bf16))
            cpu_kernels.check(self.lib, self.lib.folio_gemm(self._wref, ctypes.byref(xm), ctypes.byref(ym),
                                                            self.passes, threads))
        return y


def quantized_activations(x: torch.Tensor, passes: int = 2) -> torch.Tensor:
    """What the kernels multiply the weights with, in float64, for the tests: each row's blocks of
    32 rounded to int8 as the kernels do (``xq`` and, with two passes, ``xq2`` of its rounding error
    times 254), ``dx xq + dx / 254 xq2``."""
    rows, k = x.shape
    xb = x.float().view(rows, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1)
    # divisions as the kernel rounds them (torch's float32 scalar / tensor is not correctly rounded;
    # float64's, rounded to float32, is)
    dx = (amax.double() / 127.0).float()
    inv = torch.where(amax > 0, (127.0 / amax.double()).float(), torch.zeros_like(amax))
    t = xb * inv[..., None]

    def rnd(v):  # half away from zero, as the kernel's roundf (in float64: |v| + 0.5 is exact there)
        v = v.double()
        return (torch.sign(v) * torch.floor(v.abs() + 0.5)).float()

    xq = rnd(t)
    value = dx.double()[..., None] * xq.double()
    if passes > 1:
        xq2 = rnd((t - xq) * 254.0)
        value = value + (dx.double() / 254.0).float().double()[..., None] * xq2.double()
    return value.view(rows, k)


def reference(weight: PackedWeight, x: torch.Tensor, passes: int = 2) -> torch.Tensor:
    """What ``QGemm`` computes, in float64: the weight's GGUF values against the quantized rows."""
    return quantized_activations(x, passes) @ weight.dequantize().double().T
