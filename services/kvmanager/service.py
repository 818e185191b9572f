"""The kvmanager service: the owner of record of the KV blocks, fed by the scheduler's step log.

More in docs/modules.md (services/kvmanager/service.py).
"""

from __future__ import annotations

import asyncio
import time

import structlog
import zmq
import zmq.asyncio

from folio.core.kv.allocator import BlockAllocator
from folio.core.kv.steplog import StepLog
from folio.core.kv.tiers import scan_folder
from folio.services.kvmanager.blockmap import DEFAULT_MAX_CELLS, block_map
from folio.shared.config import KVManagerConfig
from folio.services.shell import reply, serve_admin, serve_router
from folio.shared.transport import close_sockets
from folio.shared.messages import (
    KV_EVENTS_TOPIC,
    AllBlocksCleared,
    GetPool,
    KVClear,
    KVClearCache,
    KVEventBatch,
    KVReset,
    KVSnapshot,
    KVSnapshotRequest,
    KVStepReply,
    KVStepRequest,
    PoolInfo,
    RegisterPool,
)
from folio.shared.transport import Decoder, encode, make_socket

log = structlog.get_logger()

BLOCK_MAP_WIDTH = 64  # blocks per line of ``folio kv blocks``
CLEAR_TIMEOUT_S = 10.0  # ``folio kv clear`` waits this long for the scheduler's log to carry it


class KVManagerService:
    def __init__(self, config: KVManagerConfig, ctx: zmq.asyncio.Context):
        self.config = config
        self.recv_from_peers = make_socket(ctx, zmq.ROUTER, config.endpoints.kvmanager)
        self.recv_from_admin = make_socket(ctx, zmq.ROUTER, config.endpoints.admin_kvmanager)
        self.send_to_subscribers = make_socket(ctx, zmq.PUB, config.endpoints.kv_events)
        self.recv_from_subscribers = make_socket(ctx, zmq.ROUTER, config.endpoints.kv_snapshot)
        self.decoder = Decoder(RegisterPool, GetPool, KVReset, KVStepRequest)
        self.handlers = {
            RegisterPool: self.handle_register_pool,
            GetPool: self.handle_get_pool,
            KVReset: self.handle_kv_reset,
            KVStepRequest: self.handle_kv_step,
        }
        self.admin_commands = {"stats": self.admin_stats, "seq": self.admin_seq, "blocks": self.admin_blocks,
                               "map": self.admin_map, "clear": self.admin_clear}
        self.pool: RegisterPool | None = None
        self.kv: StepLog | None = None  # the allocator of record and its step log
        self.generation: int | None = None  # the scheduler's sync epoch we hold the state of
        self.scheduler_envelope: list[bytes] | None = None  # where KVClearCache goes
        self.clear_waiters: list[asyncio.Future] = []  # ``clear`` admin calls, until the log carries it
        self.pool_waiters: list[list[bytes]] = []  # envelopes of GetPool asked before registration
        self.num_steps = 0
        self.num_refused_ops = 0
        self.next_event_seq = 0

    @property
    def allocator(self) -> BlockAllocator | None:
        return self.kv.alloc if self.kv is not None else None

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
                        num_free_blocks=self.allocator.num_free_blocks, num_host_blocks=p.num_host_blocks,
                        enable_prefix_caching=self.config.enable_prefix_caching, sliding_window=p.sliding_window,
                        kv_disk_dir=p.kv_disk_dir, kv_layout_id=p.kv_layout_id, kv_disk_bytes=p.kv_disk_bytes)

    def reset_allocator(self, new_pool: bool = False) -> None:
        """Empty tables and cache for the current pool; subscribers hear that everything went
        (always for a new pool: its contents died with the old one)."""
        cleared = self.kv is not None and (new_pool or bool(self.allocator.device.cached or self.allocator.seqs))
        p = self.pool
        self.kv = StepLog(BlockAllocator(p.num_blocks, p.block_size, p.num_host_blocks,
                                         enable_prefix_caching=self.config.enable_prefix_caching,
                                         sliding_window=p.sliding_window, disk_tier=bool(p.kv_disk_dir)))
        if cleared:
            self.publish([AllBlocksCleared()])

    async def adopt_pool(self, pool: RegisterPool) -> PoolInfo:
        self.pool = pool
        self.reset_allocator(new_pool=True)
        info = self.pool_info()
        waiters, self.pool_waiters = self.pool_waiters, []
        for waiter in waiters:
            await reply(self.recv_from_peers, waiter, info)
        return info

    async def handle_register_pool(self, msg: RegisterPool, envelope: list[bytes]) -> PoolInfo:
        if self.pool is not None and self.pool.epoch != msg.epoch and self.allocator.seqs:
            log.warning("executor restarted: dropping every block table", old_epoch=self.pool.epoch,
                        new_epoch=msg.epoch, num_seqs=len(self.allocator.seqs))
        if self.pool is None or self.pool != msg:  # the same again is the executor's heartbeat
            log.info("pool registered", num_blocks=msg.num_blocks, block_size=msg.block_size,
                     num_host_blocks=msg.num_host_blocks, bytes_per_block=msg.bytes_per_block, epoch=msg.epoch,
                     enable_prefix_caching=self.config.enable_prefix_caching)
            self.generation = None  # the scheduler's tables are void: it starts a new epoch
            return await self.adopt_pool(msg)
        return self.pool_info()

    def handle_get_pool(self, msg: GetPool, envelope: list[bytes]) -> PoolInfo | None:
        if self.pool is None:
            self.pool_waiters.append(envelope)  # answered by adopt_pool
            return None
        return self.pool_info()

    async def handle_kv_reset(self, msg: KVReset, envelope: list[bytes]) -> PoolInfo:
        """A new sync epoch: empty tables here and in the scheduler's replica."""
        self.scheduler_envelope = envelope
        self.generation = msg.generation
        if self.pool is None:  # restarted since the executor registered: take the scheduler's word
            p = msg.pool
            log.warning("no pool registered: adopting the scheduler's", num_blocks=p.num_blocks, epoch=p.epoch)
            return await self.adopt_pool(RegisterPool(
                num_blocks=p.num_blocks, block_size=p.block_size, bytes_per_block=p.bytes_per_block, epoch=p.epoch,
                max_model_len=p.max_model_len, num_host_blocks=p.num_host_blocks, sliding_window=p.sliding_window,
                kv_disk_dir=p.kv_disk_dir, kv_layout_id=p.kv_layout_id, kv_disk_bytes=p.kv_disk_bytes))
        self.reset_allocator()
        log.info("new sync epoch: tables dropped", generation=msg.generation)
        return self.pool_info()

    def handle_kv_step(self, msg: KVStepRequest, envelope: list[bytes]) -> KVStepReply:
        self.num_steps += 1
        self.scheduler_envelope = envelope
        if self.kv is None or msg.generation != self.generation:
            return KVStepReply(step_id=msg.step_id, generation=msg.generation, in_sync=False)
        refused = self.kv.apply_all(msg.ops)
        if refused:
            self.num_refused_ops += len(refused)
            log.warning("step log refused here: the replicas diverged", step_id=msg.step_id, refused=refused[:4])
        cleared = [n for op, n in zip(msg.ops, self.kv.effects) if isinstance(op, KVClear)]
        _, _, digest = self.kv.seal()
        self.publish()
        for n in cleared:
            for waiter in self.clear_waiters:
                if not waiter.done():
                    waiter.set_result(n)
            self.clear_waiters = []
        return KVStepReply(step_id=msg.step_id, generation=msg.generation, digest=digest)

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
            "generation": self.generation,
            "num_refused_ops": self.num_refused_ops,
            "tiers": self.tier_stats(),
        }

    def tier_stats(self) -> dict:
        """Blocks, bytes and hits per tier (``folio kv stats``, the live KV page). Device and host
        from the allocator of record; the disk's blocks and bytes from its folder (shared with other
        processes), its hits from the loads the step logs carried."""
        a, p = self.allocator, self.pool
        c = a.counters
        tiers = {
            "device": {"blocks": a.num_blocks, "blocks_cached": len(a.device.cached),
                       "bytes": a.num_blocks * p.bytes_per_block, "hit_blocks": c["num_prefix_cache_hits"] // a.block_size
                       - c["num_host_hit_blocks"] - c["num_disk_hit_blocks"]},
            "host": {"blocks": a.host.num_blocks, "blocks_cached": len(a.host.cached),
                     "bytes": a.host.num_blocks * p.bytes_per_block, "hit_blocks": c["num_host_hit_blocks"],
                     "spilled_blocks": c["num_host_spilled_blocks"], "prefix_tier": a.host_tier},
        }
        if p.kv_disk_dir:
            disk = {"dir": p.kv_disk_dir, "capacity_bytes": p.kv_disk_bytes, "hit_blocks": c["num_disk_hit_blocks"],
                    "saved_blocks": c["num_disk_saved_blocks"]}
            try:
                found = scan_folder(p.kv_disk_dir, p.kv_layout_id)
                disk.update(blocks_cached=found["num_disk_blocks"], bytes=found["disk_bytes"])
            except OSError as exc:
                disk["error"] = str(exc)
            tiers["disk"] = disk
        return tiers

    def admin_seq(self, args: dict) -> dict:
        req_id = args["req_id"]
        seq = self.allocator.seqs.get(req_id) if self.allocator else None
        if seq is None:
            return {"req_id": req_id, "block_ids": [], "num_blocks": 0, "known": False}
        refs = self.allocator.device.ref_counts
        held = seq.held_block_ids  # (a sliding window's skipped entries are no longer its blocks)
        return {"req_id": req_id, "known": True, "block_ids": list(held), "num_blocks": len(held),
                "num_skipped_blocks": seq.num_skipped_blocks,
                "num_tokens": seq.num_tokens, "num_cached_tokens": seq.num_cached_tokens,
                "num_shared_blocks": sum(1 for b in held if refs[b] > 1),
                "block_ref_counts": [refs[b] for b in held],
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

    def admin_map(self, args: dict) -> dict:
        """Both tiers in at most ``max_cells`` cells, the requests' table sizes and, given a
        ``req_id``, its table (the live KV page: all from the same moment)."""
        if self.allocator is None:
            return {"registered": False}
        max_cells = args.get("max_cells", DEFAULT_MAX_CELLS)
        if not isinstance(max_cells, int) or isinstance(max_cells, bool) or max_cells < 1:
            raise ValueError(f"max_cells must be a positive integer, got {max_cells!r}")
        req_id = args.get("req_id")
        table = self.admin_seq({"req_id": req_id}) if isinstance(req_id, str) else None
        return {"registered": True, **block_map(self.allocator, max_cells), "table": table}

    async def admin_clear(self, args: dict) -> dict:
        """Drop the free cached blocks. With a scheduler in sync, the clear goes through its step log
        (both allocators must drop the same blocks at the same point); without one, here and now."""
        if self.kv is None:
            return {"num_blocks_dropped": 0}
        if self.generation is None or self.scheduler_envelope is None:
            num = self.allocator.clear_cache()
            self.publish()
            return {"num_blocks_dropped": num}
        waiter = asyncio.get_running_loop().create_future()
        self.clear_waiters.append(waiter)
        await reply(self.recv_from_peers, self.scheduler_envelope, KVClearCache())
        try:
            num = await asyncio.wait_for(waiter, CLEAR_TIMEOUT_S)
        except TimeoutError:
            raise TimeoutError(f"the scheduler did not clear within {CLEAR_TIMEOUT_S} s") from None
        return {"num_blocks_dropped": num}
