"""The kvmanager service: the block allocator behind one batched request per scheduler step.

Who talks to it, on its ROUTER (``Endpoints.kvmanager``), DEALER peers:
- the executor, once at start: ``RegisterPool`` -> ``PoolInfo`` (a new epoch resets all tables);
- the scheduler: ``GetPool`` -> ``PoolInfo`` (held until a pool is registered), then one
  ``KVStepRequest`` -> ``KVStepReply`` per step.
Its admin ROUTER (``Endpoints.admin_kvmanager``) answers ``stats`` and ``seq`` (a block table).
"""

from __future__ import annotations

import asyncio

import structlog
import zmq
import zmq.asyncio

from services.common import close_sockets, reply, serve_admin, serve_router
from services.kvmanager.allocator import BlockAllocator, NoFreeBlocks
from shared.config import KVManagerConfig
from shared.messages import GetPool, KVStepReply, KVStepRequest, PoolInfo, RegisterPool
from shared.transport import Decoder, make_socket

log = structlog.get_logger()


class KVManagerService:
    def __init__(self, config: KVManagerConfig, ctx: zmq.asyncio.Context):
        self.config = config
        self.recv_from_peers = make_socket(ctx, zmq.ROUTER, config.endpoints.kvmanager)
        self.recv_from_admin = make_socket(ctx, zmq.ROUTER, config.endpoints.admin_kvmanager)
        self.decoder = Decoder(RegisterPool, GetPool, KVStepRequest)
        self.handlers = {
            RegisterPool: self.handle_register_pool,
            GetPool: self.handle_get_pool,
            KVStepRequest: self.handle_kv_step,
        }
        self.admin_commands = {"stats": self.admin_stats, "seq": self.admin_seq}
        self.pool: RegisterPool | None = None
        self.allocator: BlockAllocator | None = None
        self.pool_waiters: list[list[bytes]] = []  # envelopes of GetPool asked before registration
        self.num_steps = 0

    async def run(self) -> None:
        try:
            await asyncio.gather(
                serve_router(self.recv_from_peers, self.decoder, self.handlers, log, "peers"),
                serve_admin(self.recv_from_admin, self.admin_commands, log),
            )
        finally:
            close_sockets(self.recv_from_peers, self.recv_from_admin)

    # ------------------------------------------------------------------ handlers
    def pool_info(self) -> PoolInfo:
        p = self.pool
        return PoolInfo(num_blocks=p.num_blocks, block_size=p.block_size, bytes_per_block=p.bytes_per_block,
                        epoch=p.epoch, max_model_len=p.max_model_len,
                        num_free_blocks=self.allocator.num_free_blocks)

    async def handle_register_pool(self, msg: RegisterPool, envelope: list[bytes]) -> PoolInfo:
        if self.pool is not None and self.pool.epoch != msg.epoch and self.allocator.block_tables:
            log.warning("executor restarted: dropping every block table", old_epoch=self.pool.epoch,
                        new_epoch=msg.epoch, num_seqs=len(self.allocator.block_tables))
        if self.pool is None or self.pool != msg:
            self.pool = msg
            self.allocator = BlockAllocator(msg.num_blocks, msg.block_size)
        log.info("pool registered", num_blocks=msg.num_blocks, block_size=msg.block_size,
                 bytes_per_block=msg.bytes_per_block, epoch=msg.epoch)
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
        alloc = self.allocator
        if alloc is None:
            log.warning("step before any pool was registered", step_id=msg.step_id)
            return KVStepReply(step_id=msg.step_id, failed_req_ids=[r for r, _ in msg.allocate])
        for req_id in msg.free_req_ids:
            alloc.free(req_id)
        new_block_ids: dict[str, list[int]] = {}
        failed: list[str] = []
        for req_id, num_tokens in msg.allocate:
            try:
                ids = alloc.allocate(req_id, num_tokens)
            except NoFreeBlocks:
                failed.append(req_id)
                continue
            if ids:
                new_block_ids[req_id] = ids
        if failed:
            log.info("allocation failed", step_id=msg.step_id, req_ids=failed, num_free_blocks=alloc.num_free_blocks)
        return KVStepReply(step_id=msg.step_id, new_block_ids=new_block_ids, failed_req_ids=failed,
                           num_free_blocks=alloc.num_free_blocks, epoch=self.pool.epoch)

    # ------------------------------------------------------------------ admin
    def admin_stats(self, args: dict) -> dict:
        if self.allocator is None:
            return {"registered": False, "num_blocks_total": 0, "num_blocks_used": 0, "num_blocks_free": 0,
                    "block_size": 0, "num_seqs": 0, "usage": 0.0, "num_steps": self.num_steps}
        return {
            "registered": True,
            **self.allocator.stats(),
            "bytes_per_block": self.pool.bytes_per_block,
            "epoch": self.pool.epoch,
            "max_model_len": self.pool.max_model_len,
            "num_steps": self.num_steps,
        }

    def admin_seq(self, args: dict) -> dict:
        req_id = args["req_id"]
        table = self.allocator.block_table(req_id) if self.allocator else []
        return {"req_id": req_id, "block_ids": table, "num_blocks": len(table)}
