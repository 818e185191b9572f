"""The KV block pool: allocated once at start, addressed by block ids (the handles).

Per layer, K and V each ``[num_blocks, block_size, num_kv_heads, head_dim]`` (vLLM V1's layout).
The pool's size is fixed before any request arrives: on the CPU from a byte budget, on a GPU from
the memory left after the weights and a profiling forward pass, times a utilization fraction.
"""

from __future__ import annotations

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
    kvmanager's swap-outs copy to (pinned when the device is a GPU, so that copies run async)."""

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
