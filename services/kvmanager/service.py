"""The kvmanager service: the block allocator behind one batched request per scheduler step.

Who talks to it, on its ROUTER (``Endpoints.kvmanager``), DEALER peers:
- the executor, once at start: ``RegisterPool`` -> ``PoolInfo``. A new epoch voids everything the
  old pool held: tables and cache are dropped and ``AllBlocksCleared`` is published;
- the scheduler: ``GetPool`` -> ``PoolInfo`` (held until a pool is registered), then one
  ``KVStepRequest`` -> ``KVStepReply`` per step (``apply_step``), whatever the batch size.
It PUBlishes the prefix cache's changes on ``Endpoints.kv_events`` (one ``KVEventBatch`` per step
that changed it, numbered, vLLM's framing) for routers and dashboards, and answers
``KVSnapshotRequest`` on ``Endpoints.kv_snapshot`` with every hash the cache holds and the number
of the next batch, so a router that starts late or misses batches rebuilds its view.
Its admin ROUTER (``Endpoints.admin_kvmanager``) answers ``stats``, ``seq`` (a block table),
``blocks`` (a map of both tiers) and ``clear`` (drop the free cached blocks).
"""

from __future__ import annotations

import asyncio
import time

import structlog
import zmq
import zmq.asyncio

from services.common import close_sockets, reply, serve_admin, serve_router
from services.kvmanager.allocator import BlockAllocator, NoFreeBlocks
from shared.config import KVManagerConfig
from shared.messages import (
    KV_EVENTS_TOPIC,
    AllBlocksCleared,
    GetPool,
    KVEventBatch,
    KVSnapshot,
    KVSnapshotRequest,
    KVStepReply,
    KVStepRequest,
    PoolInfo,
    RegisterPool,
)
from shared.transport import Decoder, encode, make_socket

log = structlog.get_logger()

BLOCK_MAP_WIDTH = 64  # blocks per line of ``folio kv blocks``


def apply_step(alloc: BlockAllocator, msg: KVStepRequest, epoch: str = "") -> KVStepReply:
    """One scheduler step against the allocator, in the order ``KVStepRequest`` documents. A
    request whose part cannot be done (no blocks, unknown, swapped out) lands in
    ``failed_req_ids`` with its table unchanged; the others go on."""
    discard = set(msg.discard_req_ids)
    for req_id, num_tokens in msg.truncate:
        alloc.truncate(req_id, num_tokens)
    alloc.confirm_computed(discard)  # the previous step ran: its blocks may now be found
    for req_id in (*msg.free_req_ids, *msg.discard_req_ids):
        alloc.free(req_id)
    failed: list[str] = []
    new_block_ids: dict[str, list[int]] = {}
    rewritten: list[str] = []  # tables whose existing blocks changed: the reply gives them whole
    for req_id in msg.swap_out_req_ids:
        _attempt(failed, req_id, alloc.swap_out, req_id)
    for parent_req_id, child_req_id, num_tokens in msg.forks:
        if _attempt(failed, child_req_id, alloc.fork, parent_req_id, child_req_id, num_tokens) is not None:
            rewritten.append(child_req_id)
    for req_id in msg.swap_in_req_ids:
        if _attempt(failed, req_id, alloc.swap_in, req_id) is not None:
            rewritten.append(req_id)
    num_cached: dict[str, int] = {}
    for req_id, num_tokens in msg.allocate:
        is_new = req_id not in alloc.seqs
        num_copies = len(alloc.block_copies)
        ids = _attempt(failed, req_id, alloc.allocate, req_id, num_tokens, msg.new_token_ids.get(req_id),
                       msg.cache_salts.get(req_id))
        if ids:
            new_block_ids[req_id] = ids
        if len(alloc.block_copies) > num_copies:
            rewritten.append(req_id)  # copy-on-write replaced its last block
        if is_new and req_id in alloc.seqs and alloc.seqs[req_id].num_cached_tokens:
            num_cached[req_id] = alloc.seqs[req_id].num_cached_tokens
    copies, swap_out, swap_in = alloc.take_copies()
    tables = {req_id: alloc.block_table(req_id) for req_id in rewritten if req_id in alloc.seqs}
    return KVStepReply(step_id=msg.step_id, new_block_ids=new_block_ids, failed_req_ids=failed,
                       num_free_blocks=alloc.num_free_blocks, epoch=epoch, num_cached_tokens=num_cached,
                       block_copies=copies, swap_out=swap_out, swap_in=swap_in, block_tables=tables,
                       num_shared_blocks=alloc.shared_block_counts())


def _attempt(failed: list[str], req_id: str, operation, *args):
    """Run one allocator operation; on a refusal note ``req_id`` as failed and return None."""
    try:
        return operation(*args)
    except (NoFreeBlocks, KeyError, ValueError) as exc:
        log.info("kv operation refused", req_id=req_id, operation=operation.__name__, reason=str(exc))
        failed.append(req_id)
        return None


class KVManagerService:
    def __init__(self, config: KVManagerConfig, ctx: zmq.asyncio.Context):
        self.config = config
        self.recv_from_peers = make_socket(ctx, zmq.ROUTER, config.endpoints.kvmanager)
        self.recv_from_admin = make_socket(ctx, zmq.ROUTER, config.endpoints.admin_kvmanager)
        self.send_to_subscribers = make_socket(ctx, zmq.PUB, config.endpoints.kv_events)
        self.recv_from_subscribers = make_socket(ctx, zmq.ROUTER, config.endpoints.kv_snapshot)
        self.decoder = Decoder(RegisterPool, GetPool, KVStepRequest)
        self.handlers = {
            RegisterPool: self.handle_register_pool,
            GetPool: self.handle_get_pool,
            KVStepRequest: self.handle_kv_step,
        }
        self.admin_commands = {"stats": self.admin_stats, "seq": self.admin_seq, "blocks": self.admin_blocks,
                               "clear": self.admin_clear}
        self.pool: RegisterPool | None = None
        self.allocator: BlockAllocator | None = None
        self.pool_waiters: list[list[bytes]] = []  # envelopes of GetPool asked before registration
        self.num_steps = 0
        self.next_event_seq = 0

    async def run(self) -> None:
        try:
            await asyncio.gather(
                serve_router(self.recv_from_peers, self.decoder, self.handlers, log, "peers"),
                serve_admin(self.recv_from_admin, self.admin_commands, log),
                serve_router(self.recv_from_subscribers, Decoder(KVSnapshotRequest),
                             {KVSnapshotRequest: self.handle_snapshot}, log, "kv_snapshot"),
            )
        finally:
            close_sockets(self.recv_from_peers, self.recv_from_admin, self.send_to_subscribers,
                          self.recv_from_subscribers)

    # ------------------------------------------------------------------ events
    def publish(self, extra: list | None = None) -> None:
        """Send what changed in the cache since the last call, as one numbered batch."""
        events = list(extra or [])
        if self.allocator is not None:
            events += self.allocator.device.take_events()
        if not events:
            return
        batch = KVEventBatch(ts=time.time(), events=events)
        seq = self.next_event_seq.to_bytes(8, "big")
        self.next_event_seq += 1
        try:
            self.send_to_subscribers.send_multipart([KV_EVENTS_TOPIC, seq, encode(batch)], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a PUB never blocks the allocator: slow subscribers see a gap in the numbers

    def handle_snapshot(self, msg: KVSnapshotRequest, envelope: list[bytes]) -> KVSnapshot:
        """The device cache as of now: events are published within the handler that makes them,
        so no batch numbered below ``next_event_seq`` is still to come."""
        if self.allocator is None:
            return KVSnapshot(next_event_seq=self.next_event_seq, block_size=0, block_hashes=[])
        return KVSnapshot(next_event_seq=self.next_event_seq, block_size=self.pool.block_size,
                          block_hashes=list(self.allocator.device.block_id_by_hash), epoch=self.pool.epoch)

    # ------------------------------------------------------------------ handlers
    def pool_info(self) -> PoolInfo:
        p = self.pool
        return PoolInfo(num_blocks=p.num_blocks, block_size=p.block_size, bytes_per_block=p.bytes_per_block,
                        epoch=p.epoch, max_model_len=p.max_model_len,
                        num_free_blocks=self.allocator.num_free_blocks, num_host_blocks=p.num_host_blocks)

    async def handle_register_pool(self, msg: RegisterPool, envelope: list[bytes]) -> PoolInfo:
        if self.pool is not None and self.pool.epoch != msg.epoch and self.allocator.seqs:
            log.warning("executor restarted: dropping every block table", old_epoch=self.pool.epoch,
                        new_epoch=msg.epoch, num_seqs=len(self.allocator.seqs))
        if self.pool is None or self.pool != msg:
            cleared = self.allocator is not None
            self.pool = msg
            self.allocator = BlockAllocator(msg.num_blocks, msg.block_size, msg.num_host_blocks,
                                            enable_prefix_caching=self.config.enable_prefix_caching)
            if cleared:
                self.publish([AllBlocksCleared()])
        log.info("pool registered", num_blocks=msg.num_blocks, block_size=msg.block_size,
                 num_host_blocks=msg.num_host_blocks, bytes_per_block=msg.bytes_per_block, epoch=msg.epoch,
                 enable_prefix_caching=self.config.enable_prefix_caching)
        info = self.pool_info()
        waiters, self.pool_waiters = self.pool_waiters, []
        for waiter in waiters:
            await reply(self.recv_from_peers, waiter, info)
        return info

    def handle_get_pool(self, msg: GetPool, envelope: list[bytes]) -> PoolInfo | None:
        if self.pool is None:
            self.pool_waiters.append(envelope)  # answered by handle_register_pool
            return None
        return self.pool_info()

    def handle_kv_step(self, msg: KVStepRequest, envelope: list[bytes]) -> KVStepReply:
        self.num_steps += 1
        if self.allocator is None:
            log.warning("step before any pool was registered", step_id=msg.step_id)
            return KVStepReply(step_id=msg.step_id, failed_req_ids=[r for r, _ in msg.allocate])
        kv = apply_step(self.allocator, msg, self.pool.epoch)
        if kv.failed_req_ids:
            log.info("allocation failed", step_id=msg.step_id, req_ids=kv.failed_req_ids,
                     num_free_blocks=kv.num_free_blocks)
        self.publish()
        return kv

    # ------------------------------------------------------------------ admin
    def admin_stats(self, args: dict) -> dict:
        if self.allocator is None:
            return {"registered": False, "num_blocks_total": 0, "num_blocks_used": 0, "num_blocks_free": 0,
                    "num_blocks_cached": 0, "block_size": 0, "num_seqs": 0, "usage": 0.0,
                    "num_steps": self.num_steps}
        return {
            "registered": True,
            **self.allocator.stats(),
            "bytes_per_block": self.pool.bytes_per_block,
            "epoch": self.pool.epoch,
            "max_model_len": self.pool.max_model_len,
            "num_steps": self.num_steps,
            "num_event_batches": self.next_event_seq,
        }

    def admin_seq(self, args: dict) -> dict:
        req_id = args["req_id"]
        seq = self.allocator.seqs.get(req_id) if self.allocator else None
        if seq is None:
            return {"req_id": req_id, "block_ids": [], "num_blocks": 0, "known": False}
        refs = self.allocator.device.ref_counts
        return {"req_id": req_id, "known": True, "block_ids": list(seq.block_ids), "num_blocks": len(seq.block_ids),
                "num_tokens": seq.num_tokens, "num_cached_tokens": seq.num_cached_tokens,
                "num_shared_blocks": sum(1 for b in seq.block_ids if refs[b] > 1),
                "host_block_ids": seq.host_block_ids or [], "swapped_out": seq.host_block_ids is not None}

    def admin_blocks(self, args: dict) -> dict:
        """A character per block (see ``BlockPool.state_of``), BLOCK_MAP_WIDTH per line."""
        if self.allocator is None:
            return {"device": [], "host": [], "legend": ""}

        def rows(pool) -> list[str]:
            chars = "".join(pool.state_of(b) for b in range(pool.num_blocks))
            return [chars[i:i + BLOCK_MAP_WIDTH] for i in range(0, len(chars), BLOCK_MAP_WIDTH)]

        return {"legend": ". free  c cached (free)  C cached (used)  1-9 used by that many tables  + more",
                "device": rows(self.allocator.device), "host": rows(self.allocator.host)}

    def admin_clear(self, args: dict) -> dict:
        num = self.allocator.clear_cache() if self.allocator else 0
        self.publish()
        return {"num_blocks_dropped": num}
