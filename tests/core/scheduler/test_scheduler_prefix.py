"""The scheduler with prefix caching, planning with its allocator replica while an allocator of
record applies its logs (what the kvmanager runs): new requests start after their cached blocks,
cached tokens cost nothing from the budget or the free blocks, and tables whose growth never ran
are discarded instead of cached."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from folio.core.scheduler.policy import Scheduler
from folio.shared.messages import EngineRequest, PoolInfo, StepResult
from folio.shared.sampling import SamplingParams
from tests.core.kv_owner import Owner


def make(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64):
    sched = Scheduler(max_num_seqs, max_num_batched_tokens)
    sched.set_pool(PoolInfo(num_blocks=num_blocks, block_size=block_size, bytes_per_block=1, epoch="e",
                            max_model_len=256, num_free_blocks=num_blocks))
    return sched, Owner(num_blocks, block_size)


def request(req_id, prompt, max_tokens=2, **sampling):
    return EngineRequest(req_id=req_id, prompt_token_ids=prompt, eos_token_id=0,
                         sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sampling))


def step(sched, alloc, token=7, fail=()):
    """One step; the requests in ``fail`` get no token back (the executor failed them)."""
    out = sched.schedule()
    alloc.apply(out, sched.alloc)
    plan = sched.build_plan(out)
    samplers = [r.req_id for r, _ in out.scheduled if r.num_computed_tokens == r.num_tokens and r.req_id not in fail]
    deltas = sched.update_from_result(out, StepResult(step_id=plan.step_id, req_ids=samplers,
                                                      token_ids=[token] * len(samplers)))
    return plan, deltas.all_deltas()


PREFIX = list(range(10, 22))  # 12 tokens: 3 full blocks of 4


def test_a_new_request_starts_after_its_cached_blocks():
    sched, alloc = make()
    sched.add_request(request("a", PREFIX + [1, 2]))
    step(sched, alloc)  # a's prefill: blocks 0..3
    sched.add_request(request("b", PREFIX + [3]))
    plan, deltas = step(sched, alloc)
    (new,) = plan.new_reqs
    assert new.num_computed_tokens == 12 and new.block_ids[:3] == [0, 1, 2]
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1}  # b computes only its last token
    assert [d.num_cached_tokens for d in deltas if d.req_id == "b"] == [12]
    assert sched.counters["num_cached_tokens_total"] == 12


def test_a_mostly_cached_prompt_joins_running_work_without_preempting_anyone():
    """A 40-token prompt whose first 36 tokens are cached, arriving while 3 requests decode in a
    pool with 3 free blocks and a budget of 8 tokens: it needs 1 new block and 4 tokens."""
    sched, alloc = make(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    system = list(range(100, 136))  # 9 full blocks
    sched.add_request(request("warm", system + [1], max_tokens=1))
    while sched.has_work():
        step(sched, alloc)
    for i in range(3):  # each holds 1 block and grows into a 2nd
        sched.add_request(request(f"run{i}", [200 + i] * 3, max_tokens=4))
    step(sched, alloc)
    # 9 free blocks hold the cached prompt, 3 blocks are running work: 4 fresh ones are left
    assert sched.alloc.num_free_blocks == 13 and len(sched.alloc.device.free_queue) == 4
    sched.add_request(request("cached", system + [7, 8, 9, 10], max_tokens=2))
    plan, _ = step(sched, alloc)
    assert set(plan.num_scheduled_tokens) == {"run0", "run1", "run2", "cached"}
    assert plan.num_scheduled_tokens["cached"] == 4 and plan.new_reqs[0].num_computed_tokens == 36
    assert sched.counters["num_preemptions"] == 0
    while sched.has_work():
        step(sched, alloc)
    assert sched.counters["num_preemptions"] == 0


def test_a_request_whose_step_failed_is_discarded_not_cached():
    sched, alloc = make()
    sched.add_request(request("a", PREFIX + [1]))
    _, deltas = step(sched, alloc, fail={"a"})  # the executor returned nothing for it
    assert [d.finish_reason for d in deltas] == ["error"]
    step(sched, alloc)
    assert alloc.device.cached == {} and alloc.num_free_blocks == 16


def test_prompt_logprobs_requests_neither_hit_nor_feed_the_cache():
    sched, alloc = make()
    sched.add_request(request("a", PREFIX + [1], prompt_logprobs=1))
    step(sched, alloc)
    sched.add_request(request("b", PREFIX + [1]))
    plan, _ = step(sched, alloc)
    assert plan.new_reqs[0].num_computed_tokens == 0 and alloc.device.cached == {}


requests_st = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 9), st.integers(1, 6), st.integers(0, 8)),  # prefix, tail, max_tokens, arrival
    min_size=1, max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(requests_st, st.integers(8, 24), st.integers(2, 32), st.integers(1, 4))
def test_with_prefix_hits_the_replica_stays_the_owners_and_every_request_completes(reqs, num_blocks, budget, max_num_seqs):
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
        alloc.apply(out, sched.alloc)
        plan = sched.build_plan(out)
        assert sum(plan.num_scheduled_tokens.values()) <= budget
        assert all(n > 0 for n in plan.num_scheduled_tokens.values())
        samplers = [r.req_id for r, _ in out.scheduled if r.num_computed_tokens == r.num_tokens]
        result = StepResult(step_id=plan.step_id, req_ids=samplers, token_ids=[5] * len(samplers))
        for delta in sched.update_from_result(out, result).all_deltas():
            finished.setdefault(delta.req_id, []).extend(delta.token_ids)
    assert {r: len(t) for r, t in finished.items()} == expected
    out = sched.schedule()
    if out is not None:
        alloc.apply(out, sched.alloc)
    assert alloc.device.num_used_blocks == 0
