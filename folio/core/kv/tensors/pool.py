"""The KV block pool: allocated once at start, addressed by block ids (the handles).

Per layer, K and V each ``[num_blocks, block_size, num_kv_heads, head_dim]`` (vLLM V1's layout).
The pool's size is fixed before any request arrives: on the CPU from a byte budget, on a GPU from
the memory left after the weights and a profiling forward pass, times a utilization fraction.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import psutil
import torch

# On the CPU, the default KV budget: this fraction of the memory available at start, at most 4 GiB
# (vLLM's CPU backend defaults to 4 GiB too).
CPU_KV_FRACTION = 0.25
CPU_KV_MAX_BYTES = 4 << 30


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


class KVPool:
    """The device pool plus, with ``num_host_blocks``, a host tier of the same block shape that the
    kvmanager's swap-outs copy to (pinned when the device is a GPU, so that copies run async): the
    tables of swapped-out requests, and the prefix blocks the device's cache evicted
    (``folio.core.kv.tiers``; the disk tier below it is ``disk.py``)."""

    def __init__(self, shape: PoolShape, num_blocks: int, device: torch.device, num_host_blocks: int = 0):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.shape = shape
        self.num_blocks = num_blocks
        self.device = device
        dims = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        # kv_caches[layer] = (k_cache, v_cache)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (_zeros(dims, shape.dtype, device), _zeros(dims, shape.dtype, device)) for _ in range(shape.num_layers)
        ]
        self.num_host_blocks = num_host_blocks
        host_dims = (num_host_blocks,) + dims[1:]
        pin = device.type == "cuda"
        # host_caches[layer] = (k_cache, v_cache), each [num_host_blocks, block_size, num_kv_heads, head_dim]
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(host_dims, dtype=shape.dtype, pin_memory=pin),
             torch.zeros(host_dims, dtype=shape.dtype, pin_memory=pin))
            for _ in range(shape.num_layers)
        ] if num_host_blocks else []

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.shape.bytes_per_block

    # ------------------------------------------------------------------ block bytes (transfer, tiers)
    def block_views(self, block_id: int) -> list[torch.Tensor]:
        """The block's ``2 * num_layers`` views, K then V per layer, each ``[block_size,
        num_kv_heads, head_dim]`` and contiguous: slices of the pool, no copy."""
        self._check_block(block_id)
        return [t[block_id] for kv in self.kv_caches for t in kv]

    def read_blocks(self, block_ids: list[int]) -> list[memoryview]:
        """One contiguous bytes buffer per block: every layer's K then V, in layer order (a copy;
        from a GPU pool, to host memory)."""
        out = []
        for b in block_ids:
            flat = torch.cat([v.reshape(-1).view(torch.uint8) for v in self.block_views(b)])
            out.append(memoryview(flat.cpu().numpy()).cast("B"))
        return out

    def write_blocks(self, block_ids: list[int], buffers: list) -> None:
        """The inverse of ``read_blocks``: each buffer (any bytes-like object) into its block."""
        if len(block_ids) != len(buffers):
            raise ValueError(f"{len(block_ids)} block ids but {len(buffers)} buffers")
        nbytes = self.shape.bytes_per_block
        for b, buf in zip(block_ids, buffers):
            mv = memoryview(buf).cast("B")
            if mv.nbytes != nbytes:
                raise ValueError(f"block {b}: a buffer of {mv.nbytes} bytes, a block holds {nbytes}")
            with warnings.catch_warnings():  # a read-only buffer (bytes) is only read from
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(mv, dtype=torch.uint8)
            views = self.block_views(b)
            per = nbytes // len(views)
            for i, view in enumerate(views):
                view.view(torch.uint8).reshape(-1).copy_(src[i * per:(i + 1) * per], non_blocking=False)

    def _check_block(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} is outside the pool's {self.num_blocks} blocks")


def _zeros(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool tensor. On the CPU from calloc (numpy's zeros): the kernel's zero pages, touched
    only when a block is first written, instead of torch.zeros writing every byte at start (the
    default 4 GiB pool: 7 s of start-up)."""
    if device.type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    nbytes = torch.Size(dims).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(dims)


def cpu_kv_budget_bytes(available: int | None = None) -> int:
    available = psutil.virtual_memory().available if available is None else available
    return min(int(available * CPU_KV_FRACTION), CPU_KV_MAX_BYTES)


def blocks_for_budget(budget_bytes: int, shape: PoolShape) -> int:
    return budget_bytes // shape.bytes_per_block


def gpu_num_blocks(total_bytes: int, utilization: float, peak_non_kv_bytes: int, shape: PoolShape) -> int:
    """vLLM's rule: ``total * utilization`` minus what the weights and activations peaked at."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    free_for_kv = int(total_bytes * utilization) - peak_non_kv_bytes
    if free_for_kv < shape.bytes_per_block:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: {total_bytes * utilization / 2**30:.2f} GiB allowed, "
            f"{peak_non_kv_bytes / 2**30:.2f} GiB taken by weights and activations; "
            "raise --gpu-memory-utilization or lower --max-num-batched-tokens"
        )
    return free_for_kv // shape.bytes_per_block
