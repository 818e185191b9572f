"""Sliding-window memory: for a model whose every layer is windowed, the blocks behind the window
go back to the pool as a sequence grows (allocator, scheduler, the kvmanager's copy of the log);
for a model with a global layer none do. Exact block ids, digests equal to the allocator of
record's after every step, and the window's bound on what a sequence holds."""

from __future__ import annotations

import asyncio
from collections import deque

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.core.scheduler.policy import Scheduler
from folio.core.kv.allocator import BlockAllocator, cdiv
from folio.core.kv.window import all_layers_window, hybrid_kv_bytes, layer_windows_from_config, window_blocks
from folio.shared.messages import KVReset, KVStepRequest, PoolInfo, RegisterPool, StepResult
from folio.shared.transport import make_socket
from folio.services.in_process import admin_call
from tests.core.kv_owner import Owner
from tests.services.test_kvmanager import ask, kvmanager  # noqa: F401 (the service fixture)
from tests.core.scheduler.test_scheduler_invariants import check_allocator, output_of, token_of
from tests.core.scheduler.test_scheduler_policy import request


def make(window, num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, num_host_blocks=0,
         **options):
    sched = Scheduler(max_num_seqs, max_num_batched_tokens, None, **options)
    sched.set_pool(PoolInfo(num_blocks=num_blocks, block_size=block_size, bytes_per_block=1, epoch="e",
                            num_free_blocks=num_blocks, num_host_blocks=num_host_blocks, sliding_window=window))
    return sched, Owner(num_blocks, block_size, num_host_blocks, sliding_window=window)


def decode(alloc: BlockAllocator, req_id: str, num_tokens: int) -> None:
    """Grow ``req_id`` one token at a time to ``num_tokens``, allocating as the scheduler does
    (from its computed tokens), each step confirmed."""
    seq = alloc.seqs[req_id]
    for p in range(seq.num_tokens, num_tokens):
        alloc.allocate(req_id, p + 1, [p % 50 + 1], num_computed=p)
        alloc.confirm_computed()


# ---------------------------------------------------------------------------- the allocator


def test_a_windowed_sequence_gives_back_the_blocks_behind_its_window():
    alloc = BlockAllocator(num_blocks=8, block_size=4, sliding_window=6)
    assert alloc.allocate("a", 10, list(range(1, 11))) == [0, 1, 2]
    alloc.confirm_computed()
    # the query at 10 reads keys 5..10: block 0 (0..3) is behind the window, block 1 (4..7) is not
    alloc.allocate("a", 11, [11], num_computed=10)
    assert alloc.seqs["a"].num_skipped_blocks == 1 and alloc.block_tables == {"a": [1, 2]}
    assert alloc.block_table("a") == [0, 1, 2]  # the entry stays: positions still map to table[p // 4]
    assert list(alloc.device.cached_queue) == [0]  # indexed when computed: evictable, still findable
    decode(alloc, "a", 40)
    seq = alloc.seqs["a"]
    assert len(seq.block_ids) == 10 and len(seq.held_block_ids) <= cdiv(6, 4) + 1
    assert seq.held_block_ids == seq.block_ids[seq.num_skipped_blocks:]
    assert alloc.num_used_blocks == len(seq.held_block_ids) and alloc.stats()["num_window_skipped_blocks"] == 8
    check_allocator(alloc)
    assert alloc.free("a") == len(seq.held_block_ids) and alloc.num_free_blocks == 8


@pytest.mark.parametrize("window", [0, 64])
def test_without_a_window_every_block_stays(window):
    """0: some layer is global (an interleaved model); a window longer than the sequence frees nothing."""
    alloc = BlockAllocator(num_blocks=16, block_size=4, sliding_window=window)
    alloc.allocate("a", 1, [1])
    decode(alloc, "a", 40)
    assert alloc.block_tables["a"] == list(range(10)) and alloc.seqs["a"].num_skipped_blocks == 0


def test_the_bound_holds_for_every_length_window_and_block_size():
    for block_size in (1, 3, 4, 16):
        for window in (1, 2, 5, 8, 16, 17):
            alloc = BlockAllocator(num_blocks=64, block_size=block_size, sliding_window=window)
            alloc.allocate("a", 1, [1])
            for length in range(2, 120):
                decode(alloc, "a", length)
                held = len(alloc.seqs["a"].held_block_ids)
                assert held <= cdiv(window, block_size) + 1, (block_size, window, length)
                # every block a query at ``length - 1`` reads is still held
                assert held >= window_blocks(length - 1, window, block_size)


def test_a_growth_refused_changes_nothing_even_when_the_window_passed_blocks():
    alloc = BlockAllocator(num_blocks=4, block_size=2, sliding_window=2, enable_prefix_caching=False)
    alloc.allocate("a", 4)  # [0, 1]
    alloc.allocate("b", 4)  # [2, 3]
    alloc.fork("b", "c")  # c shares b's blocks: the window frees none of them for c alone
    with pytest.raises(Exception):
        alloc.allocate("c", 9, num_computed=4)  # block 0 of c goes back but 2 more are needed, 0 free
    assert alloc.seqs["c"].num_skipped_blocks == 0 and alloc.block_tables["c"] == [2, 3]
    # a grows by one block: its block 0 (positions 0, 1) is behind the window of position 4 first
    assert alloc.allocate("a", 5, num_computed=4) == [0]
    assert alloc.block_table("a") == [0, 1, 0] and alloc.block_tables["a"] == [1, 0]
    check_allocator(alloc)


def test_forked_tables_free_a_shared_block_once_both_passed_it():
    alloc = BlockAllocator(num_blocks=8, block_size=2, sliding_window=2, enable_prefix_caching=False)
    alloc.allocate("p", 4)  # [0, 1]
    alloc.fork("p", "q")
    alloc.allocate("p", 5, num_computed=4)  # p skips block 0; q still holds it
    assert alloc.device.ref_counts[:3] == [1, 2, 1]
    alloc.allocate("q", 5, num_computed=4)
    assert alloc.device.ref_counts[:4] == [0, 2, 1, 1] and alloc.seqs["q"].num_skipped_blocks == 1
    alloc.fork("q", "r")  # a fork of a windowed table shares only what it holds
    assert alloc.seqs["r"].num_skipped_blocks == 1 and alloc.device.ref_counts[:4] == [0, 3, 1, 2]
    for req_id in "pqr":
        alloc.free(req_id)
    assert alloc.num_free_blocks == 8
    check_allocator(alloc)


def test_swapping_moves_only_the_blocks_held():
    alloc = BlockAllocator(num_blocks=8, block_size=2, num_host_blocks=4, sliding_window=3,
                           enable_prefix_caching=False)
    alloc.allocate("a", 6)  # [0, 1, 2]
    alloc.allocate("a", 7, num_computed=6)  # skips block 1 and before: (6 - 3 + 1) // 2 = 2
    assert alloc.block_tables["a"] == [2, 3]
    assert alloc.swap_out("a") == [(2, 0), (3, 1)]
    assert alloc.swap_in("a") == [(0, 4), (1, 5)]
    assert alloc.block_table("a") == [0, 1, 4, 5] and alloc.block_tables["a"] == [4, 5]
    check_allocator(alloc)


def test_a_prefix_hit_behind_the_window_is_not_revived_and_hits_never_read_overwritten_blocks():
    """The blocks a windowed sequence gave back stay in the prefix cache while nobody needs them;
    a new sequence finds them, revives only those its window reads, and a block handed out again
    is no longer findable."""
    alloc = BlockAllocator(num_blocks=6, block_size=2, sliding_window=3)
    tokens = list(range(1, 13))
    alloc.allocate("a", 8, tokens[:8])
    alloc.confirm_computed()
    decode(alloc, "a", 12)  # the query at 11 reads 9..11: a holds blocks 4 and 5; 0..3 are cached, evictable
    # (each release gives its deepest block first: a tail is evicted before its head)
    assert alloc.block_tables["a"] == [4, 5] and list(alloc.device.cached_queue) == [2, 1, 0, 3]
    alloc.free("a")
    # b's prompt: a's first 10 tokens and one more; the hit is capped below its last token
    assert alloc.num_cached_blocks(tokens[:10] + [99], None, 5) == 5
    alloc.allocate("b", 11, tokens[:10] + [99])
    b = alloc.seqs["b"]
    assert b.num_cached_tokens == 10 and b.num_skipped_blocks == 4  # writes from 10: keys from 8 on
    # block 4 revived; 0..3 not: the fresh block for position 10 is the least recently freed
    # cached one, 2, which is also b's stale entry for positions 4, 5 (never read: behind its window)
    assert b.block_ids == [0, 1, 2, 3, 4, 2] and alloc.block_tables["b"] == [4, 2]
    # a block given out again is unindexed first: no hit can point at its new contents
    assert alloc.device.lookup(b.block_hashes[2]) is None
    assert alloc.num_cached_blocks(tokens[:10] + [99], None, 5) == 2


# ---------------------------------------------------------------------------- the scheduler


def run_steps(sched, alloc, max_steps=200, token=7):
    """Step until idle, checking the owner against the replica; the most blocks any table held."""
    most = 0
    for _ in range(max_steps):
        out = sched.schedule()
        if out is None:
            break
        alloc.apply(out, sched.alloc)
        check_allocator(alloc)
        most = max([most, *(len(t) for t in sched.alloc.block_tables.values())])
        plan = sched.build_plan(out)
        samplers = [r.req_id for r in out.samplers]
        sched.update_from_result(out, StepResult(step_id=plan.step_id, req_ids=samplers,
                                                 token_ids=[token] * len(samplers)))
    return most


def test_the_scheduler_runs_a_windowed_request_longer_than_the_pool():
    """40 prompt + 30 generated tokens in 4-token blocks want 18 blocks; a 6-block pool holds
    the window of 8 (at most 3 blocks) and a prefill chunk of 8 before it."""
    sched, alloc = make(8, num_blocks=6, max_num_batched_tokens=8)
    assert not sched.add_request(request("a", 40, max_tokens=30, ignore_eos=True))
    most = run_steps(sched, alloc)
    assert most <= cdiv(8 - 1 + 8, 4) + 1
    assert sched.counters["num_generation_tokens_total"] == 30 and sched.counters["num_preemptions"] == 0
    assert alloc.num_free_blocks == 6 and alloc.counters["num_window_skipped_blocks"] > 10


def test_without_a_window_the_same_request_is_refused():
    sched, _ = make(0, num_blocks=6, max_num_batched_tokens=8)
    (delta,) = sched.add_request(request("a", 40, max_tokens=30))
    assert delta.finish_reason == "error" and "needs 18 KV blocks" in delta.error
    sched, _ = make(8, num_blocks=6, max_num_batched_tokens=8, enable_chunked_prefill=False)
    (delta,) = sched.add_request(request("a", 40, max_tokens=30))  # the whole prompt in one step
    assert "needs 13 KV blocks" in delta.error  # (40 tokens after a window of 8: 13 blocks at most)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_preempted_windowed_sequence_comes_back_and_finishes(mode):
    """A windowed sequence past its window gives way to an urgent long prompt on a 7-block pool:
    its held blocks are copied to the host tier (its skipped entries stay behind) or freed; it
    comes back and finishes, and the owner agrees every step."""
    sched, alloc = make(8, num_blocks=7, max_num_batched_tokens=12, num_host_blocks=6, preemption_mode=mode,
                        scheduling_policy="priority")
    sched.add_request(request("late", 3, max_tokens=40, ignore_eos=True))
    run_steps(sched, alloc, max_steps=16)
    assert alloc.seqs["late"].num_skipped_blocks >= 2
    sched.add_request(msgspec.structs.replace(request("urgent", 30, max_tokens=10, ignore_eos=True), priority=-1))
    run_steps(sched, alloc, max_steps=400)
    counters = sched.counters
    assert counters["num_preemptions"] > 0 and counters["num_generation_tokens_total"] == 50
    assert counters["num_swap_outs"] == (counters["num_preemptions"] if mode == "swap" else 0) and not sched.requests
    assert alloc.counters["num_swapped_out_blocks"] <= 3 * counters["num_swap_outs"]  # held blocks only
    assert alloc.num_free_blocks == 7 and alloc.host.num_free_blocks == 6


@pytest.mark.parametrize("window, most", [(0, 18), (8, 3)])
def test_decodes_hold_the_window_and_interleaved_models_hold_everything(window, most):
    sched, alloc = make(window, num_blocks=20, max_num_batched_tokens=4)
    sched.add_request(request("a", 4, max_tokens=68, ignore_eos=True))
    run_steps(sched, alloc)
    # the last step's table (72 tokens): every block without the window, the window's with it
    assert alloc.counters["num_window_skipped_blocks"] == (0 if not window else 18 - most)


requests_st = st.lists(
    # prompt, max_tokens, arrival step, abort?, choices, where EOS comes (None: never)
    st.tuples(st.integers(1, 30), st.integers(1, 24), st.integers(0, 6), st.booleans(), st.integers(1, 3),
              st.none() | st.integers(0, 20)),
    min_size=1, max_size=8,
)


@settings(max_examples=120, deadline=None)
@given(requests_st, st.integers(1, 9), st.integers(8, 16), st.integers(2, 24), st.integers(1, 5),
       st.sampled_from(["recompute", "swap"]), st.booleans(), st.booleans(), st.booleans(),
       st.randoms(use_true_random=False))
def test_windowed_scheduling_keeps_the_owner_equal_and_every_output_whole(
        reqs, window, num_blocks, budget, max_num_seqs, mode, chunked, speculate, async_scheduling, rng):
    """With a window every table holds at most its window and the step's chunk, nothing leaks,
    the owner's digest and state equal the replica's after every step (forks, preemption by
    recompute or swap, drafts rolled back, steps planned ahead), and every request ends with all
    its tokens."""
    sched, alloc = make(window, num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        num_host_blocks=8, preemption_mode=mode, enable_chunked_prefill=chunked)
    sched.speculative = speculate
    eos_of = {f"r{i}": r[5] for i, r in enumerate(reqs)}
    finished: dict[str, list[int] | None] = {}
    admitted = {}
    in_flight: deque = deque()
    most_chunk = [1]  # the most tokens a sequence computed in one step so far

    def send(running=None) -> None:
        out = sched.schedule(running)
        if out is None:
            return
        alloc.apply(out, sched.alloc)
        check_allocator(alloc)
        # a table holds the window before the chunk of its last growth, and that chunk
        most_chunk[0] = max([most_chunk[0], *(num_new for _, num_new in out.scheduled)])
        for table in sched.alloc.block_tables.values():
            assert len(table) <= cdiv(window - 1 + most_chunk[0], 4) + 1
        plan = sched.build_plan(out)
        sampled, proposals, req_ids = [], [], []
        for r in out.samplers:
            drafts = plan.spec_token_ids.get(r.req_id, [])
            first = r.num_computed_tokens - len(drafts) - r.num_prompt_tokens
            eos_at = eos_of[r.req_id.partition(".")[0]]
            req_ids.append(r.req_id)
            sampled.append([0 if first + k == eos_at else token_of(r.req_id)
                            for k in range(rng.randint(0, len(drafts)) + 1)])
            proposals.append([token_of(r.req_id)] * rng.randint(0, 3) if speculate else [])
        in_flight.append((out, StepResult(step_id=plan.step_id, req_ids=req_ids, **StepResult.flat(sampled),
                                          spec_token_ids=proposals)))

    def receive() -> None:
        out, result = in_flight.popleft()
        for delta in sched.update_from_result(out, result).all_deltas():
            finished.setdefault(delta.req_id, []).extend(delta.token_ids)

    for step_no in range(800):
        for i, (num_prompt, max_tokens, arrival, abort, n, eos_at) in enumerate(reqs):
            choices = [f"r{i}.{k}" for k in range(1, n)]
            msg = request(f"r{i}", num_prompt, max_tokens, ignore_eos=eos_at is None)
            if arrival == step_no and not sched.add_request(msgspec.structs.replace(msg, fork_req_ids=choices)):
                admitted.update({req_id: (max_tokens, eos_at) for req_id in (f"r{i}", *choices)})
            if abort and arrival + 2 == step_no and sched.abort(f"r{i}"):
                finished[f"r{i}"] = None
        if not in_flight:
            send()
        if async_scheduling and len(in_flight) == 1 and sched.can_plan_ahead(in_flight[0][0]):
            send(in_flight[0][0])
        if not in_flight:
            if step_no > max(r[2] for r in reqs) + 3:
                break
            continue
        receive()
    assert not sched.requests and not sched.running and not sched.waiting and not sched.swapped
    for req_id, (max_tokens, eos_at) in admitted.items():
        if finished.get(req_id.partition(".")[0]) is not None:
            assert finished[req_id] == output_of(req_id, max_tokens, eos_at)
    out = sched.schedule()
    if out is not None:
        alloc.apply(out, sched.alloc)
    assert alloc.num_free_blocks == num_blocks and alloc.host.num_free_blocks == alloc.host.num_blocks


# ---------------------------------------------------------------------------- the kvmanager


@pytest.mark.asyncio
async def test_the_kvmanager_frees_behind_the_window_with_the_same_digest(kvmanager):  # noqa: F811
    """The executor registers the window; the kvmanager's pool tells the scheduler; the
    scheduler's logs leave the kvmanager's allocator with the replica's digest, step after step."""
    ctx, ep = kvmanager
    peer = make_socket(ctx, zmq.DEALER, ep.kvmanager)
    info = await ask(peer, RegisterPool(num_blocks=6, block_size=4, bytes_per_block=8, epoch="e1", sliding_window=8))
    assert info.sliding_window == 8
    assert await ask(peer, KVReset(generation=1, pool=info)) == info
    sched = Scheduler(4, 8)
    sched.set_pool(info)
    sched.add_request(request("a", 40, max_tokens=30, ignore_eos=True))
    sched.add_request(request("b", 9, max_tokens=20, ignore_eos=True))
    num_steps = 0
    while (out := sched.schedule()) is not None:
        if out.ops:
            reply = await ask(peer, KVStepRequest(step_id=out.step_id, generation=1, ops=out.ops))
            assert reply.in_sync and reply.digest == out.digest
        plan = sched.build_plan(out)
        samplers = [r.req_id for r in out.samplers]
        sched.update_from_result(out, StepResult(step_id=plan.step_id, req_ids=samplers, token_ids=[7] * len(samplers)))
        num_steps += 1
        if num_steps == 20:  # the admin's table: the blocks held, not the skipped entries
            seq = (await admin_call(ctx, ep.admin_kvmanager, "seq", req_id="a")).data
            replica = sched.alloc.seqs["a"]
            assert replica.num_skipped_blocks > 2 and seq["num_skipped_blocks"] == replica.num_skipped_blocks
            assert seq["block_ids"] == replica.held_block_ids and seq["block_ref_counts"] == [1] * len(seq["block_ids"])
    assert num_steps > 30 and sched.alloc.counters["num_window_skipped_blocks"] > 10
    stats = (await admin_call(ctx, ep.admin_kvmanager, "stats")).data
    assert stats["sliding_window"] == 8 and stats["num_window_skipped_blocks"] == sched.alloc.counters[
        "num_window_skipped_blocks"] and stats["num_blocks_used"] == 0 and stats["num_refused_ops"] == 0
    peer.close(linger=0)
    await asyncio.sleep(0)


# ---------------------------------------------------------------------------- which models, and what interleaving costs


@pytest.mark.parametrize("model_type, options, window", [
    ("mistral", dict(sliding_window=8), 8),
    ("phi3", dict(sliding_window=8), 8),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), 8),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), 0),  # layer 0 global
    ("qwen2", dict(sliding_window=8), 0),  # use_sliding_window off
    ("gemma2", dict(sliding_window=8), 0),  # every other layer global
    ("gemma3_text", dict(sliding_window=8), 0),
    ("llama", {}, 0),
])
def test_the_window_is_read_from_config_json_as_transformers_applies_it(tmp_path, model_type, options, window):
    """The torch-free reader agrees with the model's per-layer windows (read from transformers'
    config class), on a checkpoint's config.json."""
    import json

    import transformers

    from folio.core.executor.model.layers import layer_windows

    config = transformers.AutoConfig.for_model(model_type, num_hidden_layers=6, **options)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert layer_windows_from_config(saved) == layer_windows(config)
    assert all_layers_window(layer_windows_from_config(saved)) == window
    # older config.json files carry no layer_types: the family's own rule gives the same
    saved.pop("layer_types", None)
    assert layer_windows_from_config(saved) == layer_windows(config)


def test_interleaved_layers_hold_more_than_an_ideal_hybrid_layout():
    """Gemma 3 12B's shape (48 layers, 5 local with a 1,024 window to 1 global, 8 KV heads of
    256, bf16): one table for every layer holds every position in every layer."""
    gemma3 = dict(model_type="gemma3_text", num_hidden_layers=48, sliding_window=1024)
    windows = layer_windows_from_config(gemma3)
    assert windows.count(0) == 8 and all_layers_window(windows) == 0
    per_token = 2 * 8 * 256 * 2 * 48  # K and V, every layer
    for num_tokens, ideal_tokens in ((8192, 8 * 8192 + 40 * 1024), (32768, 8 * 32768 + 40 * 1024)):
        held, ideal = hybrid_kv_bytes(windows, num_tokens, 16, 8, 256)
        assert held == per_token * num_tokens
        # a local layer keeps its window's blocks: 1,024 positions and at most one more block
        assert ideal_tokens * per_token // 48 <= ideal <= (ideal_tokens + 40 * 16) * per_token // 48
    # an all-windowed model frees behind its window already: held == ideal
    mistral = layer_windows_from_config(dict(model_type="mistral", num_hidden_layers=32, sliding_window=4096))
    held, ideal = hybrid_kv_bytes(mistral, 32768, 16, 8, 128)
    assert held == ideal == window_blocks(32768, 4096, 16) * 2 * 16 * 8 * 128 * 2 * 32
