"""kvmanager: the allocator with exact block ids, and the service over real ipc:// sockets."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from folio.core.kv.allocator import BlockAllocator, NoFreeBlocks
from folio.core.kv.steplog import StepLog
from folio.services.kvmanager.service import KVManagerService
from folio.shared.config import Endpoints, KVManagerConfig
from folio.shared.messages import (
    GetPool,
    KVAllocate,
    KVClearCache,
    KVConfirm,
    KVFree,
    KVReset,
    KVStepReply,
    KVStepRequest,
    KVSwapOut,
    PoolInfo,
    RegisterPool,
)
from folio.shared.transport import Decoder, encode, make_socket
from folio.services.in_process import admin_call, short_run_dir

# ---------------------------------------------------------------------------- the allocator


def test_allocate_hands_out_lowest_ids_and_grows_tables():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    assert alloc.allocate("a", 5) == [0, 1]  # 5 tokens: 2 blocks
    assert alloc.allocate("b", 4) == [2]
    assert alloc.allocate("a", 8) == []  # still 2 blocks
    assert alloc.allocate("a", 9) == [3]
    assert alloc.block_table("a") == [0, 1, 3]
    stats = alloc.stats()
    assert {k: stats[k] for k in ("num_blocks_total", "num_blocks_used", "num_blocks_free", "num_blocks_cached",
                                  "block_size", "num_seqs", "usage")} == {
        "num_blocks_total": 8, "num_blocks_used": 4, "num_blocks_free": 4, "num_blocks_cached": 0,
        "block_size": 4, "num_seqs": 2, "usage": 0.5}


def test_free_returns_blocks_to_the_tail_last_block_first():
    alloc = BlockAllocator(num_blocks=6, block_size=2)
    alloc.allocate("a", 6)  # [0, 1, 2]
    alloc.allocate("b", 2)  # [3]
    assert alloc.free("a") == 3
    assert list(alloc.free_block_ids) == [4, 5, 2, 1, 0]
    assert alloc.allocate("c", 6) == [4, 5, 2]
    assert alloc.free("unknown") == 0


def test_allocation_is_all_or_nothing():
    alloc = BlockAllocator(num_blocks=3, block_size=4)
    alloc.allocate("a", 8)
    assert not alloc.can_allocate("b", 8)
    with pytest.raises(NoFreeBlocks):
        alloc.allocate("b", 8)
    assert alloc.block_table("b") == [] and alloc.num_free_blocks == 1


# ---------------------------------------------------------------------------- the service


@pytest_asyncio.fixture
async def kvmanager():
    run_dir = short_run_dir()
    endpoints = Endpoints.ipc(run_dir)
    ctx = zmq.asyncio.Context()
    task = asyncio.ensure_future(KVManagerService(KVManagerConfig(endpoints=endpoints), ctx).run())
    yield ctx, endpoints
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    ctx.destroy(linger=0)  # a failed test leaves its sockets open: term() would wait forever
    shutil.rmtree(run_dir, ignore_errors=True)


async def ask(sock, message, timeout_s=5.0):
    await sock.send(encode(message))
    return Decoder(PoolInfo, KVStepReply, KVClearCache).decode(await asyncio.wait_for(sock.recv(), timeout_s))


class Scheduler:
    """The scheduler's side: a replica planned against, its logs sent, the digests compared."""

    def __init__(self, sock, info: PoolInfo, generation: int = 1):
        self.sock, self.generation = sock, generation
        self.log = StepLog(BlockAllocator(info.num_blocks, info.block_size, info.num_host_blocks, record_events=False))
        self.next_step_id = 0

    async def step(self, *ops, expect_in_sync=True) -> KVStepReply:
        for op in ops:
            assert self.log.try_apply(op) is not None
        ops, _, digest = self.log.seal()
        reply = await ask(self.sock, KVStepRequest(step_id=self.next_step_id, generation=self.generation, ops=ops))
        self.next_step_id += 1
        assert reply.in_sync == expect_in_sync and (reply.digest == digest) == expect_in_sync
        return reply


@pytest.mark.asyncio
async def test_scheduler_waits_for_the_pool_then_its_logs_keep_both_allocators_equal(kvmanager):
    ctx, ep = kvmanager
    scheduler = make_socket(ctx, zmq.DEALER, ep.kvmanager)
    executor = make_socket(ctx, zmq.DEALER, ep.kvmanager)
    await scheduler.send(encode(GetPool()))
    with pytest.raises(asyncio.TimeoutError):  # no pool yet: the reply waits
        await asyncio.wait_for(scheduler.recv(), 0.3)
    pool = RegisterPool(num_blocks=10, block_size=4, bytes_per_block=1024, epoch="e1", max_model_len=64)
    info = await ask(executor, pool)
    assert info == PoolInfo(num_blocks=10, block_size=4, bytes_per_block=1024, epoch="e1", max_model_len=64,
                            num_free_blocks=10)
    assert Decoder(PoolInfo).decode(await asyncio.wait_for(scheduler.recv(), 5)) == info
    assert await ask(scheduler, KVReset(generation=1, pool=info)) == info
    sched = Scheduler(scheduler, info)
    await sched.step(KVAllocate("a", 0, 5), KVAllocate("b", 0, 12))
    await sched.step(KVConfirm(), KVFree(["b"]), KVAllocate("a", 5, 9), KVAllocate("c", 0, 16))
    # never-used blocks go first; b's join the tail of the free queue
    assert sched.log.alloc.block_table("a") == [0, 1, 5] and sched.log.alloc.block_table("c") == [6, 7, 8, 9]

    stats = (await admin_call(ctx, ep.admin_kvmanager, "stats")).data
    assert (stats["num_blocks_total"], stats["num_blocks_used"], stats["num_blocks_free"], stats["block_size"]) == (10, 7, 3, 4)
    seq = (await admin_call(ctx, ep.admin_kvmanager, "seq", req_id="c")).data
    assert (seq["req_id"], seq["block_ids"], seq["num_blocks"]) == ("c", [6, 7, 8, 9], 4)

    # a log of another sync epoch is not applied
    stale = Scheduler(scheduler, info, generation=7)
    await stale.step(KVFree(["a", "c"]), expect_in_sync=False)
    assert (await admin_call(ctx, ep.admin_kvmanager, "stats")).data["num_blocks_used"] == 7
    await sched.step(KVConfirm(), KVFree(["a", "c"]))
    stats = (await admin_call(ctx, ep.admin_kvmanager, "stats")).data
    assert stats["num_blocks_used"] == 0 and stats["num_seqs"] == 0 and stats["num_refused_ops"] == 0
    scheduler.close(linger=0)
    executor.close(linger=0)


@pytest.mark.asyncio
async def test_a_new_executor_pool_puts_the_scheduler_out_of_sync(kvmanager):
    ctx, ep = kvmanager
    peer = make_socket(ctx, zmq.DEALER, ep.kvmanager)
    info = await ask(peer, RegisterPool(num_blocks=4, block_size=2, bytes_per_block=8, epoch="e1"))
    await ask(peer, KVReset(generation=1, pool=info))
    sched = Scheduler(peer, info)
    await sched.step(KVAllocate("a", 0, 8))
    info = await ask(peer, RegisterPool(num_blocks=4, block_size=2, bytes_per_block=8, epoch="e2"))
    assert info.num_free_blocks == 4 and info.epoch == "e2"
    await sched.step(KVFree(["a"]), expect_in_sync=False)
    peer.close(linger=0)


@pytest.mark.asyncio
async def test_a_restarted_kvmanager_adopts_the_schedulers_pool(kvmanager):
    ctx, ep = kvmanager
    peer = make_socket(ctx, zmq.DEALER, ep.kvmanager)
    info = PoolInfo(num_blocks=6, block_size=2, bytes_per_block=8, epoch="e1", max_model_len=32, num_host_blocks=2)
    sched = Scheduler(peer, info, generation=3)
    await sched.step(KVAllocate("a", 0, 3), expect_in_sync=False)  # it knows no pool, no epoch
    sched.log = Scheduler(peer, info, generation=3).log  # the scheduler starts a new epoch
    reply = await ask(peer, KVReset(generation=3, pool=info))
    assert (reply.num_blocks, reply.num_host_blocks, reply.epoch, reply.num_free_blocks) == (6, 2, "e1", 6)
    await sched.step(KVAllocate("a", 0, 3), KVSwapOut("a"))
    assert (await admin_call(ctx, ep.admin_kvmanager, "stats")).data["num_host_blocks_used"] == 2
    peer.close(linger=0)


@pytest.mark.asyncio
async def test_survives_malformed_messages_on_every_socket(kvmanager):
    ctx, ep = kvmanager
    peer = make_socket(ctx, zmq.DEALER, ep.kvmanager)
    await peer.send(b"\xff\x00garbage")
    await peer.send(encode({"type": "kv_step", "step_id": "not an int"}))
    admin = make_socket(ctx, zmq.DEALER, ep.admin_kvmanager)
    await admin.send(b"\x93not admin")
    info = await ask(peer, RegisterPool(num_blocks=4, block_size=2, bytes_per_block=8, epoch="e1"))
    assert info.num_free_blocks == 4
    reply = await admin_call(ctx, ep.admin_kvmanager, "stats")
    assert reply.ok and reply.data["num_blocks_total"] == 4
    reply = await admin_call(ctx, ep.admin_kvmanager, "no-such-verb")
    assert not reply.ok and "unknown command" in reply.error
    peer.close(linger=0)
    admin.close(linger=0)
