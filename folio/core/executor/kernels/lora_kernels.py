"""Multi-LoRA on CUDA: the launch wrappers of ``cuda/lora.cu`` (Punica's BGMV and SGMV).

Both take Punica's shapes (the same as ``folio.core.executor.lora.punica``'s torch ops) and add the
delta into ``y`` in place::

    y[t] += scales[slot] * (x[t] @ lora_a[slot].T) @ lora_b[slot].T

``lora_a [slots, r_max, in]``, ``lora_b [slots, out, r_max]`` (ranks zero-padded to ``r_max``), slot -1 =
no adapter (the row is left alone). x, y, lora_a and lora_b share one dtype (float16, bfloat16 or
float32); accumulation and the ``[rows, r_max]`` intermediate are fp32, and each output is rounded
once (``y + scale * delta`` in fp32).

More in docs/modules.md (folio/core/executor/kernels/lora_kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.kernels.kernel_family import KernelFamily

SOURCE = "lora.cu"
# Mirrors constants of cuda/lora.cu (the tests check they agree).
MAX_RANK = 128  # LORA_MAX_RANK
LORA_BM = 16
LORA_BK = 32
BGMV_SHRINK_THREADS = 128
SGMV_SHRINK_THREADS = 256
EXPAND_THREADS = 128
LORA_DTYPES = ("float32", "float16", "bfloat16")
MMA_DTYPES = ("float16", "bfloat16")  # mma.sync inputs
MMA_THREADS = 128
MMA_BM = 64
MMA_BN = 64
SPLIT_K = 512  # sgmv_shrink: about this many k per split (a 4096-wide input: 8 CTAs per work item)
MAX_SPLITS = 16


@dataclass(frozen=True)
class LoraNames:
    """Name expressions of the LoRA kernels for one dtype."""

    bgmv_shrink: str
    sgmv_shrink: str
    bgmv_expand: str
    sgmv_expand: str
    sgmv_shrink_mma: str | None  # tensor cores: 16-bit types only
    sgmv_expand_mma: str | None


def _lora_names(dtype: str) -> LoraNames:
    t, mma = ck.DTYPES[dtype], dtype in MMA_DTYPES
    return LoraNames(bgmv_shrink=f"folio::bgmv_shrink<{t}>", sgmv_shrink=f"folio::sgmv_shrink<{t}>",
                     bgmv_expand=f"folio::lora_expand<{t}, false>", sgmv_expand=f"folio::lora_expand<{t}, true>",
                     sgmv_shrink_mma=f"folio::sgmv_shrink_mma<{t}>" if mma else None,
                     sgmv_expand_mma=f"folio::sgmv_expand_mma<{t}>" if mma else None)


FAMILY = KernelFamily("LoRA kernels", SOURCE, LORA_DTYPES, _lora_names,
                         needs_cupy="LoRA on a GPU runs folio's LoRA kernels")
lora_names = FAMILY.names  # the instances one dtype asks for
all_name_expressions = FAMILY.all_name_expressions
module_source = FAMILY.module_source
cupy_launcher = FAMILY.launcher


def shape_problems(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> list[str]:
    """What keeps these tensors off the kernels (empty: they apply)."""
    problems = []
    dtype = str(x.dtype).removeprefix("torch.")
    if dtype not in LORA_DTYPES:
        problems.append(f"dtype {dtype}")
    if any(t.dtype != x.dtype for t in (y, lora_a, lora_b)):
        problems.append(f"mixed dtypes (y {y.dtype}, x {x.dtype}, lora_a {lora_a.dtype}, lora_b {lora_b.dtype})")
    if x.dim() != 2 or y.dim() != 2 or lora_a.dim() != 3 or lora_b.dim() != 3:
        return problems + ["x and y must be 2-D, lora_a and lora_b 3-D"]
    n, k_in = x.shape
    slots, r_max, a_in = lora_a.shape
    if y.shape[0] != n or a_in != k_in or tuple(lora_b.shape) != (slots, y.shape[1], r_max):
        problems.append(f"shapes y {tuple(y.shape)}, x {tuple(x.shape)}, lora_a {tuple(lora_a.shape)}, "
                        f"lora_b {tuple(lora_b.shape)} do not agree")
    if k_in % 8:
        problems.append(f"input size {k_in} is not a multiple of 8")
    if r_max % 8 or not 0 < r_max <= MAX_RANK:
        problems.append(f"rank {r_max} (a multiple of 8, at most {MAX_RANK})")
    if y.shape[1] and y.stride(1) != 1:
        problems.append("y's columns are not contiguous")
    return problems


def applies(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> bool:
    return not shape_problems(y, x, lora_a, lora_b)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _prepare(y, x, lora_a, lora_b, scales, op: str):
    problems = shape_problems(y, x, lora_a, lora_b)
    if problems:
        raise ValueError(f"{op}: the LoRA kernels cannot take this: " + "; ".join(problems))
    vec = 16 // x.element_size()
    if x.stride(1) != 1 or x.stride(0) % vec or x.data_ptr() % 16:
        x = x.contiguous()
    if not lora_a.is_contiguous() or lora_a.data_ptr() % 16:
        lora_a = lora_a.contiguous()
    if not lora_b.is_contiguous() or lora_b.data_ptr() % 16:
        lora_b = lora_b.contiguous()
    if not isinstance(scales, torch.Tensor):
        scales = torch.tensor(scales, dtype=torch.float32)
    scales = scales.to(device=x.device, dtype=torch.float32, non_blocking=True).contiguous()
    return x, lora_a, lora_b, scales


def _index(t, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        t = torch.tensor(t, dtype=torch.int64)
    return t.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()


def bgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor,
         scales: torch.Tensor, *, launcher=None) -> torch.Tensor:
    """``y[t] += scales[indices[t]] * (x[t] @ lora_a[indices[t]].T) @ lora_b[indices[t]].T`` for every
    row with ``indices[t] >= 0``, in place; returns y."""
    x, lora_a, lora_b, scales = _prepare(y, x, lora_a, lora_b, scales, "bgmv")
    n, k_in = x.shape
    out, r_max = y.shape[1], lora_a.shape[1]
    if n == 0 or out == 0:
        return y
    launcher = launcher or cupy_launcher(x.device)
    names = lora_names(str(x.dtype).removeprefix("torch."))
    indices = _index(indices, x.device)
    part = torch.empty(n, r_max, dtype=torch.float32, device=x.device)
    warps = BGMV_SHRINK_THREADS // 32
    launcher.launch(names, "bgmv_shrink", (n, -(-r_max // warps), 1), (BGMV_SHRINK_THREADS, 1, 1),
                    [_ptr(part), _ptr(x), _ptr(lora_a), _ptr(indices), np.int32(k_in), np.int32(r_max),
                     np.int64(x.stride(0))], x.device)
    launcher.launch(names, "bgmv_expand", (n, -(-out // EXPAND_THREADS), 1), (EXPAND_THREADS, 1, 1),
                    [_ptr(y), _ptr(part), _ptr(lora_b), _ptr(scales), _ptr(indices), _ptr(indices), np.int32(0),
                     np.int32(n), np.int32(out), np.int32(r_max), np.int32(1), np.int64(y.stride(0))], x.device)
    return y


def k_splits(k_in: int) -> tuple[int, int]:
    """``(splits, k_per_split)`` of sgmv_shrink: about SPLIT_K inputs per split, whole LORA_BK tiles."""
    splits = max(1, min(MAX_SPLITS, -(-k_in // SPLIT_K)))
    per = -(-k_in // splits)
    per = -(-per // LORA_BK) * LORA_BK
    return -(-k_in // per), per


def sgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor,
         seg_slots: torch.Tensor, scales: torch.Tensor, *, launcher=None,
         tensor_cores: bool | None = None) -> torch.Tensor:
    """The same delta over contiguous row segments: rows ``seg_starts[s]`` to ``seg_starts[s + 1]``
    (or n after the last start) take slot ``seg_slots[s]`` (-1: left alone). In place; returns y.

    ``tensor_cores`` (default: for float16/bfloat16) picks the mma.sync kernels (64-row work items;
    the ``[rows, r_max]`` intermediate is rounded to the dtype before the expand, as Punica's is)
    over the CUDA-core ones (16-row items, fp32 intermediate; the only ones for float32)."""
    x, lora_a, lora_b, scales = _prepare(y, x, lora_a, lora_b, scales, "sgmv")
    n, k_in = x.shape
    out, r_max = y.shape[1], lora_a.shape[1]
    seg_slots = _index(seg_slots, x.device)
    seg_starts = _index(seg_starts, x.device)
    num_segs = seg_slots.numel()
    if seg_starts.numel() == num_segs:
        seg_starts = torch.cat([seg_starts, seg_starts.new_full((1,), n)])
    elif seg_starts.numel() != num_segs + 1:
        raise ValueError(f"sgmv: {seg_starts.numel()} segment starts for {num_segs} segments "
                         f"(expected {num_segs} or {num_segs + 1})")
    if n == 0 or out == 0 or num_segs == 0:
        return y
    dtype = str(x.dtype).removeprefix("torch.")
    names = lora_names(dtype)
    mma = dtype in MMA_DTYPES if tensor_cores is None else bool(tensor_cores)
    if mma and dtype not in MMA_DTYPES:
        raise ck.UnsupportedKernelError(f"no tensor-core LoRA kernels for dtype {dtype}")
    launcher = launcher or cupy_launcher(x.device)
    bm = MMA_BM if mma else LORA_BM
    items = n // bm + num_segs  # >= sum over segments of ceil(len / bm)
    splits, per = k_splits(k_in)
    part = torch.empty(splits, n, r_max, dtype=torch.float32, device=x.device)
    if mma:
        launcher.launch(names, "sgmv_shrink_mma", (items, splits, 1), (MMA_THREADS, 1, 1),
                        [_ptr(part), _ptr(x), _ptr(lora_a), _ptr(seg_starts), _ptr(seg_slots), np.int32(num_segs),
                         np.int32(n), np.int32(k_in), np.int32(r_max), np.int32(per), np.int64(x.stride(0))],
                        x.device)
        launcher.launch(names, "sgmv_expand_mma", (items, -(-out // MMA_BN), 1), (MMA_THREADS, 1, 1),
                        [_ptr(y), _ptr(part), _ptr(lora_b), _ptr(scales), _ptr(seg_starts), _ptr(seg_slots),
                         np.int32(num_segs), np.int32(n), np.int32(out), np.int32(r_max), np.int32(splits),
                         np.int64(y.stride(0))], x.device)
        return y
    launcher.launch(names, "sgmv_shrink", (items, splits, 1), (SGMV_SHRINK_THREADS, 1, 1),
                    [_ptr(part), _ptr(x), _ptr(lora_a), _ptr(seg_starts), _ptr(seg_slots), np.int32(num_segs),
                     np.int32(n), np.int32(k_in), np.int32(r_max), np.int32(per), np.int64(x.stride(0))], x.device)
    launcher.launch(names, "sgmv_expand", (items, -(-out // EXPAND_THREADS), 1), (EXPAND_THREADS, 1, 1),
                    [_ptr(y), _ptr(part), _ptr(lora_b), _ptr(scales), _ptr(seg_starts), _ptr(seg_slots),
                     np.int32(num_segs), np.int32(n), np.int32(out), np.int32(r_max), np.int32(splits),
                     np.int64(y.stride(0))], x.device)
    return y
