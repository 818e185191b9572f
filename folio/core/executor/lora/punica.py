"""The batched LoRA delta, Punica's operators in torch ops.

Every token of a step may use a different adapter (or none). The adapters on the device sit in
``max_loras`` slots: for each projection, ``lora_a`` ``[slots, r_max, in]`` and ``lora_b``
``[slots, out, r_max]``, ranks zero-padded. Punica's two operators add each token's delta:

- ``bgmv`` (decode): a slot index per token (``-1``: the base model, no delta);
- ``sgmv`` (prefill chunks): contiguous row segments, a slot per segment.

More in docs/modules.md (folio/core/executor/lora/punica.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from folio.core.executor.kernels import lora_kernels


def _add_grouped(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 groups, scales, widths=None) -> torch.Tensor:
    """``groups``: (slot, rows) with rows None (every row), a slice or an int64 index tensor;
    ``scales``: per slot (floats); ``widths``: per slot, the stacked rank actually used (the
    rest of the padded rank is zeros and is skipped)."""
    for slot, rows in groups:
        a, b = lora_a[slot], lora_b[slot]
        if widths is not None:
            w = int(widths[slot])
            if w == 0:
                continue
            a, b = a[:w], b[:, :w]
        xs = x if rows is None else (x[rows] if isinstance(rows, slice) else x.index_select(0, rows))
        if xs.dtype != a.dtype:
            xs = xs.to(a.dtype)
        delta = (xs @ a.T) @ b.T
        scale = float(scales[slot])
        if scale != 1.0:
            delta.mul_(scale)
        delta = delta.to(y.dtype)
        if rows is None:
            y.add_(delta)
        elif isinstance(rows, slice):
            y[rows] += delta
        else:
            y.index_add_(0, rows, delta)
    return y


def _groups_of(indices: np.ndarray):
    """(slot, rows) for each distinct slot >= 0 of a per-row slot index: a slice where the slot's
    rows are one contiguous run, all rows as None."""
    groups = []
    if len(indices) == 0:
        return groups
    order = np.argsort(indices, kind="stable")
    sorted_idx = indices[order]
    bounds = np.flatnonzero(np.diff(sorted_idx)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [len(indices)]])
    for s, e in zip(starts.tolist(), ends.tolist()):
        slot = int(sorted_idx[s])
        if slot < 0:
            continue
        rows = order[s:e]
        if e - s == len(indices):
            groups.append((slot, None))
        elif int(rows[-1]) - int(rows[0]) == e - s - 1:
            groups.append((slot, slice(int(rows[0]), int(rows[-1]) + 1)))
        else:
            groups.append((slot, rows))
    return groups


def _torch_groups(groups, device):
    return [(slot, rows if rows is None or isinstance(rows, slice) else torch.as_tensor(rows, device=device))
            for slot, rows in groups]


def bgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor,
         scales: torch.Tensor) -> torch.Tensor:
    """For each row t with ``indices[t] >= 0``: ``y[t] += scales[s] * (x[t] @ lora_a[s].T) @ lora_b[s].T``
    with ``s = indices[t]``; ``y`` ``[n, out]`` in place (and returned), ``x`` ``[n, in]``,
    ``indices`` int64 ``[n]``, ``scales`` ``[slots]``."""
    if y.is_cuda and lora_kernels.applies(y, x, lora_a, lora_b):
        return lora_kernels.bgmv(y, x, lora_a, lora_b, indices, scales)
    groups = _torch_groups(_groups_of(indices.cpu().numpy()), y.device)
    return _add_grouped(y, x, lora_a, lora_b, groups, scales.tolist())


def sgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor,
         seg_slots: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``bgmv`` over contiguous row segments: segment i is rows ``seg_starts[i]:seg_starts[i + 1]``
    (``seg_starts`` ``[num_segments + 1]``) and uses slot ``seg_slots[i]`` (``-1``: none)."""
    if y.is_cuda and lora_kernels.applies(y, x, lora_a, lora_b):
        return lora_kernels.sgmv(y, x, lora_a, lora_b, seg_starts, seg_slots, scales)
    starts = seg_starts.cpu().numpy().astype(np.int64)
    slots = seg_slots.cpu().numpy().astype(np.int64)
    indices = np.repeat(slots, np.diff(starts))
    full = np.full(y.shape[0], -1, dtype=np.int64)
    full[starts[0] : starts[0] + len(indices)] = indices
    groups = _torch_groups(_groups_of(full), y.device)
    return _add_grouped(y, x, lora_a, lora_b, groups, scales.tolist())


DENSE_MAX_TOKENS = 256  # steps of up to this many tokens over 2+ adapters take the one-GEMM path


@dataclass
class LoRABatch:
    """One step's adapter index, built once and read by every projection of every layer.

    ``indices`` is each token's slot (``-1``: none), ``seg_starts``/``seg_slots`` the same as
    segments (one per scheduled sequence), ``decode`` whether every segment is one token.
    ``scales`` per slot; ``widths[projection]`` per slot the stacked rank in use."""

    indices: torch.Tensor  # [num_tokens] int64, on the device
    seg_starts: torch.Tensor  # [num_seqs + 1] int64
    seg_slots: torch.Tensor  # [num_seqs] int64
    decode: bool
    scales: torch.Tensor  # [slots]
    groups: list  # (slot, rows) for the torch path
    scale_list: list[float]
    widths: dict[str, list[int]]
    token_scale: torch.Tensor | None = None  # [n, k]: each token's scale in its slot's column (the dense path)
    _masks: dict | None = None  # the dense path's masks by rank width

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """``[n, k * width]``: each token's ``token_scale`` repeated over its slot's ``width`` columns."""
        if self._masks is None:
            self._masks = {}
        m = self._masks.get((width, dtype))
        if m is None:
            n, k = self.token_scale.shape
            m = self.token_scale[:, :, None].expand(n, k, width).reshape(n, k * width).to(dtype)
            self._masks[(width, dtype)] = m
        return m

    @staticmethod
    def build(seq_slots: np.ndarray, counts: np.ndarray, scales: torch.Tensor, widths: dict[str, list[int]],
              device: torch.device) -> "LoRABatch":
        """From each scheduled sequence's slot and token count (vectorised: no loop over them)."""
        seg_starts = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=seg_starts[1:])
        indices = np.repeat(seq_slots.astype(np.int64), counts)
        groups = _groups_of(indices)
        token_scale = None
        if device.type == "cpu" and len(groups) > 1 and len(indices) <= DENSE_MAX_TOKENS:
            k = max(slot for slot, _ in groups) + 1
            onehot = np.zeros((len(indices), k), dtype=np.float32)
            rows = np.flatnonzero(indices >= 0)
            onehot[rows, indices[rows]] = scales.numpy()[indices[rows]]
            token_scale = torch.from_numpy(onehot)
        return LoRABatch(
            indices=torch.as_tensor(indices, device=device), seg_starts=torch.as_tensor(seg_starts, device=device),
            seg_slots=torch.as_tensor(seq_slots.astype(np.int64), device=device),
            decode=bool(len(counts) == int(seg_starts[-1])), scales=scales,
            groups=_torch_groups(groups, device), scale_list=scales.tolist(), widths=widths, token_scale=token_scale)

    def apply(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              projection: str, lora_b_t: torch.Tensor | None = None) -> torch.Tensor:
        """Add the step's delta of one projection to its output ``y`` (in place); ``lora_b_t``:
        ``lora_b`` transposed to ``[slots, r_max, out]`` (the CPU's one-GEMM path)."""
        if y.is_cuda:
            if self.decode:
                return bgmv(y, x, lora_a, lora_b, self.indices, self.scales)
            return sgmv(y, x, lora_a, lora_b, self.seg_starts, self.seg_slots, self.scales)
        if self.token_scale is not None and lora_b_t is not None:
            k, width = self.token_scale.shape[1], lora_a.shape[1]
            xs = x if x.dtype == lora_a.dtype else x.to(lora_a.dtype)
            xa = (xs @ lora_a[:k].reshape(k * width, -1).T).mul_(self.mask(width, xs.dtype))
            delta = xa @ lora_b_t[:k].reshape(k * width, -1)
            return y.add_(delta.to(y.dtype))
        return _add_grouped(y, x, lora_a, lora_b, self.groups, self.scale_list, self.widths.get(projection))
