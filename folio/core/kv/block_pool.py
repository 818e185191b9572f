"""One tier of KV blocks: ref counts, the free queues and the prefix-cache index.

Pure bookkeeping used by ``allocator.BlockAllocator`` (one pool for the executor's device blocks,
one for its host tier); nothing else touches it. Every block is in exactly one of three states:

- used: ``ref_counts[block_id] > 0`` (held by that many block tables);
- cached: free, but its full contents are indexed by hash, so a later request can take it back;
- free: holds nothing anyone can find.

More in docs/modules.md (folio/core/kv/block_pool.py).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import NamedTuple

from folio.shared.messages import BlockRemoved, BlockStored


class NoFreeBlocks(Exception):
    """Raised when a tier cannot hand out the blocks asked for."""


class CachedBlock(NamedTuple):
    """What the index knows about a full block: enough to verify a hit (a named tuple: one is
    made for every block that fills, and a frozen dataclass costs three times as much)."""

    block_hash: bytes
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, medium: str = "GPU"):
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"need num_blocks >= 0 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.medium = medium
        self.ref_counts = [0] * num_blocks
        self.free_queue: deque[int] = deque(range(num_blocks))  # holds nothing findable
        self.cached_queue: OrderedDict[int, None] = OrderedDict()  # free but indexed; front = LRU
        self.cached: dict[int, CachedBlock] = {}  # block_id -> its indexed contents (used or free)
        self.block_id_by_hash: dict[bytes, int] = {}
        self.events: list[BlockStored | BlockRemoved] = []
        self.record_events = True  # False in the scheduler's replica: only the owner publishes
        self.num_evictions = 0
        # with a lower tier: the (block id, entry) of each cached block ``take`` evicted, which the
        # allocator copies down a tier before the block is written again (``allocator._spill``)
        self.spill: list[tuple[int, CachedBlock]] | None = None

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        """Blocks ``take`` can hand out: the free ones plus the cached ones it may evict."""
        return len(self.free_queue) + len(self.cached_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.cached_queue)

    # ------------------------------------------------------------------ taking and releasing
    def take(self, num: int) -> list[int]:
        """``num`` blocks with ref count 1, all or nothing; evicts cached blocks when it must."""
        free, ref_counts = self.free_queue, self.ref_counts
        if num <= len(free):  # most calls: no eviction
            block_ids = [free.popleft() for _ in range(num)]
            for block_id in block_ids:
                ref_counts[block_id] = 1
            return block_ids
        if num > self.num_free_blocks:
            raise NoFreeBlocks(f"{num} {self.medium} blocks needed, {self.num_free_blocks} free")
        block_ids = []
        evicted: list[bytes] = []
        for _ in range(num):
            if self.free_queue:
                block_id = self.free_queue.popleft()
            else:
                block_id, _ = self.cached_queue.popitem(last=False)
                if self.spill is not None:
                    self.spill.append((block_id, self.cached[block_id]))
                evicted.append(self._unindex(block_id))
                self.num_evictions += 1
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        if evicted and self.record_events:
            self.events.append(BlockRemoved(block_hashes=evicted, medium=self.medium))
        return block_ids

    def touch(self, block_id: int) -> None:
        """One more table holds ``block_id`` (a prefix hit or a fork); a cached free block revives."""
        if self.ref_counts[block_id] == 0:
            del self.cached_queue[block_id]  # only indexed blocks are ever touched while free
        self.ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """One table fewer holds each block; blocks nobody holds join the tail of their queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] < 1:
                raise ValueError(f"{self.medium} block {block_id} released but nobody holds it")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if block_id in self.cached:
                    self.cached_queue[block_id] = None
                else:
                    self.free_queue.append(block_id)

    # ------------------------------------------------------------------ the index
    def lookup(self, block_hash: bytes) -> CachedBlock | None:
        block_id = self.block_id_by_hash.get(block_hash)
        return None if block_id is None else self.cached[block_id]

    def block_id_of(self, block_hash: bytes) -> int:
        return self.block_id_by_hash[block_hash]

    def index(self, block_id: int, entry: CachedBlock) -> bool:
        """Make a full, used block findable. False when equal contents are indexed already (the
        block then stays unindexed: one block per hash keeps eviction simple)."""
        if entry.block_hash in self.block_id_by_hash or block_id in self.cached:
            return False
        self.cached[block_id] = entry
        self.block_id_by_hash[entry.block_hash] = block_id
        return True

    def _unindex(self, block_id: int) -> bytes:
        entry = self.cached.pop(block_id)
        del self.block_id_by_hash[entry.block_hash]
        return entry.block_hash

    def drop_cached_free_blocks(self) -> int:
        """``folio kv clear``: forget every free cached block (used ones stay indexed)."""
        dropped = [self._unindex(block_id) for block_id in self.cached_queue]
        self.free_queue.extend(self.cached_queue)
        self.cached_queue.clear()
        if dropped and self.record_events:
            self.events.append(BlockRemoved(block_hashes=dropped, medium=self.medium))
        return len(dropped)

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        events, self.events = self.events, []
        return events

    def state_of(self, block_id: int) -> str:
        """One character per block for ``folio kv blocks``: '.' free, 'c' cached, '1'-'9' used by
        that many tables ('+' more), upper-case 'C' marks a used block that is also indexed."""
        refs = self.ref_counts[block_id]
        if refs == 0:
            return "c" if block_id in self.cached else "."
        if block_id in self.cached and refs == 1:
            return "C"
        return str(refs) if refs < 10 else "+"
