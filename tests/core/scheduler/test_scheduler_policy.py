"""The batching policy alone (no sockets): token budget, sequence cap, preemption, refusals, finish reasons.

The scheduler plans with its allocator replica; each step's log is applied to an allocator of
record, as the kvmanager does, and both must agree after every step.
"""

from __future__ import annotations

import msgspec
import pytest

from folio.core.scheduler.policy import Scheduler
from folio.shared.messages import (
    EngineRequest,
    Grammar,
    KVConfirm,
    PoolInfo,
    StepResult,
    TokenDelta,
)
from folio.shared.sampling import SamplingParams
from tests.core.kv_owner import Owner


def make(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=None,
         num_host_blocks=0, **options):
    sched = Scheduler(max_num_seqs, max_num_batched_tokens, max_model_len, **options)
    sched.set_pool(PoolInfo(num_blocks=num_blocks, block_size=block_size, bytes_per_block=1, epoch="e",
                            max_model_len=64, num_free_blocks=num_blocks, num_host_blocks=num_host_blocks))
    return sched, Owner(num_blocks, block_size, num_host_blocks)


def request(req_id, num_prompt, max_tokens=4, grammar=None, **sampling):
    return EngineRequest(req_id=req_id, prompt_token_ids=list(range(1, num_prompt + 1)), grammar=grammar,
                         sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling), eos_token_id=0)


def step_batch(sched, alloc: Owner, token=7):
    """One step; every request that catches up samples ``token``. Returns (plan, its TokenBatch)."""
    out = sched.schedule()
    alloc.apply(out, sched.alloc)
    plan = sched.build_plan(out)
    samplers = [r.req_id for r, _ in out.scheduled if r.num_computed_tokens == r.num_tokens]
    return plan, sched.update_from_result(out, StepResult(step_id=plan.step_id, req_ids=samplers,
                                                          token_ids=[token] * len(samplers)))


def step(sched, alloc: Owner, token=7):
    """``step_batch`` with the batch's deltas as ``TokenDelta``s."""
    plan, batch = step_batch(sched, alloc, token)
    return plan, batch.all_deltas()


def test_token_budget_chunks_prefills_and_running_requests_go_first():
    sched, alloc = make(max_num_batched_tokens=10)
    sched.add_request(request("a", 7))
    sched.add_request(request("b", 6))
    plan, _ = step(sched, alloc)
    assert plan.num_scheduled_tokens == {"a": 7, "b": 3}  # b's prefill is chunked by the budget
    assert [r.block_ids for r in plan.new_reqs] == [[0, 1], [2]]
    plan, deltas = step(sched, alloc)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 3}  # a decodes, b goes on with its prompt
    # a's decode has room in its last block: the executor learns nothing but its count
    assert [r.req_id for r in plan.running_reqs] == ["b"]
    assert plan.running_reqs[0].new_block_ids == [3] and plan.running_reqs[0].num_computed_tokens == 3
    assert [d.req_id for d in deltas] == ["a", "b"]  # b sampled too: its prompt is done


def test_sequence_cap_and_join_leave_every_step():
    sched, alloc = make(num_blocks=2, max_num_seqs=2, max_num_batched_tokens=64)
    for i, max_tokens in enumerate([1, 3, 2]):
        sched.add_request(request(f"r{i}", 2, max_tokens=max_tokens))
    plan, deltas = step(sched, alloc)
    assert sorted(plan.num_scheduled_tokens) == ["r0", "r1"]
    assert [(d.req_id, d.finish_reason) for d in deltas] == [("r0", "length"), ("r1", None)]
    plan, _ = step(sched, alloc)  # r0 left: its blocks are freed in this call, r2 joins
    assert plan.finished_req_ids == ["r0"] and sorted(plan.num_scheduled_tokens) == ["r1", "r2"]
    assert plan.new_reqs[0].block_ids == [0]  # r0's block: frees come before allocations


def test_preempts_the_newest_running_request_and_resumes_it_with_its_tokens():
    sched, alloc = make(num_blocks=4, block_size=2, max_num_batched_tokens=64)
    sched.add_request(request("old", 3, max_tokens=4))  # 3 + 4 - 1 = 6 tokens: 3 blocks
    sched.add_request(request("new", 2, max_tokens=4))
    step(sched, alloc)  # old: 2 blocks, new: 1 block
    step(sched, alloc)  # old 4 tokens (2 blocks), new 3 tokens (2 blocks): pool full
    plan, _ = step(sched, alloc)  # old needs a 3rd block: new gives way
    assert sched.counters["num_preemptions"] == 1
    assert plan.finished_req_ids == ["new"] and list(plan.num_scheduled_tokens) == ["old"]
    assert [r.req_id for r in sched.waiting] == ["new"]
    plan, _ = step(sched, alloc)
    resumed = plan.new_reqs[0]
    assert resumed.req_id == "new" and resumed.token_ids == [1, 2, 7, 7] and resumed.num_prompt_tokens == 2
    # it starts over by recompute, except its first block: old holds the same one (the prefix
    # cache finds it), so it needs a single free block and runs next to old at once
    assert resumed.num_computed_tokens == 2 and resumed.block_ids == [0, 2]
    assert plan.num_scheduled_tokens == {"old": 1, "new": 2} and sched.counters["num_preemptions"] == 1


def test_only_the_first_delta_after_each_admission_carries_the_counts():
    """A request's prompt and cached counts and its queue time ride on its first delta after it is
    admitted (again after a preemption); its other tokens travel in the batch's flat plain arrays
    (no struct each), which the tokenizer takes on its short path."""
    sched, alloc = make(num_blocks=4, block_size=2, max_num_batched_tokens=64)
    sched.add_request(request("old", 3, max_tokens=4))
    sched.add_request(request("new", 2, max_tokens=4))
    seen = []  # new's deltas: (a TokenDelta or the plain token)
    for _ in range(5):
        _, batch = step_batch(sched, alloc)
        seen += [d for d in batch.deltas if d.req_id == "new"]
        seen += [t for r, t in zip(batch.plain_req_ids, batch.plain_token_ids) if r == "new"]
        assert not {d.req_id for d in batch.deltas} & set(batch.plain_req_ids)
    assert sched.counters["num_preemptions"] == 1  # new was preempted once and admitted again
    structs = [i for i, d in enumerate(seen) if isinstance(d, TokenDelta)]
    assert structs == [0, 2, 3]  # its first delta, its first after re-admission, its last (it finished)
    assert seen[0].num_prompt_tokens == seen[2].num_prompt_tokens == 2 and seen[3].finish_reason == "length"
    assert seen[1] == 7 and not seen[3].num_prompt_tokens


def test_refuses_what_can_never_fit():
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=40)
    assert not sched.add_request(request("ok", 10, max_tokens=7))  # 16 tokens of KV: 4 blocks
    (too_big,) = sched.add_request(request("pool", 10, max_tokens=8))
    assert too_big.finish_reason == "error" and "KV blocks" in too_big.error
    (too_long,) = sched.add_request(request("ctx", 30, max_tokens=20))
    assert too_long.finish_reason == "error" and "maximum context length is 40" in too_long.error
    assert sched.add_request(request("ok", 1))[0].error.startswith("request id")
    assert sched.counters["num_requests_rejected"] == 3


def test_no_max_tokens_means_what_the_context_leaves_and_the_params_reach_the_plan_unchanged():
    sched, alloc = make(num_blocks=16, block_size=4, max_model_len=12, max_num_batched_tokens=16)
    msg = request("fill", 8, max_tokens=None, ignore_eos=True)
    assert not sched.add_request(msg)
    plan, deltas = step(sched, alloc)
    assert plan.new_reqs[0].sampling is msg.sampling and msg.sampling.max_tokens is None
    for _ in range(3):
        plan, deltas = step(sched, alloc)
    assert [d.finish_reason for d in deltas] == ["length"]  # 8 prompt + 4 output = the context of 12
    unknown = Scheduler(4, 16, None)  # no context length known at all: a limit is needed
    unknown.set_pool(PoolInfo(num_blocks=16, block_size=4, bytes_per_block=1, epoch="e", num_free_blocks=16))
    (refused,) = unknown.add_request(request("x", 8, max_tokens=None))
    assert refused.finish_reason == "error" and "max_tokens is needed" in refused.error


def test_finish_reasons_eos_stop_token_and_ignore_eos():
    sched, alloc = make()
    sched.add_request(request("eos", 2, max_tokens=8))
    sched.add_request(request("ignore", 2, max_tokens=2, ignore_eos=True))
    sched.add_request(request("stop-id", 2, max_tokens=8, stop_token_ids=[5], ignore_eos=True))
    _, deltas = step(sched, alloc, token=0)
    assert {d.req_id: d.finish_reason for d in deltas} == {"eos": "stop", "ignore": None, "stop-id": None}
    _, deltas = step(sched, alloc, token=5)
    assert {d.req_id: d.finish_reason for d in deltas} == {"ignore": "length", "stop-id": "stop"}


def test_abort_frees_blocks_in_the_next_step_even_when_idle():
    sched, alloc = make()
    sched.add_request(request("a", 6, max_tokens=10))
    step(sched, alloc)
    assert alloc.num_used_blocks == 2
    assert sched.abort("a") and not sched.abort("a")
    plan, deltas = step(sched, alloc)
    assert plan.finished_req_ids == ["a"] and plan.num_scheduled_tokens == {} and deltas == []
    assert alloc.num_used_blocks == 0 and sched.schedule() is None


def test_a_new_epoch_sends_every_running_request_back_to_recompute():
    sched, alloc = make(num_blocks=8, block_size=4)
    sched.add_request(request("a", 5, max_tokens=3))
    sched.add_request(request("b", 3, max_tokens=3))
    step(sched, alloc, token=9)
    # the executor restarted (or the kvmanager's digest differed): both allocators start empty
    info = PoolInfo(num_blocks=8, block_size=4, bytes_per_block=1, epoch="e2", num_free_blocks=8)
    assert sched.new_epoch(info) == 2
    assert [r.req_id for r in sched.waiting] == ["a", "b"] and sched.alloc.num_free_blocks == 8
    fresh = Owner(8, 4)
    plan, _ = step(sched, fresh, token=9)
    assert plan.finished_req_ids == ["a", "b"]  # an executor that did not restart drops what it held
    assert [(r.req_id, r.token_ids, r.block_ids, r.num_computed_tokens) for r in plan.new_reqs] == [
        ("a", [1, 2, 3, 4, 5, 9], [0, 1], 0), ("b", [1, 2, 3, 9], [2], 0)]
    while sched.has_work():
        step(sched, fresh)
    assert fresh.num_free_blocks == 8 and sched.counters["num_epochs"] == 1


def test_a_step_planned_ahead_decodes_placeholders_and_leaves_out_last_tokens():
    sched, alloc = make(num_blocks=16, block_size=4)
    sched.add_request(request("a", 3, max_tokens=5))
    sched.add_request(request("b", 3, max_tokens=1))
    first = sched.schedule()
    alloc.apply(first, sched.alloc)
    sched.build_plan(first)
    assert sched.can_plan_ahead(first)
    ahead = sched.schedule(first)  # before the first step's result
    alloc.apply(ahead, sched.alloc)
    plan = sched.build_plan(ahead)
    # a decodes the token it samples in the first step, unseen; b's first token is its last
    assert plan.num_scheduled_tokens == {"a": 1} and plan.num_placeholder_tokens == 1
    assert ahead.ahead and sched.requests["a"].num_pending == 2
    # the first step's blocks stay unconfirmed while it runs
    assert not [op for op in ahead.ops if isinstance(op, KVConfirm)] and list(sched.alloc.unconfirmed) == ["a", "b"]
    deltas = sched.update_from_result(first, StepResult(step_id=first.step_id, req_ids=["a", "b"],
                                                        token_ids=[0, 9])).all_deltas()
    assert [(d.req_id, d.token_ids, d.finish_reason) for d in deltas] == [("a", [0], "stop"), ("b", [9], "length")]
    # a stopped on EOS in the first step: its token from the step ahead is dropped, never emitted
    assert not sched.update_from_result(ahead, StepResult(step_id=ahead.step_id, req_ids=["a"], token_ids=[5]))
    last = sched.schedule()
    alloc.apply(last, sched.alloc)
    assert sched.build_plan(last).finished_req_ids == ["a", "b"] and alloc.num_free_blocks == 16


GRAMMAR = Grammar(key="k", kind="regex", spec="[a-z]+")


@pytest.mark.parametrize("what", ["beam", "fork", "grammar", "speculative"])
def test_steps_whose_result_decides_the_next_are_not_planned_ahead(what):
    sched, alloc = make(num_blocks=32, block_size=4, max_num_seqs=8)
    if what == "beam":
        sched.add_request(request("a", 3, use_beam_search=True, best_of=2))
    elif what == "fork":
        sched.add_request(msgspec.structs.replace(request("a", 6), fork_req_ids=["a2"]))
    elif what == "grammar":
        sched.add_request(request("a", 3, grammar=GRAMMAR))
    else:
        sched.speculative = True
        sched.add_request(request("a", 3))
    out = sched.schedule()
    alloc.apply(out, sched.alloc)
    sched.build_plan(out)
    assert not sched.can_plan_ahead(out)


def test_a_step_of_a_compiled_grammar_is_not_planned_ahead_either():
    """Its grammar no longer rides on the plan, yet the next token's mask depends on the result."""
    sched, alloc = make(num_blocks=32, block_size=4, max_num_seqs=8)
    sched.add_request(request("a", 3, grammar=GRAMMAR))
    out = sched.schedule()  # the prompt but its last token, while the grammar compiles
    alloc.apply(out, sched.alloc)
    plan = sched.build_plan(out)
    assert plan.grammars == [GRAMMAR] and out.samplers == []
    sched.update_from_result(out, StepResult(step_id=plan.step_id, grammars_ready=["k"]))
    out = sched.schedule()
    alloc.apply(out, sched.alloc)
    plan = sched.build_plan(out)
    assert plan.grammars == [] and [r.req_id for r in out.samplers] == ["a"]
    assert not sched.can_plan_ahead(out)


def test_a_step_planned_ahead_that_needs_a_preemption_stops_and_the_next_waits():
    sched, alloc = make(num_blocks=3, block_size=4, max_num_seqs=4)
    for req_id in "abc":
        sched.add_request(request(req_id, 4, max_tokens=5))
    first = sched.schedule()
    alloc.apply(first, sched.alloc)
    sched.build_plan(first)
    # each needs a new block for its next token and none is free: nothing to send ahead
    assert sched.schedule(first) is None and sched.counters["num_preemptions"] == 0
    assert sched.needs_sync and not sched.can_plan_ahead(first)
    sched.update_from_result(first, StepResult(step_id=first.step_id, req_ids=list("abc"),
                                               token_ids=[7] * 3))
    out = sched.schedule()  # after the result: the last in line gives way
    alloc.apply(out, sched.alloc)
    assert [r.req_id for r, _ in out.scheduled] == ["a"] and sched.counters["num_preemptions"] == 2
    assert not sched.needs_sync
