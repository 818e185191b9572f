"""The executor's side of the disk tier: it holds the pool, so it moves the bytes.

The scheduler and the kvmanager decide (``folio.core.kv.allocator``, ``folio.core.kv.tiers``); a
step plan carries ``tier_saves`` (block -> file) and ``tier_loads`` (file -> device block). The
runner calls ``save`` before any other copy of the step (the blocks saved may be written again in
the same step) and ``load`` after the swap-ins, before the copy-on-write copies and the forward
pass. A save is skipped when the file exists (another process wrote the same hash: the contents are
the same). A load re-verifies the file; one that went bad between the scheduler's check and now (a
file deleted or damaged by another process in between) fails the step with ``TierLoadError``
rather than serve wrong KV.
"""

from __future__ import annotations

import time

import torch

from folio.core.executor.kernels.kv_quant import scales_fingerprint
from folio.core.kv.tensors.pool import KVPool
from folio.core.kv.tiers import HOST, DiskTier, layout_id, model_identity


class TierLoadError(RuntimeError):
    """A planned disk load found no valid file: the step cannot run on those blocks."""


def pool_layout_id(pool: KVPool, model_path: str, quantization: str, dtype: str, kv_scales=(),
                   rank: int = 0, world: int = 1) -> str:
    """The layout id of this pool's blocks for the disk tier (``folio.core.kv.tiers``)."""
    s = pool.shape
    layout = {"dtype": str(s.dtype).removeprefix("torch."), "block_size": s.block_size,
              "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim, "num_layers": s.num_layers,
              "kv_scales": [scales_fingerprint(s) for s in kv_scales] if kv_scales else None,
              "shard": [rank, world]}
    return layout_id(model_identity(model_path, quantization, dtype), layout)


class KVTierStore:
    """Moves block bytes between the pool (device or host blocks) and the disk tier's files."""

    def __init__(self, pool: KVPool, disk: DiskTier):
        self.pool = pool
        self.disk = disk
        self.load_seconds = 0.0
        self.num_loaded = 0
        self.num_saved = 0

    def _host_bytes(self, host_id: int) -> memoryview:
        flat = torch.cat([t[host_id].reshape(-1).view(torch.uint8) for kv in self.pool.host_caches for t in kv])
        return memoryview(flat.numpy()).cast("B")

    def save(self, saves: list, protect=()) -> None:
        for medium, block_id, block_hash in saves:
            if self.disk.refresh(block_hash):  # written already (here, before a restart, or by a replica)
                continue
            buf = self._host_bytes(block_id) if medium == HOST else self.pool.read_blocks([block_id])[0]
            if self.disk.save(block_hash, buf, protect):
                self.num_saved += 1

    def load(self, loads: list) -> None:
        t0 = time.perf_counter()
        for block_id, block_hash in loads:
            payload = self.disk.read(block_hash)
            if payload is None:
                raise TierLoadError(f"the disk tier's file for block {block_hash.hex()} is missing or bad: "
                                    "the step is not run on it")
            self.pool.write_blocks([block_id], [payload])
        self.num_loaded += len(loads)
        self.load_seconds += time.perf_counter() - t0

    def stats(self) -> dict:
        return {**self.disk.stats(), "num_blocks_loaded": self.num_loaded, "num_blocks_saved": self.num_saved,
                "load_seconds": round(self.load_seconds, 4)}
