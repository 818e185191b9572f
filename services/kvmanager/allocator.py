"""The block allocator: a free list of block ids and one block table per request.

Pure bookkeeping, no sockets and no tensors: the kvmanager service drives it with the scheduler's
per-step request. Block ids are the handles of the executor's pool. The free list hands out the
lowest-numbered ids first and takes freed blocks back at its tail, last block of a table first
(the order vLLM's free queue uses, so that later prefix-cache eviction drops tails before heads).
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocks(Exception):
    """Raised by ``allocate`` when the free list cannot cover a request's growth."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def num_new_blocks(self, req_id: str, num_tokens: int) -> int:
        """How many blocks ``req_id`` must gain to hold ``num_tokens`` tokens in total."""
        have = len(self.block_tables.get(req_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def can_allocate(self, req_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks(req_id, num_tokens) <= len(self.free_block_ids)

    def allocate(self, req_id: str, num_tokens: int) -> list[int]:
        """Grow ``req_id``'s table to hold ``num_tokens`` tokens; all or nothing. Returns the new ids."""
        need = self.num_new_blocks(req_id, num_tokens)
        if need > len(self.free_block_ids):
            raise NoFreeBlocks(f"{req_id}: {need} blocks needed, {len(self.free_block_ids)} free")
        new_ids = [self.free_block_ids.popleft() for _ in range(need)]
        self.block_tables.setdefault(req_id, []).extend(new_ids)
        return new_ids

    def free(self, req_id: str) -> int:
        """Release every block of ``req_id`` (unknown ids are fine: nothing to free). Returns how many."""
        table = self.block_tables.pop(req_id, None)
        if not table:
            return 0
        self.free_block_ids.extend(reversed(table))
        return len(table)

    def block_table(self, req_id: str) -> list[int]:
        return list(self.block_tables.get(req_id, ()))

    def stats(self) -> dict:
        return {
            "num_blocks_total": self.num_blocks,
            "num_blocks_used": self.num_used_blocks,
            "num_blocks_free": self.num_free_blocks,
            "block_size": self.block_size,
            "num_seqs": len(self.block_tables),
            "usage": self.num_used_blocks / self.num_blocks,
        }
