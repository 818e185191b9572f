"""The step log: one scheduler step's allocator operations, applied the same way on both sides.

The scheduler plans each step against its own replica of the block allocator: ``StepLog.try_apply``
applies one operation as the planner decides it and keeps it for the kvmanager when it succeeded
(a refusal changes nothing and is not kept: the planner preempts and tries again, as vLLM's
``allocate_slots`` returning None). The kvmanager, the owner of record, applies the received log
to its own allocator with ``StepLog.apply_all``. Both run each operation through the same
function, so the same log in the same order gives the same tables, block ids, copies and index.

After each step both fold what the operations did (block ids handed out, refusals, copies, swaps,
free and indexed block counts) into a digest chained over every step since the last reset: equal
digests mean both handed out the same blocks, step after step. The scheduler compares them when the
kvmanager's reply arrives and starts a new epoch when they differ.

Pure bookkeeping, no sockets and no tensors; imported by the scheduler and the kvmanager.
"""

from __future__ import annotations

import hashlib

import msgspec

from folio.core.kv.allocator import BlockAllocator, NoFreeBlocks
from folio.shared.messages import KVAllocate, KVClear, KVConfirm, KVFork, KVFree, KVOp, KVSwapIn, KVSwapOut, KVTruncate

_encode = msgspec.msgpack.Encoder().encode

Copies = tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]


def _free(alloc: BlockAllocator, op: KVFree) -> int:
    return sum(alloc.free(req_id) for req_id in op.req_ids)


def _allocate(alloc: BlockAllocator, op: KVAllocate) -> list[int]:
    return alloc.allocate(op.req_id, op.num_tokens, op.new_token_ids, op.cache_salt, op.num_computed, op.load_hashes)


_APPLY = {
    KVConfirm: lambda alloc, op: alloc.confirm_computed(op.discard_req_ids, op.keep_req_ids) or 0,
    KVFree: _free,
    KVTruncate: lambda alloc, op: alloc.truncate(op.req_id, op.num_tokens),
    KVFork: lambda alloc, op: len(alloc.fork(op.parent_req_id, op.child_req_id, op.num_tokens)),
    KVSwapOut: lambda alloc, op: len(alloc.swap_out(op.req_id)),
    KVSwapIn: lambda alloc, op: len(alloc.swap_in(op.req_id)),
    KVAllocate: _allocate,
    KVClear: lambda alloc, op: alloc.clear_cache(),
}


class StepLog:
    def __init__(self, alloc: BlockAllocator):
        self.alloc = alloc
        self.ops: list[KVOp] = []  # this step's, in the order applied
        self.effects: list = []  # what each did, for the digest
        self.digest = b""
        self.tier_ops: tuple[list, list] = ([], [])  # the last sealed step's (tier_saves, tier_loads)

    def try_apply(self, op: KVOp):
        """Apply ``op`` and keep it for the log; None when the allocator refused (nothing changed)."""
        try:
            result = _APPLY[type(op)](self.alloc, op)
        except NoFreeBlocks:
            return None
        self.ops.append(op)
        self.effects.append(result)
        return result

    def apply_all(self, ops: list[KVOp]) -> list[str]:
        """The owner's side: apply a received log; an operation refused here (the replicas
        diverged) changes nothing, enters the digest as a refusal, and the others go on.
        Returns the refusals, for the log."""
        refused = []
        for op in ops:
            try:
                self.effects.append(_APPLY[type(op)](self.alloc, op))
            except (NoFreeBlocks, KeyError, ValueError) as exc:
                self.effects.append(["refused", type(op).__name__])
                refused.append(f"{type(op).__name__}: {exc}")
        self.ops.extend(ops)
        return refused

    def seal(self) -> tuple[list[KVOp], Copies, bytes]:
        """End the step: its ops, the copies the executor makes before it, the chained digest
        (unchanged by a step without ops: the owner never hears of it). The disk tier's saves and loads
of the step wait in ``tier_ops``."""
        alloc = self.alloc
        copies = alloc.take_copies()
        self.tier_ops = alloc.take_tier_ops()
        if not self.ops:
            return [], copies, self.digest  # a step that changed nothing leaves the digest alone
        self.effects.append([copies, self.tier_ops, alloc.num_free_blocks, alloc.host.num_free_blocks,
                             len(alloc.device.cached), len(alloc.host.cached)])
        self.digest = hashlib.blake2b(self.digest + _encode(self.effects), digest_size=16).digest()
        ops, self.ops, self.effects = self.ops, [], []
        return ops, copies, self.digest
