"""The block allocator: one block table per request over a device tier and a host tier.

More in docs/modules.md (folio/core/kv/allocator.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from folio.core.kv.block_hash import block_extra_keys, block_keys, hash_block
from folio.core.kv.block_pool import BlockPool, CachedBlock, NoFreeBlocks
from folio.shared.messages import BlockStored

__all__ = ["BlockAllocator", "NoFreeBlocks", "RequestTable", "cdiv", "hash_block"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(eq=False)
class RequestTable:
    """A request's table. ``num_tokens``: the tokens its table holds KV for (computed or being
    computed this step); ``token_ids``: the tokens the scheduler told us of (at least those)."""

    req_id: str
    block_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    num_computed_tokens: int = 0  # of those, the ones known to be computed (safe to index)
    extra_keys: tuple = ()
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, as far as known
    num_indexed_blocks: int = 0  # blocks [0, this) were offered to the index
    num_cached_tokens: int = 0  # tokens its first allocation found cached
    host_block_ids: list[int] | None = None  # set while swapped out (then block_ids holds only skipped entries)
    num_skipped_blocks: int = 0  # leading entries given back as a sliding window passed them (not held)

    @property
    def held_block_ids(self) -> list[int]:
        """The device blocks the table holds: all but the skipped entries that lead it."""
        return self.block_ids[self.num_skipped_blocks:] if self.num_skipped_blocks else self.block_ids


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, record_events: bool = True, sliding_window: int = 0,
                 disk_tier: bool = False):
        if num_blocks < 1 or block_size < 1 or sliding_window < 0:
            raise ValueError(f"need num_blocks >= 1, block_size >= 1 and sliding_window >= 0, got {num_blocks}, "
                             f"{block_size}, {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sliding_window = sliding_window  # every layer's window (0: a layer attends to all positions)
        self.enable_prefix_caching = enable_prefix_caching
        self.device = BlockPool(num_blocks, block_size, "GPU")
        self.host = BlockPool(num_host_blocks, block_size, "CPU")
        self.device.record_events = self.host.record_events = record_events
        self.seqs: dict[str, RequestTable] = {}
        self.block_copies: list[tuple[int, int]] = []
        self.swap_out_pairs: list[tuple[int, int]] = []
        self.swap_in_pairs: list[tuple[int, int]] = []
        self.unconfirmed: dict[str, None] = {}  # sequences allocated since the last confirm (in order)
        self.counters = dict(num_prefix_cache_queries=0, num_prefix_cache_hits=0, num_cow_copies=0,
                             num_swapped_out_blocks=0, num_swapped_in_blocks=0, num_window_skipped_blocks=0,
                             num_host_hit_blocks=0, num_disk_hit_blocks=0, num_host_spilled_blocks=0,
                             num_disk_saved_blocks=0)
        # the lower tiers (not for windowed models: their skipped entries complicate the chain)
        tiers_on = enable_prefix_caching and not sliding_window
        self.host_tier = tiers_on and num_host_blocks > 0
        self.disk_tier = tiers_on and disk_tier
        if self.host_tier or self.disk_tier:
            self.device.spill = []
        if self.host_tier and self.disk_tier:
            self.host.spill = []
        self.tier_saves: list[tuple[int, int, bytes]] = []  # (DEVICE/HOST, block id, hash) to write to disk
        self.tier_loads: list[tuple[int, bytes]] = []  # (device block id, hash) to read from disk
        self._pinned_host: list[int] = []  # host hits read this step
        self._host_filled: dict[int, int] = {}  # host block -> the device block it is filled from this step
        self._filled: set[int] = set()  # device blocks whose bytes land by this step's copies

    # ------------------------------------------------------------------ views
    # device blocks an allocation may still take (free plus evictable cached), and those held
    num_free_blocks = property(lambda self: self.device.num_free_blocks)
    num_used_blocks = property(lambda self: self.device.num_used_blocks)

    @property
    def free_block_ids(self) -> list[int]:
        return [*self.device.free_queue, *self.device.cached_queue]

    @property
    def block_tables(self) -> dict[str, list[int]]:
        """The device blocks each table on the device holds (without its skipped entries)."""
        return {req_id: seq.held_block_ids for req_id, seq in self.seqs.items() if seq.host_block_ids is None}

    def block_table(self, req_id: str) -> list[int]:
        seq = self.seqs.get(req_id)
        return list(seq.block_ids) if seq else []

    def num_new_blocks(self, req_id: str, num_tokens: int) -> int:
        """How many blocks ``req_id`` must gain to hold ``num_tokens`` tokens in total (no cache)."""
        seq = self.seqs.get(req_id)
        return max(0, cdiv(num_tokens, self.block_size) - (len(seq.block_ids) if seq else 0))

    def can_allocate(self, req_id: str, num_tokens: int) -> bool:
        seq = self.seqs.get(req_id)
        cow = self._needs_cow(seq, seq.num_tokens, num_tokens) if seq else 0
        return self.num_new_blocks(req_id, num_tokens) + cow <= self.num_free_blocks

    def changes_table(self, req_id: str, num_computed: int, num_tokens: int) -> bool:
        """Whether writing tokens [num_computed, num_tokens) needs an allocation: a sequence new
        here, a new block, or a copy of a shared last block. Most decode steps need none."""
        seq = self.seqs.get(req_id)
        if seq is None or seq.host_block_ids is not None:
            return True
        bs, num_blocks = self.block_size, len(seq.block_ids)
        if num_tokens > num_blocks * bs:
            return True
        # (the inline form of ``_needs_cow``: this runs for every scheduled sequence, every step)
        index = num_computed // bs
        return (num_computed % bs != 0 and num_tokens > num_computed and index < num_blocks
                and self.device.ref_counts[seq.block_ids[index]] > 1)

    def num_cached_blocks(self, token_ids: list[int], cache_salt: str | None, max_blocks: int) -> int:
        """How many blocks a sequence new here would find cached (nothing changes)."""
        if not self.enable_prefix_caching or max_blocks <= 0:
            return 0
        extra_keys = block_extra_keys(cache_salt)
        hashes: list[bytes] = []
        bs = self.block_size
        for i in range(min(max_blocks, len(token_ids) // bs)):
            hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs],
                                     block_keys(extra_keys, i, bs)))
            if self.device.lookup(hashes[-1]) is None and not self.host_tier:
                break
        hits = self._match_prefix(hashes, token_ids, max_blocks)
        return len(hits) + len(self._match_host(hashes, token_ids, len(hits), max_blocks))

    # ------------------------------------------------------------------ growing a table
    def allocate(self, req_id: str, num_tokens: int, new_token_ids: list[int] | None = None,
                 cache_salt: str | None = None, num_computed: int | None = None,
                 load_hashes: list[bytes] = ()) -> list[int]:
        """Grow ``req_id``'s table to hold ``num_tokens`` tokens; all or nothing (``NoFreeBlocks``
        changes nothing). ``num_computed``: where this step's writes start (default: the tokens
        the table held at its last allocation); a write into a shared, partly filled block copies
        it first. Returns the block ids appended (for a sequence new here: its whole table, cached
        blocks first, and ``seqs[req_id].num_cached_tokens`` says how many tokens those hold)."""
        seq = self.seqs.get(req_id)
        if seq is None:
            new_ids = self._allocate_new(req_id, num_tokens, new_token_ids, cache_salt, load_hashes)
            if self.device.spill:
                self._spill()
            return new_ids
        if seq.host_block_ids is not None:
            raise ValueError(f"{req_id} is swapped out: swap it in before it grows")
        # a table that grows (most calls: a decode that starts a block), without a cache lookup;
        # this runs for every sequence that crosses a block, on both replicas, so ``_needs_cow``,
        # ``take`` and the no-hash case of ``_new_hashes`` are inline
        bs, block_ids, device = self.block_size, seq.block_ids, self.device
        start = seq.num_tokens if num_computed is None else num_computed
        num_blocks = len(block_ids)
        cow = int(start % bs != 0 and num_tokens > start and start // bs < num_blocks
                  and device.ref_counts[block_ids[start // bs]] > 1)
        num_fresh = max(0, -(-num_tokens // bs) - num_blocks) + cow
        free = device.free_queue
        num_skipped = min((start - self.sliding_window + 1) // bs, num_blocks) if self.sliding_window else 0
        if num_skipped > seq.num_skipped_blocks:  # the window passed blocks: they go back first
            if num_fresh > len(free) + len(device.cached_queue) + sum(
                    1 for b in block_ids[seq.num_skipped_blocks:num_skipped] if device.ref_counts[b] == 1):
                raise NoFreeBlocks(f"{req_id}: {num_fresh} blocks needed, {self.num_free_blocks} free")
            self._skip_blocks(seq, num_skipped)
        elif num_fresh > len(free) + len(device.cached_queue):
            raise NoFreeBlocks(f"{req_id}: {num_fresh} blocks needed, {self.num_free_blocks} free")
        if new_token_ids:
            if not isinstance(new_token_ids, list):
                new_token_ids = list(new_token_ids)
            token_ids = seq.token_ids
            if self.enable_prefix_caching and len(token_ids) + len(new_token_ids) >= (len(seq.block_hashes) + 1) * bs:
                seq.block_hashes += self._new_hashes(seq, new_token_ids)  # (before the tokens join)
            token_ids += new_token_ids
        if cow:
            self._copy_on_write(seq, start)
        if num_fresh - cow == 1 and free:
            block_id = free.popleft()
            device.ref_counts[block_id] = 1
            fresh = [block_id]
        else:
            fresh = device.take(num_fresh - cow) if num_fresh > cow else []
        if device.spill:
            self._spill()
        block_ids += fresh
        if num_tokens > seq.num_tokens:
            seq.num_tokens = num_tokens  # its blocks are indexed once computed
        self.unconfirmed[req_id] = None
        return fresh

    def _allocate_new(self, req_id: str, num_tokens: int, new_token_ids, cache_salt: str | None,
                      load_hashes=()) -> list[int]:
        """``allocate`` for a sequence new here: its table starts with the prefix-cache hits
        (device, then host, then the disk's ``load_hashes``)."""
        seq = RequestTable(req_id, extra_keys=block_extra_keys(cache_salt))
        new_token_ids = list(new_token_ids or ())
        new_hashes = self._new_hashes(seq, new_token_ids)
        max_blocks = (num_tokens - 1) // self.block_size
        hits = self._match_prefix(new_hashes, new_token_ids, max_blocks)
        host_hits = self._match_host(new_hashes, new_token_ids, len(hits), max_blocks)
        disk_hashes: list[bytes] = []
        if self.disk_tier and load_hashes:
            start = len(hits) + len(host_hits)
            for i, block_hash in enumerate(load_hashes):  # the run that continues the chain here
                if start + i >= min(max_blocks, len(new_hashes)) or new_hashes[start + i] != block_hash:
                    break
                disk_hashes.append(block_hash)
        num_loaded = len(host_hits) + len(disk_hashes)
        num_fresh = max(0, cdiv(num_tokens, self.block_size) - len(hits) - num_loaded) + num_loaded
        # its first write is at the first position past the hit: hits wholly before that
        # position's window are skipped at once (entered in the table, not revived)
        num_skipped = 0
        if self.sliding_window:
            num_skipped = max(0, min(len(hits), (len(hits) * self.block_size - self.sliding_window + 1)
                                     // self.block_size))
        num_revived = sum(1 for b in hits[num_skipped:] if self.device.ref_counts[b] == 0)
        if num_fresh + num_revived > self.device.num_free_blocks:
            raise NoFreeBlocks(f"{req_id}: {num_fresh + num_revived} blocks needed, {self.num_free_blocks} free")
        for block_id in hits[num_skipped:]:
            self.device.touch(block_id)
        for block_id in host_hits:  # pinned until the step's copies are taken
            self.host.touch(block_id)
        self._pinned_host += host_hits
        new_ids = hits + self.device.take(num_fresh)
        loaded = new_ids[len(hits):len(hits) + num_loaded]
        self.swap_in_pairs.extend(zip(host_hits, loaded))
        self.tier_loads.extend(zip(loaded[len(host_hits):], disk_hashes))
        self._filled.update(loaded)
        seq.block_ids.extend(new_ids)
        seq.token_ids.extend(new_token_ids)
        seq.block_hashes.extend(new_hashes)
        seq.num_tokens = num_tokens
        self.unconfirmed[req_id] = None
        self.seqs[req_id] = seq
        seq.num_indexed_blocks = len(hits)
        seq.num_skipped_blocks = num_skipped
        seq.num_computed_tokens = seq.num_cached_tokens = (len(hits) + num_loaded) * self.block_size
        if num_loaded:
            self._index_full_blocks(seq)  # their bytes land before the step runs
        self.counters["num_prefix_cache_queries"] += num_tokens
        self.counters["num_prefix_cache_hits"] += seq.num_cached_tokens
        self.counters["num_host_hit_blocks"] += len(host_hits)
        self.counters["num_disk_hit_blocks"] += len(disk_hashes)
        return new_ids

    def _new_hashes(self, seq: RequestTable, new_token_ids: list[int]) -> list[bytes]:
        """Hashes of the blocks ``new_token_ids`` fill, after the ones ``seq`` has."""
        if not self.enable_prefix_caching or not new_token_ids:
            return []
        bs = self.block_size
        done = len(seq.block_hashes)
        tail = seq.token_ids[done * bs:] + new_token_ids  # the tokens past its last hashed block
        hashes: list[bytes] = []
        parent = seq.block_hashes[-1] if done else None
        for i in range(len(tail) // bs):
            parent = hash_block(parent, tail[i * bs:(i + 1) * bs], block_keys(seq.extra_keys, done + i, bs))
            hashes.append(parent)
        return hashes

    def _match_prefix(self, hashes: list[bytes], token_ids: list[int], max_blocks: int) -> list[int]:
        """The longest run of cached blocks that starts the sequence, each verified."""
        hits: list[int] = []
        bs = self.block_size
        for i, block_hash in enumerate(hashes[:max(0, max_blocks)]):
            entry = self.device.lookup(block_hash)
            parent = hashes[i - 1] if i else None
            if (entry is None or entry.parent_block_hash != parent
                    or list(entry.token_ids) != token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(self.device.block_id_of(block_hash))
        return hits

    def _match_host(self, hashes: list[bytes], token_ids: list[int], start: int, max_blocks: int) -> list[int]:
        """The host blocks that continue a run of ``start`` device hits, each verified."""
        if not self.host_tier:
            return []
        hits: list[int] = []
        bs = self.block_size
        for i in range(start, min(max_blocks, len(hashes))):
            entry = self.host.lookup(hashes[i])
            if (entry is None or entry.parent_block_hash != (hashes[i - 1] if i else None)
                    or list(entry.token_ids) != token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(self.host.block_id_of(hashes[i]))
        return hits

    def prefix_hashes(self, token_ids: list[int], cache_salt: str | None, max_blocks: int) -> list[bytes]:
        """The chained hashes of a sequence's first ``max_blocks`` full blocks (the planner's disk lookup)."""
        extra_keys = block_extra_keys(cache_salt)
        hashes: list[bytes] = []
        bs = self.block_size
        for i in range(min(max_blocks, len(token_ids) // bs)):
            hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs],
                                     block_keys(extra_keys, i, bs)))
        return hashes

    def _spill(self) -> None:
        """Copy the cached blocks that ``take`` just evicted one tier down: device -> host (a
        ``swap_out`` pair; the host index takes the entry) or, without room there, -> disk;
        host -> disk. A block whose bytes land in this very step is not spilled (they are not there
        yet when the saves run), nor one whose hash the host tier holds already."""
        device, host = self.device, self.host
        self._spill_host()
        while device.spill:
            block_id, entry = device.spill.pop(0)
            if block_id in self._filled:
                continue
            if self.host_tier:
                known = host.block_id_by_hash.get(entry.block_hash)
                if known is not None:
                    if known in host.cached_queue:
                        host.cached_queue.move_to_end(known)
                    continue
                if host.num_free_blocks:
                    (host_id,) = host.take(1)
                    self._spill_host()  # (before the host block's new source is recorded)
                    host.index(host_id, entry)
                    host.release([host_id])
                    self.swap_out_pairs.append((block_id, host_id))
                    self._host_filled[host_id] = block_id
                    self.counters["num_host_spilled_blocks"] += 1
                    continue
            if self.disk_tier:
                self.tier_saves.append((0, block_id, entry.block_hash))
                self.counters["num_disk_saved_blocks"] += 1

    def _spill_host(self) -> None:
        """Host blocks just evicted -> disk: saved from the host block, or from the device block it
        was filled from in this step (its bytes reach the host only after the saves run)."""
        while self.host.spill:
            block_id, entry = self.host.spill.pop(0)
            src = self._host_filled.pop(block_id, None)
            self.tier_saves.append((0, src, entry.block_hash) if src is not None else (1, block_id, entry.block_hash))
            self.counters["num_disk_saved_blocks"] += 1

    def confirm_computed(self, discard_req_ids=(), keep_req_ids=()) -> None:
        """Every allocation so far has been computed (the executor runs steps in order: what
        reads these blocks runs after what wrote them), except those of ``discard_req_ids``:
        index the blocks that became full. Indexing only computed blocks means a hit never points
        at KV that never will be written (a request whose step failed). ``keep_req_ids``: whose
        step has not run yet; they stay unconfirmed, for a later confirm."""
        discard, keep = set(discard_req_ids), set(keep_req_ids)
        unconfirmed, self.unconfirmed = self.unconfirmed, {}
        for req_id in unconfirmed:
            if req_id in keep:
                self.unconfirmed[req_id] = None
                continue
            seq = self.seqs.get(req_id)
            if (seq is not None and req_id not in discard and seq.host_block_ids is None
                    and seq.num_computed_tokens < seq.num_tokens):
                seq.num_computed_tokens = seq.num_tokens
                self._index_full_blocks(seq)

    def _index_full_blocks(self, seq: RequestTable) -> None:
        """Offer the sequence's newly full, computed blocks to the index; one BlockStored per run."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_hashes))
        run: list[int] = []
        for i in range(max(seq.num_indexed_blocks, seq.num_skipped_blocks), num_full):  # (skipped: not held)
            entry = CachedBlock(seq.block_hashes[i], seq.block_hashes[i - 1] if i else None,
                                tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            if self.device.index(seq.block_ids[i], entry):
                run.append(i)
                if self.disk_tier and seq.block_ids[i] not in self._filled:  # written through to disk
                    self.tier_saves.append((0, seq.block_ids[i], entry.block_hash))
                    self.counters["num_disk_saved_blocks"] += 1
                continue
            self._store_event(seq, run)
            run = []
        self._store_event(seq, run)
        seq.num_indexed_blocks = max(seq.num_indexed_blocks, num_full)

    def _store_event(self, seq: RequestTable, run: list[int]) -> None:
        if not run or not self.device.record_events:
            return

        bs, first = self.block_size, run[0]
        self.device.events.append(BlockStored(
            block_hashes=[seq.block_hashes[i] for i in run],
            parent_block_hash=seq.block_hashes[first - 1] if first else None,
            token_ids=seq.token_ids[first * bs:(run[-1] + 1) * bs], block_size=bs))

    # ------------------------------------------------------------------ sharing
    def _needs_cow(self, seq: RequestTable, start: int, num_tokens: int) -> int:
        """1 when a write from token ``start`` lands in a shared, partly filled block, else 0."""
        bs = self.block_size
        if num_tokens <= start or start % bs == 0 or start // bs >= len(seq.block_ids):
            return 0
        return int(self.device.ref_counts[seq.block_ids[start // bs]] > 1)

    def _copy_on_write(self, seq: RequestTable, start: int) -> None:
        index = start // self.block_size
        src = seq.block_ids[index]
        (dst,) = self.device.take(1)
        if self.device.spill:
            self._spill()
        self.device.release([src])
        seq.block_ids[index] = dst
        self.block_copies.append((src, dst))
        self.counters["num_cow_copies"] += 1

    def fork(self, parent_req_id: str, child_req_id: str, num_tokens: int | None = None) -> list[int]:
        """The child shares every block of the parent (nothing is copied until one of them writes
        into a shared partly filled block). ``num_tokens``: the tokens the parent's table holds
        KV for, when the caller knows better than our count (which only moves with allocations).
        Returns the child's table."""
        parent = self.seqs[parent_req_id]
        if child_req_id in self.seqs:
            raise ValueError(f"{child_req_id} already has a block table")
        if parent.host_block_ids is not None:
            raise ValueError(f"{parent_req_id} is swapped out")
        if num_tokens is not None:
            if num_tokens > len(parent.block_ids) * self.block_size:
                raise ValueError(f"{parent_req_id} holds {len(parent.block_ids)} blocks, not {num_tokens} tokens")
            parent.num_tokens = num_tokens
        for block_id in parent.held_block_ids:
            self.device.touch(block_id)
        self.seqs[child_req_id] = RequestTable(
            child_req_id, block_ids=list(parent.block_ids), token_ids=list(parent.token_ids),
            num_tokens=parent.num_tokens, num_computed_tokens=parent.num_computed_tokens,
            extra_keys=parent.extra_keys, block_hashes=list(parent.block_hashes), num_indexed_blocks=parent.num_indexed_blocks, num_cached_tokens=parent.num_cached_tokens,
            num_skipped_blocks=parent.num_skipped_blocks)
        return list(parent.block_ids)

    # ------------------------------------------------------------------ releasing
    def truncate(self, req_id: str, num_tokens: int) -> int:
        """Shrink ``req_id``'s table to the blocks of its first ``num_tokens`` tokens (speculative
        decoding: the slots of rejected draft tokens). Returns how many blocks went back. Those
        trailing blocks were never indexed: their tokens were not known as accepted yet."""
        seq = self.seqs.get(req_id)
        if seq is None or seq.host_block_ids is not None or num_tokens >= seq.num_tokens:
            return 0
        keep = max(cdiv(num_tokens, self.block_size), seq.num_skipped_blocks)
        dropped = seq.block_ids[keep:]
        del seq.block_ids[keep:]
        self.device.release(list(reversed(dropped)))
        seq.num_tokens = num_tokens
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        seq.num_indexed_blocks = min(seq.num_indexed_blocks, keep)
        return len(dropped)

    def free(self, req_id: str) -> int:
        """Release every block of ``req_id`` (unknown ids are fine: nothing to free). Returns how
        many. Deepest blocks go first, so a cached sequence is evicted from its tail. Blocks not
        yet indexed stay unindexed: call ``confirm_computed`` first to keep what was computed."""
        seq = self.seqs.pop(req_id, None)
        if seq is None:
            return 0
        if seq.host_block_ids is not None:
            self.host.release(list(reversed(seq.host_block_ids)))
            return len(seq.host_block_ids)
        held = seq.held_block_ids
        self.device.release(list(reversed(held)))
        return len(held)

    def _skip_blocks(self, seq: RequestTable, num_skipped: int) -> None:
        """Give back the table's blocks before entry ``num_skipped`` (a sliding window passed them);
        their entries stay. Those computed and full were indexed when confirmed: they go back as
        cached blocks; those whose step has not been confirmed go back unindexed."""
        skipped = seq.block_ids[seq.num_skipped_blocks:num_skipped]
        seq.num_skipped_blocks = num_skipped
        self.device.release(list(reversed(skipped)))
        self.counters["num_window_skipped_blocks"] += len(skipped)

    def clear_cache(self) -> int:
        """Drop the free cached blocks (``folio kv clear``), the host tier's too. Returns how many
        (the disk tier is shared with other processes: it stays)."""
        return self.device.drop_cached_free_blocks() + (self.host.drop_cached_free_blocks() if self.host_tier else 0)

    # ------------------------------------------------------------------ the host tier
    def swap_out(self, req_id: str) -> list[tuple[int, int]]:
        """Move ``req_id``'s blocks to the host tier; all or nothing. Returns (device, host) pairs."""
        seq = self.seqs[req_id]
        if seq.host_block_ids is not None:
            raise ValueError(f"{req_id} is swapped out already")
        held = seq.held_block_ids
        host_ids = self.host.take(len(held))
        if self.host.spill:
            self._spill_host()
        pairs = list(zip(held, host_ids))
        self.device.release(list(reversed(held)))
        seq.host_block_ids, seq.block_ids = host_ids, seq.block_ids[:seq.num_skipped_blocks]
        self.swap_out_pairs.extend(pairs)
        self.counters["num_swapped_out_blocks"] += len(pairs)
        return pairs

    def swap_in(self, req_id: str) -> list[tuple[int, int]]:
        """Bring ``req_id``'s blocks back into fresh device blocks; all or nothing. Returns (host,
        device) pairs; its full blocks are offered to the index again."""
        seq = self.seqs[req_id]
        if seq.host_block_ids is None:
            raise ValueError(f"{req_id} is not swapped out")
        device_ids = self.device.take(len(seq.host_block_ids))
        self._filled.update(device_ids)
        if self.device.spill:
            self._spill()
        pairs = list(zip(seq.host_block_ids, device_ids))
        self.host.release(list(reversed(seq.host_block_ids)))
        seq.block_ids, seq.host_block_ids = seq.block_ids + device_ids, None
        seq.num_indexed_blocks = 0  # the copies land before the step runs: readable as soon as indexed
        self._index_full_blocks(seq)
        self.swap_in_pairs.extend(pairs)
        self.counters["num_swapped_in_blocks"] += len(pairs)
        return pairs

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """(block_copies, swap_out, swap_in) gathered since the last call, for one step's reply."""
        copies = (self.block_copies, self.swap_out_pairs, self.swap_in_pairs)
        self.block_copies, self.swap_out_pairs, self.swap_in_pairs = [], [], []
        if self._pinned_host:  # the host hits were read by this step's copies: evictable again
            self.host.release(self._pinned_host)
            self._pinned_host = []
        self._host_filled.clear()
        self._filled.clear()
        return copies

    def take_tier_ops(self) -> tuple[list[tuple[int, int, bytes]], list[tuple[int, bytes]]]:
        """(tier_saves, tier_loads) gathered since the last call: the disk's part of the step."""
        ops = (self.tier_saves, self.tier_loads)
        self.tier_saves, self.tier_loads = [], []
        return ops

    # ------------------------------------------------------------------ admin
    def stats(self) -> dict:
        d, h = self.device, self.host
        queries, hits = self.counters["num_prefix_cache_queries"], self.counters["num_prefix_cache_hits"]
        return {
            "num_blocks_total": self.num_blocks,
            "num_blocks_used": d.num_used_blocks,
            "num_blocks_cached": d.num_cached_free_blocks,
            "num_blocks_free": len(d.free_queue),
            "num_blocks_indexed": len(d.cached),
            "block_size": self.block_size,
            "sliding_window": self.sliding_window,
            "num_seqs": len(self.seqs),
            "usage": d.num_used_blocks / self.num_blocks,
            "enable_prefix_caching": self.enable_prefix_caching,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "num_evictions": d.num_evictions,
            **self.counters,
            "num_host_blocks_total": h.num_blocks,
            "num_host_blocks_used": h.num_used_blocks,
            "num_host_blocks_cached": h.num_cached_free_blocks,
            "num_seqs_swapped_out": sum(1 for s in self.seqs.values() if s.host_block_ids is not None),
        }
