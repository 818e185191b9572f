"""Property tests: whatever arrives (with several choices or not), aborts and runs out of blocks,
under either preemption mode, with chunked prefill or without, with speculative drafts and
kvmanager restarts, the allocator never leaks or double-frees, the scheduler's replica equals the
kvmanager's allocator after every step, the executor, fed the plans' diffs, holds what the
scheduler planned with (counts and block tables), every step respects the token budget and the sequence
cap, and every request ends with all its tokens (stopping at EOS or not), planning each step
after the last one's result or, with async scheduling, while it runs."""

from __future__ import annotations

from collections import Counter, deque

from hypothesis import given, settings
from hypothesis import strategies as st

import msgspec
import pytest

from folio.core.kv.allocator import BlockAllocator
from folio.shared.messages import PoolInfo, StepResult
from tests.core.kv_owner import Owner
from tests.core.scheduler.plan_mirror import ExecutorMirror
from tests.core.scheduler.test_scheduler_policy import make, request


def check_allocator(alloc: BlockAllocator) -> None:
    held = Counter(b for table in alloc.block_tables.values() for b in table)
    for block_id, num_tables in held.items():  # shared by forks or the prefix cache: counted
        assert alloc.device.ref_counts[block_id] == num_tables, "a block's ref count is off"
    assert not set(held) & set(alloc.free_block_ids), "a block is both held and free"
    assert len(held) + alloc.num_free_blocks == alloc.num_blocks, "a block leaked"
    host = [b for s in alloc.seqs.values() for b in s.host_block_ids or []]
    assert len(host) == len(set(host)) and len(host) + alloc.host.num_free_blocks == alloc.host.num_blocks


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("af"), st.integers(0, 5), st.integers(1, 40)), max_size=60))
def test_allocator_never_leaks_or_double_frees(ops):
    alloc = BlockAllocator(num_blocks=16, block_size=4)
    for op, req, num_tokens in ops:
        if op == "a" and alloc.can_allocate(str(req), num_tokens):
            alloc.allocate(str(req), num_tokens)
        elif op == "f":
            alloc.free(str(req))
        check_allocator(alloc)


requests_st = st.lists(
    # prompt, max_tokens, arrival step, abort?, choices, where EOS comes (None: never)
    st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(0, 6), st.booleans(), st.integers(1, 3),
              st.none() | st.integers(0, 8)),
    min_size=1, max_size=10,
)


def token_of(req_id: str) -> int:
    return sum(map(ord, req_id)) % 50 + 1


def output_of(req_id: str, max_tokens: int, eos_at: int | None) -> list[int]:
    """What the fake executor makes a request generate: its own token, and EOS (0) at ``eos_at``."""
    tokens = [0 if k == eos_at else token_of(req_id) for k in range(max_tokens)]
    return tokens[:tokens.index(0) + 1] if 0 in tokens else tokens


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@settings(max_examples=250, deadline=None)
@given(requests_st, st.integers(6, 20), st.integers(1, 24), st.integers(1, 6), st.sampled_from(["recompute", "swap"]),
       st.booleans(), st.booleans(), st.sets(st.integers(1, 30), max_size=2), st.booleans(),
       st.randoms(use_true_random=False))
def test_scheduler_keeps_its_promises(async_scheduling, reqs, num_blocks, budget, max_num_seqs, mode, chunked,
                                      speculate, restarts, lose_in_flight, rng):
    """``speculate``: the executor proposes 0..3 drafts after each sample and accepts a random
    prefix of what it verifies (drafts are the request's own token, so outputs stay checkable).
    ``restarts``: steps before which the kvmanager restarts empty (the scheduler starts a new epoch
    once the steps in flight answered) or, with ``lose_in_flight``, the executor restarts (the steps
    in flight never answer). ``async_scheduling``: the next step is planned while one runs, as
    the service does, whenever the policy allows it; the outputs are the same."""
    sched, alloc = make(num_blocks=num_blocks, block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        num_host_blocks=8, preemption_mode=mode, enable_chunked_prefill=chunked)
    sched.speculative = speculate
    eos_of = {f"r{i}": r[5] for i, r in enumerate(reqs)}
    finished: dict[str, list[int] | None] = {}
    admitted = {}
    in_flight: deque = deque()  # (StepOutput, StepResult) sent, oldest first
    executor = ExecutorMirror()  # what the executor holds, from the plans' diffs alone

    def send(running=None) -> None:
        out = sched.schedule(running)
        if out is None:
            return
        alloc.apply(out, sched.alloc)  # the same log gives the owner the replica's state and digest
        check_allocator(alloc)
        full = executor.full_state(out, sched.alloc)
        plan = sched.build_plan(out)
        assert executor.apply(plan) == full, "the diffs left the executor with another state than the plan's"
        if chunked:
            assert sum(plan.num_scheduled_tokens.values()) <= budget
        else:  # one whole prompt may pass the budget, alone with the decodes
            assert sum(1 for n in plan.num_scheduled_tokens.values() if n > budget) <= 1
        assert len(plan.num_scheduled_tokens) <= max_num_seqs
        # the executor's side as it runs the plan: a sampler's next output position is what it computed
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

    delivered = [0]  # tokens the deltas carried, aborted requests' included

    def receive() -> None:
        out, result = in_flight.popleft()
        for delta in sched.update_from_result(out, result).all_deltas():
            delivered[0] += len(delta.token_ids)
            finished.setdefault(delta.req_id, []).extend(delta.token_ids)

    for step_no in range(600):
        for i, (num_prompt, max_tokens, arrival, abort, n, eos_at) in enumerate(reqs):
            choices = [f"r{i}.{k}" for k in range(1, n)]
            msg = request(f"r{i}", num_prompt, max_tokens, ignore_eos=eos_at is None)
            if arrival == step_no and not sched.add_request(msgspec.structs.replace(msg, fork_req_ids=choices)):
                assert n <= max_num_seqs  # more choices than the cap are refused, never stuck
                admitted.update({req_id: (max_tokens, eos_at) for req_id in (f"r{i}", *choices)})
            if abort and arrival + 2 == step_no and sched.abort(f"r{i}"):
                finished[f"r{i}"] = None
        if step_no in restarts:
            if lose_in_flight:
                in_flight.clear()
                executor = ExecutorMirror()  # a new executor holds nothing
            while in_flight:
                receive()
            alloc = Owner(num_blocks, 4, 8)
            sched.new_epoch(PoolInfo(num_blocks=num_blocks, block_size=4, bytes_per_block=1, epoch="e",
                                     max_model_len=64, num_host_blocks=8))
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
    assert speculate or sched.counters["num_spec_drafts"] == 0
    assert async_scheduling or sched.counters["num_steps_planned_ahead"] == 0
    assert sched.counters["num_generation_tokens_total"] == delivered[0]  # each token counted once
    for req_id, (max_tokens, eos_at) in admitted.items():
        if finished.get(req_id.partition(".")[0]) is not None:
            assert finished[req_id] == output_of(req_id, max_tokens, eos_at)
    # the last releases ride on one more call
    out = sched.schedule()
    if out is not None:
        alloc.apply(out, sched.alloc)
    assert alloc.num_free_blocks == num_blocks and alloc.host.num_free_blocks == alloc.host.num_blocks
