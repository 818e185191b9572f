"""The scheduler with prefix caching, against the real allocator (``apply_step``, what the
kvmanager runs): new requests start after their cached blocks, the one kv call per step still
always fits, and tables whose growth never ran are discarded instead of cached."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.kvmanager.allocator import BlockAllocator
from services.kvmanager.service import apply_step
from services.scheduler.policy import Scheduler
from shared.messages import EngineRequest, PoolInfo, SamplingParams, StepResult


def make(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64):
    sched = Scheduler(max_num_seqs, max_num_batched_tokens)
    sched.set_pool(PoolInfo(num_blocks=num_blocks, block_size=block_size, bytes_per_block=1, epoch="e",
                            max_model_len=256, num_free_blocks=num_blocks))
    return sched, BlockAllocator(num_blocks, block_size)


def request(req_id, prompt, max_tokens=2, **sampling):
    return EngineRequest(req_id=req_id, prompt_token_ids=prompt, eos_token_id=0,
                         sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sampling))


def kv_call(alloc, out):
    return apply_step(alloc, out.kv_request())


def step(sched, alloc, token=7):
    out = sched.schedule()
    reply = kv_call(alloc, out) if sched.needs_kv_call(out) else None
    plan = sched.build_plan(out, reply)
    samplers = [r.req_id for r, _ in out.scheduled if r.num_computed_tokens == r.num_tokens]
    deltas = sched.update_from_result(out, StepResult(step_id=plan.step_id, req_ids=samplers,
                                                      sampled_token_ids=[[token]] * len(samplers)))
    return plan, deltas, reply


PREFIX = list(range(10, 22))  # 12 tokens: 3 full blocks of 4


def test_a_new_request_starts_after_its_cached_blocks():
    sched, alloc = make()
    sched.add_request(request("a", PREFIX + [1, 2]))
    step(sched, alloc)  # a's prefill: blocks 0..3
    sched.add_request(request("b", PREFIX + [3]))
    plan, deltas, reply = step(sched, alloc)
    (new,) = plan.new_reqs
    assert reply.num_cached_tokens == {"b": 12}
    assert new.num_computed_tokens == 12 and new.block_ids[:3] == [0, 1, 2]
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1}  # b computes only its last token
    assert sched.num_free_blocks == alloc.num_free_blocks
    assert [d.num_cached_tokens for d in deltas if d.req_id == "b"] == [12]
    assert sched.counters["num_cached_tokens_total"] == 12


def test_a_request_aborted_while_the_kvmanager_answers_is_discarded_not_cached():
    sched, alloc = make()
    sched.add_request(request("a", PREFIX + [1]))
    out = sched.schedule()
    reply = kv_call(alloc, out)
    sched.abort("a")  # arrives while the kv reply is on its way
    plan = sched.build_plan(out, reply)
    assert plan.new_reqs == []
    out = sched.schedule()
    assert out.discard_req_ids == ["a"] and out.free_req_ids == []
    kv_call(alloc, out)
    assert alloc.device.cached == {} and alloc.num_free_blocks == 16


def test_prompt_logprobs_requests_neither_hit_nor_feed_the_cache():
    sched, alloc = make()
    sched.add_request(request("a", PREFIX + [1], prompt_logprobs=1))
    step(sched, alloc)
    sched.add_request(request("b", PREFIX + [1]))
    plan, _, reply = step(sched, alloc)
    assert reply.num_cached_tokens == {} and plan.new_reqs[0].num_computed_tokens == 0


requests_st = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 9), st.integers(1, 6), st.integers(0, 8)),  # prefix, tail, max_tokens, arrival
    min_size=1, max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(requests_st, st.integers(8, 24), st.integers(2, 32), st.integers(1, 4))
def test_with_prefix_hits_every_kv_call_fits_and_every_request_completes(reqs, num_blocks, budget, max_num_seqs):
    sched, alloc = make(num_blocks=num_blocks, block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    prefixes = [[], PREFIX[:5], PREFIX, PREFIX + PREFIX[:6]]
    expected, finished = {}, {}
    for step_no in range(500):
        for i, (prefix, tail, max_tokens, arrival) in enumerate(reqs):
            prompt = prefixes[prefix] + [100 + i] * tail
            if arrival == step_no and not sched.add_request(request(f"r{i}", prompt, max_tokens)):
                expected[f"r{i}"] = max_tokens
        out = sched.schedule()
        if out is None:
            if step_no > 10:
                break
            continue
        reply = kv_call(alloc, out) if sched.needs_kv_call(out) else None
        assert reply is None or reply.failed_req_ids == []  # hits never take more than the mirror counted
        plan = sched.build_plan(out, reply)
        assert sum(plan.num_scheduled_tokens.values()) <= budget
        assert all(n > 0 for n in plan.num_scheduled_tokens.values())
        assert sched.num_free_blocks == alloc.num_free_blocks
        samplers = [r.req_id for r, _ in out.scheduled if r.num_computed_tokens == r.num_tokens]
        result = StepResult(step_id=plan.step_id, req_ids=samplers, sampled_token_ids=[[5]] * len(samplers))
        for delta in sched.update_from_result(out, result):
            finished.setdefault(delta.req_id, []).extend(delta.token_ids)
    assert {r: len(t) for r, t in finished.items()} == expected
    out = sched.schedule()
    if out is not None:
        kv_call(alloc, out)
    assert alloc.device.num_used_blocks == 0
