"""kvmanager prefix caching, forks, copy-on-write and the host tier: exact block ids, then a
hypothesis state machine that checks the allocator's invariants after every operation."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from folio.core.kv.allocator import BlockAllocator, NoFreeBlocks, hash_block
from folio.core.kv.steplog import StepLog
from folio.shared.messages import (
    BlockRemoved,
    BlockStored,
    KVAllocate,
    KVConfirm,
    KVFork,
    KVFree,
    KVSwapIn,
    KVSwapOut,
)


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


# ---------------------------------------------------------------------------- hashing


def test_block_hash_is_stable_and_chained():
    h = hash_block(None, [1, 2, 3, 4])
    assert h == hash_block(None, [1, 2, 3, 4]) and len(h) == 16
    assert h != hash_block(None, [1, 2, 3, 5])
    assert h != hash_block(None, [1, 2, 3, 4], ("tenant-a",))
    assert hash_block(h, [5, 6]) != hash_block(None, [5, 6])


# ---------------------------------------------------------------------------- prefix hits


def test_a_second_request_reuses_the_longest_cached_prefix():
    alloc = BlockAllocator(num_blocks=10, block_size=4)
    assert alloc.allocate("a", 10, tokens(10)) == [0, 1, 2]
    assert alloc.seqs["a"].num_cached_tokens == 0
    b_tokens = tokens(9) + [7, 7, 7]
    assert alloc.allocate("b", 12, b_tokens) == [3, 4, 5]  # a's blocks are not computed yet: no hit
    alloc.confirm_computed()  # the step ran
    assert alloc.allocate("c", 12, b_tokens) == [0, 1, 6]  # two full blocks of a's, then its own
    assert alloc.seqs["c"].num_cached_tokens == 8
    assert alloc.device.ref_counts[:3] == [2, 2, 1]
    stats = alloc.stats()
    assert (stats["num_prefix_cache_queries"], stats["num_prefix_cache_hits"]) == (34, 8)


def test_the_last_token_is_always_computed():
    alloc = BlockAllocator(num_blocks=10, block_size=4)
    alloc.allocate("a", 8, tokens(8))
    alloc.confirm_computed()
    assert alloc.allocate("b", 8, tokens(8)) == [0, 2]  # block 1 is cached too, but holds the last token
    assert alloc.seqs["b"].num_cached_tokens == 4


def test_cache_salt_keeps_tenants_apart():
    alloc = BlockAllocator(num_blocks=10, block_size=4)
    alloc.allocate("a", 9, tokens(9), cache_salt="tenant-a")
    alloc.confirm_computed()
    assert alloc.allocate("b", 9, tokens(9), cache_salt="tenant-b") == [3, 4, 5]
    assert alloc.allocate("c", 9, tokens(9), cache_salt="tenant-a") == [0, 1, 6]


def test_discarded_blocks_are_never_found():
    alloc = BlockAllocator(num_blocks=10, block_size=4)
    alloc.allocate("a", 9, tokens(9))
    StepLog(alloc).apply_all([KVConfirm(["a"]), KVFree(["a"])])  # its step failed: discarded
    assert alloc.device.cached == {} and alloc.num_free_blocks == 10
    assert alloc.allocate("b", 9, tokens(9)) == [3, 4, 5]


def test_prefix_caching_off_indexes_nothing():
    alloc = BlockAllocator(num_blocks=10, block_size=4, enable_prefix_caching=False)
    alloc.allocate("a", 9, tokens(9))
    alloc.confirm_computed()
    assert alloc.allocate("b", 9, tokens(9)) == [3, 4, 5]
    assert alloc.device.cached == {} and alloc.device.take_events() == []


# ---------------------------------------------------------------------------- eviction


def test_free_cached_blocks_are_evicted_lru_deepest_first():
    alloc = BlockAllocator(num_blocks=6, block_size=2)
    alloc.allocate("a", 6, tokens(6, 10))  # [0, 1, 2]
    alloc.allocate("b", 4, tokens(4, 50))  # [3, 4]
    alloc.confirm_computed()
    stored = alloc.device.take_events()
    assert [e.block_hashes for e in stored] == [alloc.seqs["a"].block_hashes, alloc.seqs["b"].block_hashes]
    assert stored[0].parent_block_hash is None and stored[0].token_ids == tokens(6, 10)
    alloc.free("a")
    alloc.free("b")
    assert list(alloc.device.free_queue) == [5]  # never used: handed out before any cached block
    assert list(alloc.device.cached_queue) == [2, 1, 0, 4, 3]
    assert alloc.stats()["num_blocks_cached"] == 5 and alloc.num_free_blocks == 6
    # a new request takes the free block, then evicts a's tail before its head, a before b
    assert alloc.allocate("c", 8, tokens(8, 90)) == [5, 2, 1, 0]
    removed = alloc.device.take_events()
    assert removed == [BlockRemoved(block_hashes=list(reversed(alloc_hashes(6, 10, 2))))]
    assert alloc.stats()["num_evictions"] == 3
    # b's head is still there; taking it back leaves b's tail the only block to evict
    assert alloc.allocate("d", 3, tokens(3, 50)) == [3, 4]
    assert alloc.seqs["d"].num_cached_tokens == 2


def alloc_hashes(n: int, start: int, block_size: int) -> list[bytes]:
    hashes: list[bytes] = []
    toks = tokens(n, start)
    for i in range(n // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, toks[i * block_size:(i + 1) * block_size]))
    return hashes


def test_a_hit_revives_a_free_cached_block_and_moves_it_out_of_the_lru():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    alloc.allocate("a", 4, tokens(4))
    alloc.confirm_computed()
    alloc.free("a")
    assert alloc.allocate("b", 3, tokens(3)) == [0, 2]  # block 0 revived, then a never-used block
    assert alloc.seqs["b"].num_cached_tokens == 2
    assert 0 not in alloc.device.cached_queue and alloc.device.ref_counts[0] == 1


def test_clear_drops_free_cached_blocks_only():
    alloc = BlockAllocator(num_blocks=6, block_size=2)
    alloc.allocate("a", 4, tokens(4))
    alloc.allocate("b", 4, tokens(4, 50))
    alloc.confirm_computed()
    alloc.free("a")
    alloc.device.take_events()
    assert alloc.clear_cache() == 2
    assert alloc.device.take_events() == [BlockRemoved(block_hashes=alloc_hashes(4, 100, 2)[::-1])]
    assert len(alloc.device.cached) == 2  # b's, still in use


# ---------------------------------------------------------------------------- forks


def test_fork_shares_blocks_and_copies_on_write_into_the_partial_last_block():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    alloc.allocate("a", 6, tokens(6))  # [0, 1]: block 1 holds 2 of 4 tokens
    alloc.confirm_computed()
    assert alloc.fork("a", "b") == [0, 1]
    assert alloc.device.ref_counts[:2] == [2, 2]
    assert alloc.allocate("b", 7, [7]) == []  # writes token 6 into shared block 1: copy it first
    assert alloc.take_copies() == ([(1, 2)], [], [])
    assert alloc.block_table("b") == [0, 2] and alloc.device.ref_counts[:3] == [2, 1, 1]
    assert alloc.allocate("a", 7, [8]) == []  # a owns block 1 alone now: writes in place
    assert alloc.take_copies() == ([], [], [])
    assert alloc.allocate("b", 9, [9, 9]) == [3]  # full blocks stay shared, growth is private
    assert alloc.block_table("b") == [0, 2, 3] and alloc.block_table("a") == [0, 1]
    assert alloc.stats()["num_cow_copies"] == 1


def test_fork_of_a_block_aligned_table_needs_no_copy():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    alloc.allocate("a", 8, tokens(8))
    alloc.fork("a", "b")
    assert alloc.allocate("b", 9, [1]) == [2]
    assert alloc.take_copies() == ([], [], [])


def test_copy_on_write_needs_a_free_block():
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    alloc.allocate("a", 6, tokens(6))
    alloc.fork("a", "b")
    assert not alloc.can_allocate("b", 7)
    with pytest.raises(NoFreeBlocks):
        alloc.allocate("b", 7, [1])
    assert alloc.block_table("b") == [0, 1] and alloc.device.ref_counts == [2, 2]


# ---------------------------------------------------------------------------- the host tier


def test_swap_out_and_in_move_tables_between_tiers():
    alloc = BlockAllocator(num_blocks=6, block_size=4, num_host_blocks=4)
    alloc.allocate("a", 6, tokens(6))  # [0, 1]
    alloc.allocate("b", 4, tokens(4, 50))  # [2]
    alloc.confirm_computed()
    assert alloc.swap_out("a") == [(0, 0), (1, 1)]
    assert alloc.block_table("a") == [] and alloc.seqs["a"].host_block_ids == [0, 1]
    # a's partial block 1 went back to the free queue, its full block 0 stays cached
    assert alloc.allocate("c", 16, tokens(16, 200)) == [3, 4, 5, 1]
    with pytest.raises(NoFreeBlocks):
        alloc.swap_in("a")  # one block (cached 0) is left for two
    alloc.free("c")
    pairs = alloc.swap_in("a")
    assert [h for h, _ in pairs] == [0, 1] and alloc.block_table("a") == [d for _, d in pairs]
    assert alloc.take_copies()[1:] == ([(0, 0), (1, 1)], pairs)
    assert alloc.host.num_used_blocks == 0
    stats = alloc.stats()
    assert (stats["num_swapped_out_blocks"], stats["num_swapped_in_blocks"]) == (2, 2)


def test_the_step_log_gives_the_owner_the_replicas_blocks_and_digest():
    replica = StepLog(BlockAllocator(num_blocks=4, block_size=4, num_host_blocks=4, record_events=False))
    owner = StepLog(BlockAllocator(num_blocks=4, block_size=4, num_host_blocks=4))
    assert replica.try_apply(KVAllocate("a", 0, 6, tokens(6))) == [0, 1]
    assert replica.try_apply(KVAllocate("b", 0, 8)) == [2, 3]
    assert replica.try_apply(KVAllocate("c", 0, 4)) is None  # refused: nothing changed, nothing logged
    ops, _, digest = replica.seal()
    assert len(ops) == 2 and owner.apply_all(ops) == [] and owner.seal()[2] == digest
    for op in (KVConfirm([]), KVSwapOut("b"), KVFork("a", "a2", 6), KVAllocate("a2", 6, 7, [1]), KVAllocate("c", 0, 4)):
        assert replica.try_apply(op) is not None
    ops, (copies, swap_out, swap_in), digest = replica.seal()
    assert swap_out == [(2, 0), (3, 1)] and swap_in == []
    assert copies == [(1, 3)]  # a2 wrote into the shared, partly filled block: copied first
    assert replica.alloc.block_table("a2") == [0, 3] and replica.alloc.block_table("c") == [2]
    assert replica.try_apply(KVSwapIn("b")) is None  # two blocks needed, none free
    assert owner.apply_all(ops) == [] and owner.seal()[2] == digest
    assert owner.alloc.block_table("a2") == [0, 3] and owner.alloc.take_copies() == ([], [], [])
    # an owner that diverged refuses an operation: the refusal enters its digest
    assert owner.apply_all([KVAllocate("d", 0, 4)]) != []
    assert replica.try_apply(KVFree(["a"])) == 2  # its table: [0, 1]
    assert replica.seal()[2] != owner.seal()[2]


# ---------------------------------------------------------------------------- invariants


def check_invariants(alloc: BlockAllocator) -> None:
    # a host hit is pinned (held) until the step that copies it takes its copies
    for pool, tables in ((alloc.device, [s.block_ids for s in alloc.seqs.values()]),
                         (alloc.host, [s.host_block_ids or [] for s in alloc.seqs.values()] + [alloc._pinned_host])):
        held = [b for table in tables for b in table]
        free, cached = set(pool.free_queue), set(pool.cached_queue)
        used = {b for b in range(pool.num_blocks) if pool.ref_counts[b] > 0}
        assert len(free) + len(cached) + len(used) == pool.num_blocks, "free + cached + used != total"
        assert not (free & cached) and not (set(held) & (free | cached)), "a block is free and referenced"
        for b in range(pool.num_blocks):
            assert pool.ref_counts[b] == held.count(b), f"ref count of block {b}"
        assert cached <= set(pool.cached), "a cached free block is not indexed"
        assert not free & set(pool.cached), "a free block is still indexed"
    bs = alloc.block_size
    for block_id, entry in alloc.device.cached.items():
        assert alloc.device.block_id_by_hash[entry.block_hash] == block_id
    for seq in alloc.seqs.values():
        for i, block_id in enumerate(seq.block_ids):
            entry = alloc.device.cached.get(block_id)
            if entry is not None:
                assert list(entry.token_ids) == seq.token_ids[i * bs:(i + 1) * bs], "hash vs tokens"
                assert entry.block_hash == seq.block_hashes[i]
                parent = seq.block_hashes[i - 1] if i else None
                assert hash_block(parent, entry.token_ids, seq.extra_keys) == entry.block_hash


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / evict / swap / clear sequences; tokens come from a
    tiny vocabulary so that prefixes repeat and the cache is exercised."""

    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(num_blocks=12, block_size=2, num_host_blocks=6)
        self.next_id = 0

    def live(self, swapped: bool | None = None) -> list[str]:
        return sorted(r for r, s in self.alloc.seqs.items() if swapped is None or (s.host_block_ids is not None) == swapped)

    @rule(new=st.lists(st.integers(0, 1), min_size=1, max_size=7), salt=st.sampled_from([None, None, "s"]))
    def allocate_new(self, new, salt):
        req_id = f"r{self.next_id}"
        self.next_id += 1
        try:
            self.alloc.allocate(req_id, len(new), new, salt)
        except NoFreeBlocks:
            assert req_id not in self.alloc.seqs

    @precondition(lambda self: self.live(False))
    @rule(data=st.data(), new=st.lists(st.integers(0, 1), min_size=1, max_size=5))
    def append(self, data, new):
        req_id = data.draw(st.sampled_from(self.live(False)))
        seq = self.alloc.seqs[req_id]
        before = (list(seq.block_ids), seq.num_tokens)
        try:
            self.alloc.allocate(req_id, seq.num_tokens + len(new), new)
        except NoFreeBlocks:
            assert (seq.block_ids, seq.num_tokens) == before

    @rule()
    def step_ran(self):  # as the kvmanager's step: the copies are taken, what was computed is kept
        self.alloc.take_copies()
        self.alloc.confirm_computed()

    @precondition(lambda self: self.live(False))
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live(False)))
        self.alloc.fork(parent, f"r{self.next_id}")
        self.next_id += 1

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def free(self, data):
        self.alloc.free(data.draw(st.sampled_from(self.live())))

    @precondition(lambda self: self.live(False))
    @rule(data=st.data())
    def swap_out(self, data):
        req_id = data.draw(st.sampled_from(self.live(False)))
        try:
            self.alloc.swap_out(req_id)
        except NoFreeBlocks:
            assert self.alloc.seqs[req_id].host_block_ids is None

    @precondition(lambda self: self.live(True))
    @rule(data=st.data())
    def swap_in(self, data):
        req_id = data.draw(st.sampled_from(self.live(True)))
        try:
            self.alloc.swap_in(req_id)
        except NoFreeBlocks:
            assert self.alloc.seqs[req_id].host_block_ids is not None

    @rule()
    def clear(self):
        self.alloc.clear_cache()

    @invariant()
    def consistent(self):
        check_invariants(self.alloc)

    def teardown(self):
        for req_id in self.live():
            self.alloc.free(req_id)
        self.alloc.take_copies()  # a host hit's pending copy holds its block until then
        check_invariants(self.alloc)
        assert self.alloc.device.num_used_blocks == 0 and self.alloc.host.num_used_blocks == 0, "leak"


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_allocator_state_machine = AllocatorMachine.TestCase


# ---------------------------------------------------------------------------- the service: events, admin


@pytest.mark.asyncio
async def test_events_are_published_numbered_and_admin_verbs_answer():
    import asyncio
    import shutil

    import zmq
    import zmq.asyncio

    from folio.services.kvmanager.service import KVManagerService
    from folio.shared.config import Endpoints, KVManagerConfig
    from folio.shared.messages import (
        KV_EVENTS_TOPIC,
        AllBlocksCleared,
        KVClear,
        KVClearCache,
        KVEventBatch,
        KVReset,
        KVStepReply,
        KVStepRequest,
        PoolInfo,
        RegisterPool,
    )
    from folio.shared.transport import Decoder, encode, make_socket
    from folio.services.in_process import admin_call, short_run_dir

    run_dir = short_run_dir()
    ep = Endpoints.ipc(run_dir)
    ctx = zmq.asyncio.Context()
    task = asyncio.ensure_future(KVManagerService(KVManagerConfig(endpoints=ep), ctx).run())
    try:
        sub = make_socket(ctx, zmq.SUB, ep.kv_events)
        sub.setsockopt(zmq.SUBSCRIBE, KV_EVENTS_TOPIC)
        peer = make_socket(ctx, zmq.DEALER, ep.kvmanager)
        decoder = Decoder(PoolInfo, KVStepReply, KVClearCache)
        replica = StepLog(BlockAllocator(6, 2, record_events=False))

        async def ask(message):
            await peer.send(encode(message))
            return decoder.decode(await asyncio.wait_for(peer.recv(), 5))

        async def step(step_id, *ops):
            for op in ops:
                assert replica.try_apply(op) is not None
            ops, _, digest = replica.seal()
            reply = await ask(KVStepRequest(step_id=step_id, generation=1, ops=ops))
            assert reply.in_sync and reply.digest == digest
            return reply

        async def next_batch():
            topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            return int.from_bytes(seq, "big"), Decoder(KVEventBatch).decode(payload)

        await asyncio.sleep(0.2)  # PUB/SUB: the subscription must arrive before the first event
        info = await ask(RegisterPool(num_blocks=6, block_size=2, bytes_per_block=8, epoch="e1"))
        await ask(KVReset(generation=1, pool=info))
        await step(0, KVAllocate("a", 0, 5, [1, 2, 3, 4, 5]))
        await step(1, KVConfirm(), KVAllocate("b", 0, 5, [1, 2, 3, 4, 6]))
        assert replica.alloc.seqs["b"].num_cached_tokens == 4 and replica.alloc.block_table("b")[:2] == [0, 1]
        seq, batch = await next_batch()
        (stored,) = batch.events
        assert seq == 0 and isinstance(stored, BlockStored)
        assert (stored.token_ids, stored.parent_block_hash, stored.block_size) == ([1, 2, 3, 4], None, 2)
        assert stored.block_hashes == alloc_hashes_of([1, 2, 3, 4], 2)

        data = (await admin_call(ctx, ep.admin_kvmanager, "blocks")).data
        assert data["device"] == ["2211.."]
        data = (await admin_call(ctx, ep.admin_kvmanager, "seq", req_id="b")).data
        assert (data["block_ids"], data["num_cached_tokens"], data["num_shared_blocks"]) == ([0, 1, 3], 4, 2)
        stats = (await admin_call(ctx, ep.admin_kvmanager, "stats")).data
        assert (stats["num_prefix_cache_queries"], stats["num_prefix_cache_hits"]) == (10, 4)

        await step(2, KVConfirm(), KVFree(["a", "b"]))  # nothing new became full: no event
        # ``folio kv clear`` goes through the scheduler's next log, so that both allocators drop it
        clear = asyncio.ensure_future(admin_call(ctx, ep.admin_kvmanager, "clear"))
        assert isinstance(decoder.decode(await asyncio.wait_for(peer.recv(), 5)), KVClearCache)
        await step(3, KVClear())
        assert (await clear).data == {"num_blocks_dropped": 2}
        assert replica.alloc.device.cached == {}
        seq, batch = await next_batch()
        assert seq == 1 and isinstance(batch.events[0], BlockRemoved) and len(batch.events[0].block_hashes) == 2
        await ask(RegisterPool(num_blocks=6, block_size=2, bytes_per_block=8, epoch="e2"))
        seq, batch = await next_batch()
        assert seq == 2 and batch.events == [AllBlocksCleared()]
        sub.close(linger=0)
        peer.close(linger=0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


def alloc_hashes_of(token_ids: list[int], block_size: int) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


# ---------------------------------------------------------------------------- /metrics and cache_salt


def test_metrics_count_prefix_cache_queries_and_hits_in_tokens():
    from folio.services.gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics("m")
    metrics.set_engine_stats(None, {"num_blocks_total": 10, "num_blocks_used": 4, "num_blocks_cached": 3,
                                    "num_prefix_cache_queries": 100, "num_prefix_cache_hits": 64})
    metrics.set_engine_stats(None, {"num_blocks_total": 10, "num_blocks_used": 4, "num_blocks_cached": 3,
                                    "num_prefix_cache_queries": 150, "num_prefix_cache_hits": 96})
    text = metrics.render().decode()
    assert 'folio:prefix_cache_queries_total{model_name="m"} 150.0' in text
    assert 'folio:prefix_cache_hits_total{model_name="m"} 96.0' in text
    assert 'folio:kv_cache_blocks_cached{model_name="m"} 3.0' in text
    assert 'folio:kv_cache_usage_perc{model_name="m"} 0.4' in text


def test_cache_salt_travels_from_the_http_request_to_the_generate_request():
    import msgspec

    from folio.services.gateway.convert import chat_generate_requests
    from folio.services.gateway.protocol import ChatCompletionRequest

    req = msgspec.json.decode(b'{"messages": [{"role": "user", "content": "hi"}], "cache_salt": "tenant-a", "n": 2}',
                              type=ChatCompletionRequest)
    (generate,) = chat_generate_requests(req, "chat")  # the second choice is forked from the first
    assert generate.cache_salt == "tenant-a" and generate.fork_req_ids == ["chat-1"]
