"""The kvmanager's side of the step log in one process: an allocator of record fed each step's
log, checked against the scheduler's replica after every step (digest and whole state)."""

from __future__ import annotations

from folio.core.kv.allocator import BlockAllocator
from folio.core.kv.steplog import StepLog


class Owner(BlockAllocator):
    """A ``BlockAllocator`` that applies the scheduler's step logs, as the kvmanager does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = StepLog(self)

    def apply(self, out, replica: BlockAllocator | None = None) -> bytes:
        """Apply ``out``'s log; its digest must equal the replica's (and, given, its whole state)."""
        if out.ops:
            assert self.log.apply_all(out.ops) == [], "the owner refused part of the log"
            self.log.seal()
        self.device.take_events()
        assert self.log.digest == out.digest, "the owner's digest differs from the replica's"
        if replica is not None:
            assert state(self) == state(replica), "the owner's state differs from the replica's"
        return self.log.digest


def state(alloc: BlockAllocator) -> tuple:
    """Everything that decides what the allocator hands out next."""
    d, h = alloc.device, alloc.host
    seqs = {r: (s.block_ids, s.host_block_ids, s.num_tokens, s.num_computed_tokens, s.num_indexed_blocks,
                s.block_hashes, s.token_ids) for r, s in alloc.seqs.items()}
    return (seqs, d.ref_counts, list(d.free_queue), list(d.cached_queue), d.block_id_by_hash,
            h.ref_counts, list(h.free_queue), list(alloc.unconfirmed))
