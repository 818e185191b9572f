"""The kernel attention backend, independent of how its kernels get launched.

Same methods as ``TorchAttentionBackend`` (``plan``, ``write_kv``, ``attend``, ``copy_blocks``) plus
``swap_out``/``swap_in``, implemented by launching the kernels of ``cuda/`` through a *launcher*:
on a GPU the CuPy launcher of ``cuda_backend`` (torch's current stream, raw device pointers); in
the tests the CPU emulation (tests/cuda), which runs the same kernel sources on CPU tensors. All
planning and argument marshalling lives here, so the emulation exercises it too.

A launcher provides ``launch(names, kernel, grid, block, args, device)`` (``kernel`` is a field of
``KernelNames``; ``args`` are numpy scalars in the kernel's parameter order, pointers as uint64),
``device_address(tensor)`` (the address a kernel can use; a pinned host tensor is mapped), and
``num_sms``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from services.executor import cuda_kernels as ck
from services.executor.attention import AttentionMetadata

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

# The split (partitioned) path pays a second launch and a round trip through fp32 partials; it
# wins when the unsplit grid cannot fill the GPU, or for very long contexts (vLLM's v1/v2 rule
# uses 8192 too).
SPLIT_ABOVE_SEQ_LEN = 8192
MIN_BLOCKS_PER_SM = 2


def _ptr(tensor: torch.Tensor) -> np.uint64:
    return np.uint64(tensor.data_ptr())


@dataclass
class KernelPlan:
    """What one step needs for a given GQA shape, built once and shared by every layer."""

    group: int
    work: torch.Tensor  # [num_work, 2] int32: (sequence, first row), rows = (token, head in group)
    num_work: int
    num_partitions: int
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # reused by every layer


def work_items(query_lens: list[int], group: int, rows_per_block: int = ck.ATTN_ROWS) -> list[tuple[int, int]]:
    """(sequence, first row) of every CUDA block along grid y; a sequence has q_len * group rows."""
    items = []
    for seq, q_len in enumerate(query_lens):
        items.extend((seq, row0) for row0 in range(0, q_len * group, rows_per_block))
    return items


class KernelAttentionBackend:
    name = "cuda"

    def __init__(self, launcher, model_dtype: torch.dtype, split: bool | None = None,
                 partition_size: int = 512):
        if model_dtype not in DTYPE_NAMES:
            raise ck.UnsupportedKernelError(f"no CUDA kernels for dtype {model_dtype}; built: {list(DTYPE_NAMES)}")
        self.launcher = launcher
        self.model_dtype = model_dtype
        self.split = split  # None: decide per step; True/False: force (tests, benchmarks)
        self.partition_size = partition_size
        self._address_tables: dict[tuple, torch.Tensor] = {}

    # ------------------------------------------------------------------ planning
    def names(self, dtype: torch.dtype, head_size: int, block_size: int) -> ck.KernelNames:
        if dtype not in DTYPE_NAMES:
            raise ck.UnsupportedKernelError(f"no CUDA kernels for dtype {dtype}; built: {list(DTYPE_NAMES)}")
        return ck.kernel_names(DTYPE_NAMES[dtype], head_size, block_size)

    def plan(self, meta: AttentionMetadata, group: int = 1, num_kv_heads: int = 1) -> KernelPlan:
        plans = meta.plan if isinstance(meta.plan, dict) else {}
        meta.plan = plans
        if group in plans:
            return plans[group]
        items = work_items(meta.query_lens_list, group)
        if len(items) > 65535:
            raise ValueError(f"{len(items)} attention work items exceed the grid's y limit; lower max_num_batched_tokens")
        work = torch.tensor(items or [(0, 0)], dtype=torch.int32).to(meta.block_tables.device)
        plans[group] = KernelPlan(group, work, len(items), self._num_partitions(meta, len(items) * num_kv_heads))
        return plans[group]

    def _num_partitions(self, meta: AttentionMetadata, num_blocks: int) -> int:
        parts = max(1, math.ceil(meta.max_seq_len / self.partition_size))
        if self.split is None:
            fills_gpu = num_blocks >= MIN_BLOCKS_PER_SM * self.launcher.num_sms
            split = parts > 1 and (not fills_gpu or meta.max_seq_len > SPLIT_ABOVE_SEQ_LEN)
        else:
            split = self.split
        return parts if split else 1

    # ------------------------------------------------------------------ per layer
    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], any token/head strides
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        num_tokens, num_kv_heads, head_dim = key.shape
        if num_tokens == 0:
            return
        names = self.names(k_cache.dtype, head_dim, meta.block_size)
        key, value = (_dim_contiguous(t.to(k_cache.dtype)) for t in (key, value))
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        args = (
            _ptr(key), _ptr(value), _ptr(k_cache), _ptr(v_cache), _ptr(slots),
            np.int32(num_kv_heads), np.int32(head_dim),
            np.int64(key.stride(0)), np.int64(key.stride(1)), np.int64(value.stride(0)), np.int64(value.stride(1)),
        )
        self.launcher.launch(names, "write_kv", (num_tokens, 1, 1), (ck.WRITE_THREADS, 1, 1), args, key.device)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        if query.dtype != k_cache.dtype:
            raise ValueError(f"query dtype {query.dtype} differs from the KV pool's {k_cache.dtype}")
        if k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the kernels read K/V rows as 16-byte vectors: pools must be contiguous and 16-byte aligned")
        names = self.names(k_cache.dtype, head_dim, meta.block_size)
        plan = self.plan(meta, num_heads // num_kv_heads, num_kv_heads)
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
        if plan.num_work == 0:
            return out
        if query.stride(2) != 1 or query.stride(1) != head_dim:
            query = query.contiguous()
        part_out, part_max, part_sum = self._partials(plan, num_tokens, num_heads, head_dim, query.device)
        args = (
            _ptr(out), _ptr(part_out), _ptr(part_max), _ptr(part_sum), _ptr(query),
            _ptr(k_cache), _ptr(v_cache), _ptr(_int32(meta.block_tables)), _ptr(_int32(meta.seq_lens)),
            _ptr(_int32(meta.query_start_loc)), _ptr(plan.work),
            np.int32(num_kv_heads), np.int32(plan.group), np.int32(meta.block_tables.shape[1]),
            np.int64(query.stride(0)), np.float32(scale), np.int32(plan.num_partitions),
            np.int32(self.partition_size),
        )
        grid = (num_kv_heads, plan.num_work, plan.num_partitions)
        self.launcher.launch(names, "attention", grid, (ck.ATTN_THREADS, 1, 1), args, query.device)
        if plan.num_partitions > 1:
            args = (_ptr(out), _ptr(part_out), _ptr(part_max), _ptr(part_sum),
                    np.int32(plan.num_partitions), np.int32(head_dim))
            num_real = sum(meta.query_lens_list)  # padding rows past the batch have no partials
            self.launcher.launch(names, "reduce", (num_real * num_heads, 1, 1), (ck.REDUCE_THREADS, 1, 1), args,
                                 query.device)
        return out

    def _partials(self, plan: KernelPlan, num_tokens: int, num_heads: int, head_dim: int, device):
        """fp32 partial results of the split path, allocated once per step (layers run in order
        on one stream, so they can share them). Unsplit launches get a 1-element placeholder."""
        parts = plan.num_partitions
        shape = (num_tokens, num_heads, parts)
        if plan.partials is None or plan.partials[1].shape != shape:
            if parts == 1:
                dummy = torch.empty(1, dtype=torch.float32, device=device)
                plan.partials = (dummy, dummy, dummy)
            else:
                plan.partials = (
                    torch.empty(shape + (head_dim,), dtype=torch.float32, device=device),
                    torch.empty(shape, dtype=torch.float32, device=device),
                    torch.empty(shape, dtype=torch.float32, device=device),
                )
        return plan.partials

    # ------------------------------------------------------------------ whole blocks
    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst becomes a copy of block src, in every layer (one launch)."""
        self._copy(kv_caches, kv_caches, pairs)

    def swap_out(self, kv_caches, host_caches, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs: device pool -> pinned host pool, every layer."""
        self._copy(kv_caches, host_caches, pairs)

    def swap_in(self, host_caches, kv_caches, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs: pinned host pool -> device pool, every layer."""
        self._copy(host_caches, kv_caches, pairs)

    def _copy(self, src_caches, dst_caches, pairs) -> None:
        if not pairs:
            return
        k0 = src_caches[0][0]
        tensors = [t for kv in (*src_caches, *dst_caches) for t in kv]
        if any(t.shape[1:] != k0.shape[1:] or t.dtype != k0.dtype for t in tensors):
            raise ValueError("source and destination pools differ in block shape or dtype")
        # the kernel runs where the device pool is (a swap's other side is pinned host memory)
        device = next((t.device for t in tensors if t.device.type != "cpu"), k0.device)
        block_bytes = k0[0].numel() * k0.element_size()
        if block_bytes % 16:
            raise ValueError(f"a KV block of {block_bytes} bytes is not a whole number of 16-byte words")
        src = self._addresses(src_caches, device)
        dst = self._addresses(dst_caches, device)
        pair_t = torch.tensor(pairs, dtype=torch.int64).to(device)
        names = ck.KernelNames("", "", "", ck.COPY_BLOCKS_NAME)
        args = (_ptr(src), _ptr(dst), _ptr(pair_t), np.int64(block_bytes // 16))
        grid = (len(pairs), 2 * len(src_caches), 1)
        self.launcher.launch(names, "copy_blocks", grid, (ck.COPY_THREADS, 1, 1), args, device)

    def _addresses(self, caches, device) -> torch.Tensor:
        """[2 * num_layers] int64 base addresses (K then V per layer), cached per pool."""
        key = tuple(t.data_ptr() for kv in caches for t in kv) + (str(device),)
        if key not in self._address_tables:
            addrs = [self.launcher.device_address(t) for kv in caches for t in kv]
            self._address_tables[key] = torch.tensor(addrs, dtype=torch.int64).to(device)
        return self._address_tables[key]


def make_host_pool(kv_caches, num_blocks: int, pin: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A host tier with the device pool's block shape: per layer (k, v) of [num_blocks, ...]."""
    k0 = kv_caches[0][0]
    shape = (num_blocks,) + tuple(k0.shape[1:])
    return [
        (torch.zeros(shape, dtype=k0.dtype, pin_memory=pin), torch.zeros(shape, dtype=k0.dtype, pin_memory=pin))
        for _ in kv_caches
    ]


def _int32(t: torch.Tensor) -> torch.Tensor:
    """Metadata as the kernels read it: contiguous int32 (a no-op for AttentionMetadata.build's)."""
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any token and head strides but need each head's vector contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()
