"""The router's KV index and routing policy, driven by hand-made event sequences (gaps, restarts,
clears, snapshots) and by the real allocator's events, hashed with the shared chained hash."""

from __future__ import annotations

from folio.services.router.index import KVIndex
from folio.services.router.replicas import Replica, parse_replica, read_load
from folio.services.router.routing import Router
from folio.core.kv.block_hash import block_extra_keys, chain_block_hashes
from folio.core.kv.allocator import BlockAllocator
from folio.shared.messages import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVSnapshot

BS = 4


def h(n: int) -> bytes:
    return n.to_bytes(16, "big")


def stored(*ns: int, medium: str = "GPU") -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[BlockStored(block_hashes=[h(n) for n in ns], parent_block_hash=None,
                                                    token_ids=[], block_size=BS, medium=medium)])


def removed(*ns: int) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[h(n) for n in ns])])


def cleared() -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[AllBlocksCleared()])


def held(index: KVIndex, name: str = "a") -> set[int]:
    return {int.from_bytes(b, "big") for b in index.view(name).block_hashes}


def synced_index() -> KVIndex:
    index = KVIndex()
    index.apply_snapshot("a", KVSnapshot(next_event_seq=0, block_size=BS, block_hashes=[]))
    return index


def test_events_in_order_store_remove_and_clear():
    index = synced_index()
    assert index.apply_batch("a", 0, stored(1, 2, 3)) == "applied"
    assert index.apply_batch("a", 1, removed(2)) == "applied"
    assert held(index) == {1, 3}
    assert index.apply_batch("a", 2, stored(9, medium="CPU")) == "applied"  # the host tier is no hit
    assert held(index) == {1, 3}
    assert index.apply_batch("a", 3, KVEventBatch(ts=0.0, events=[AllBlocksCleared(), BlockStored(
        block_hashes=[h(7)], parent_block_hash=None, token_ids=[], block_size=BS)])) == "applied"
    assert held(index) == {7}  # the clear comes first within its batch
    assert index.view("a").next_event_seq == 4


def test_a_gap_drops_the_view_and_a_snapshot_rebuilds_it_then_replays_what_followed():
    index = synced_index()
    index.apply_batch("a", 0, stored(1, 2))
    assert index.apply_batch("a", 2, stored(5)) == "gap"  # batch 1 was lost
    assert held(index) == set() and not index.in_sync("a")
    assert index.apply_batch("a", 3, removed(1)) == "buffered"
    assert index.apply_batch("a", 4, stored(6)) == "buffered"
    # the replica's account as of just before batch 3: batches 3 and 4 are replayed, 2 is in it already
    index.apply_snapshot("a", KVSnapshot(next_event_seq=3, block_size=BS, block_hashes=[h(1), h(2), h(3), h(5)]))
    assert held(index) == {2, 3, 5, 6}
    assert index.in_sync("a") and index.view("a").next_event_seq == 5
    assert index.apply_batch("a", 5, removed(3)) == "applied" and held(index) == {2, 5, 6}


def test_a_lower_number_means_the_kvmanager_restarted_and_nothing_old_is_kept():
    index = synced_index()
    for seq in range(3):
        index.apply_batch("a", seq, stored(10 + seq))
    assert index.apply_batch("a", 0, stored(99)) == "restart"
    assert held(index) == set()
    index.apply_snapshot("a", KVSnapshot(next_event_seq=1, block_size=BS, block_hashes=[h(99)]))
    assert held(index) == {99}


def test_without_a_snapshot_the_view_starts_empty_from_the_buffered_batches():
    index = KVIndex()
    assert index.apply_batch("a", 7, stored(1)) == "buffered"  # joined late: nothing applies yet
    assert index.num_cached_blocks("a", [h(1)]) == 0
    assert index.apply_batch("a", 8, stored(2)) == "buffered"
    index.start_empty("a")
    assert held(index) == {1, 2} and index.view("a").next_event_seq == 9
    index.mark_stale("a")
    index.start_empty("a")  # nothing buffered: the next batch, whatever its number, syncs
    assert index.apply_batch("a", 40, stored(3)) == "applied" and held(index) == {3}
    assert index.view("a").num_resyncs == 2


def test_cached_prefix_counts_leading_blocks_only():
    index = synced_index()
    index.apply_batch("a", 0, stored(1, 2, 4))
    assert index.num_cached_blocks("a", [h(1), h(2), h(3), h(4)]) == 2
    assert index.num_cached_blocks("a", [h(3), h(1), h(2)]) == 0  # a hit after a miss is no prefix


def replica(name: str, **state) -> Replica:
    r = parse_replica(name, 5555, 5561)
    r.up = True
    for key, value in state.items():
        setattr(r, key, value)
    return r


def feed_allocator_events(index: KVIndex, name: str, alloc: BlockAllocator, seq: int = 0) -> int:
    for event in alloc.device.take_events():
        assert index.apply_batch(name, seq, KVEventBatch(ts=0.0, events=[event])) == "applied"
        seq += 1
    return seq


def test_the_allocator_events_and_the_routers_hashes_agree_salt_included():
    """The real allocator caches a prompt; the router, hashing the same tokens with the shared code,
    finds the prefix on that replica only, and not under another tenant's salt."""
    alloc = BlockAllocator(num_blocks=32, block_size=BS)
    prompt = list(range(100, 130))  # 7 full blocks and 2 tokens
    alloc.allocate("r1", len(prompt), prompt, "tenant-a")
    alloc.confirm_computed()
    index = KVIndex()
    for name in ("http://a:1", "http://b:1"):
        index.apply_snapshot(name, KVSnapshot(next_event_seq=0, block_size=BS, block_hashes=[]))
    feed_allocator_events(index, "http://a:1", alloc)
    a, b = replica("http://a:1"), replica("http://b:1")
    router = Router(index, "cache_aware", load_cost_tokens=8, default_block_size=BS)
    later = prompt + [7, 8, 9, 10, 11]  # a later turn: the same prefix, more tokens
    decision = router.choose([a, b], later, "tenant-a")
    assert decision.replica is a and decision.reason == "cache" and decision.num_cached_tokens == 28
    assert chain_block_hashes(prompt, BS, block_extra_keys("tenant-a")) == alloc.seqs["r1"].block_hashes
    other_tenant = router.choose([a, b], later, "tenant-b")
    assert other_tenant.num_cached_tokens == 0 and other_tenant.reason == "load"
    # enough load on the replica with the prefix sends the work elsewhere
    a.num_running = 10
    assert router.choose([a, b], later, "tenant-a").replica is b


def test_equal_cost_spreads_by_requests_sent_and_down_or_tried_replicas_are_skipped():
    index = KVIndex()
    a, b = replica("http://a:1"), replica("http://b:1")
    router = Router(index, "cache_aware")
    counts = {a.name: 0, b.name: 0}
    for _ in range(10):
        counts[router.choose([a, b], [1, 2, 3]).replica.name] += 1
    assert counts == {a.name: 5, b.name: 5}
    a.num_inflight = 1  # busier: b until b is as busy
    assert [router.choose([a, b], [1, 2, 3]).replica for _ in range(3)] == [b, b, b]
    assert router.choose([a, b], None, exclude={a.name}).replica is b
    b.up = False
    assert router.choose([a, b], None).replica is a
    assert router.choose([a, b], None, exclude={a.name}) is None


def test_load_counts_the_fresher_of_our_inflight_and_the_replicas_own_numbers():
    r = replica("http://a:1", num_inflight=2, num_running=1, num_waiting=0)
    assert r.load == 2
    r.num_waiting = 5
    assert r.load == 6
    text = ('# TYPE folio:num_requests_running gauge\nfolio:num_requests_running{model_name="m"} 3.0\n'
            '# TYPE folio:num_requests_waiting gauge\nfolio:num_requests_waiting{model_name="m"} 4.0\n')
    assert read_load(text) == (3, 4)


def test_replica_specs():
    r = parse_replica("http://10.0.0.7:8001/,kv_events_port=6001,kv_snapshot_port=6002", 5555, 5561)
    assert (r.name, r.kv_events, r.kv_snapshot) == ("http://10.0.0.7:8001", "tcp://10.0.0.7:6001", "tcp://10.0.0.7:6002")
    assert parse_replica("http://svc:8000", 5555, 5561).kv_events == "tcp://svc:5555"
    for bad in ("svc:8000", "http://a:1,kv_port=3", "http://a:1,kv_events_port=x"):
        try:
            parse_replica(bad, 5555, 5561)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")


def test_round_robin_alternates_whatever_the_cache():
    index = synced_index()
    a, b = replica("http://a:1"), replica("http://b:1")
    router = Router(index, "round_robin")
    picks = [router.choose([a, b], [1, 2, 3, 4, 5]).replica.name for _ in range(4)]
    assert picks[0] != picks[1] and picks[0] == picks[2] and picks[1] == picks[3]


def test_prompts_are_tokenized_as_the_tokenizer_service_does(smollm_tokenizer_dir):
    """Chat (template included), text and token-id prompts give the ids the replica computes; a
    body the router cannot read gives None (routed by load) instead of an error."""
    from folio.services.router.prompt import PromptEncoder
    from folio.core.tokenizer.text import TextTokenizer
    from folio.shared.messages import ChatMessage, GenerateRequest
    from folio.shared.sampling import SamplingParams

    tokenizer = TextTokenizer(smollm_tokenizer_dir)
    encoder = PromptEncoder(tokenizer)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    replica_side = tokenizer.encode_request(GenerateRequest(req_id="x", sampling=SamplingParams(), messages=[
        ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there")]))[0]
    assert encoder.token_ids({"messages": messages}, chat=True) == replica_side
    assert encoder.token_ids({"prompt": "Hello world"}, chat=False) == tokenizer.hf.encode("Hello world")
    assert encoder.token_ids({"prompt": ["first", "second"]}, chat=False) == tokenizer.hf.encode("first")
    assert encoder.token_ids({"prompt": [5, 6, 7]}, chat=False) == [5, 6, 7]
    for bad in ({"messages": [{"content": "no role"}]}, {"messages": "x"}, {"prompt": 3}, {}):
        assert encoder.token_ids(bad, chat="messages" in bad) is None
