"""Pooling requests in the batching policy: prefill only under the generation traffic's token budget,
no block for a token they never generate, finished by the step that ran their last prompt chunk (with
the vector it returned), never planned again ahead of that result, and a hit in the prefix cache."""

from __future__ import annotations

from folio.shared.messages import EngineRequest, KVAllocate, StepResult
from folio.shared.sampling import PoolingParams, SamplingParams
from tests.core.scheduler.test_scheduler_policy import make, request

VECTOR = b"\x00\x00\x80?" * 4  # four float32 ones


def pooling(req_id, num_prompt, first=1):
    return EngineRequest(req_id=req_id, prompt_token_ids=list(range(first, first + num_prompt)), eos_token_id=0,
                         sampling=SamplingParams(max_tokens=None, pooling=PoolingParams()))


def run(sched, alloc, out=None):
    """One step whose samplers sample 7 and whose poolers return ``VECTOR``: (plan, deltas)."""
    out = out or sched.schedule()
    alloc.apply(out, sched.alloc)
    plan = sched.build_plan(out)
    result = StepResult(step_id=plan.step_id, req_ids=[r.req_id for r in out.samplers],
                        token_ids=[7] * len(out.samplers), pooled={r.req_id: VECTOR for r in out.poolers})
    return plan, sched.update_from_result(out, result).all_deltas()


def test_a_pooling_request_is_chunked_with_decodes_and_ends_after_its_prompt():
    sched, alloc = make(num_blocks=16, block_size=4, max_num_batched_tokens=6)
    sched.add_request(request("chat", 3, max_tokens=8))
    run(sched, alloc)  # the chat's prompt
    sched.add_request(pooling("emb", 10))
    plan, deltas = run(sched, alloc)
    assert plan.num_scheduled_tokens == {"chat": 1, "emb": 5}  # under one budget
    assert [d.req_id for d in deltas] == ["chat"]
    out = sched.schedule()
    assert {r.req_id: n for r, n in out.scheduled} == {"chat": 1, "emb": 5}  # its last chunk
    assert len(sched.alloc.seqs["emb"].block_ids) == 3  # its 10 tokens, no room made for an 11th
    plan, deltas = run(sched, alloc, out)
    emb = [d for d in deltas if d.req_id == "emb"][0]
    assert emb.finish_reason == "stop" and emb.pooled == VECTOR and emb.token_ids == []
    assert emb.num_prompt_tokens == 10
    assert sched.counters["num_requests_finished"] == 1
    plan, deltas = run(sched, alloc)
    assert "emb" in plan.finished_req_ids and "emb" not in plan.num_scheduled_tokens


def test_no_block_for_a_token_it_never_generates():
    sched, alloc = make(num_blocks=4, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    sched.add_request(pooling("emb", 8))  # two full blocks, nothing after them
    out = sched.schedule()
    assert [op.num_tokens for op in out.ops if isinstance(op, KVAllocate)] == [8]
    assert len(sched.alloc.seqs["emb"].block_ids) == 2
    run(sched, alloc, out)
    assert "emb" not in sched.requests


def test_a_prompt_as_long_as_the_context_fits_and_a_longer_one_is_refused():
    sched, alloc = make(num_blocks=16, block_size=4, max_num_batched_tokens=64, max_model_len=12)
    assert sched.add_request(pooling("fits", 12)) == []
    refused = sched.add_request(pooling("long", 13))
    assert refused[0].finish_reason == "error" and "maximum context length is 12" in refused[0].error


def test_planned_ahead_it_is_not_scheduled_again_before_its_result():
    sched, alloc = make(num_blocks=16, block_size=4, max_num_batched_tokens=64)
    sched.add_request(request("chat", 3, max_tokens=8))
    sched.add_request(pooling("emb", 5))
    first = sched.schedule()
    alloc.apply(first, sched.alloc)
    sched.build_plan(first)
    assert [r.req_id for r in first.poolers] == ["emb"] and sched.can_plan_ahead(first)
    ahead = sched.schedule(first)
    assert "emb" not in {r.req_id for r, _ in ahead.scheduled}  # the chat decodes a placeholder alone
    assert [r.req_id for r, _ in ahead.scheduled] == ["chat"]


def test_a_result_without_its_vector_fails_it():
    sched, alloc = make()
    sched.add_request(pooling("emb", 5))
    out = sched.schedule()
    alloc.apply(out, sched.alloc)
    plan = sched.build_plan(out)
    deltas = sched.update_from_result(out, StepResult(step_id=plan.step_id)).all_deltas()
    assert deltas[0].finish_reason == "error" and "emb" not in sched.requests


def test_the_same_prefix_is_a_prefix_cache_hit():
    sched, alloc = make(num_blocks=16, block_size=4, max_num_batched_tokens=64)
    sched.add_request(pooling("a", 10))
    run(sched, alloc)
    sched.add_request(pooling("b", 10))
    plan, deltas = run(sched, alloc)  # a's blocks were confirmed and freed first: b finds two of them
    assert plan.num_scheduled_tokens == {"b": 2}
    assert deltas[0].num_cached_tokens == 8 and deltas[0].pooled == VECTOR


def test_pooling_prompts_take_their_share_of_a_step_while_a_stream_decodes_and_the_whole_budget_alone():
    """``max_pooling_tokens_per_step``: two embeddings beside a decoding chat take 4 tokens a step
    between them (the chat's token comes first); once the chat ends they take the whole budget."""
    sched, alloc = make(num_blocks=32, block_size=4, max_num_batched_tokens=16, max_pooling_tokens_per_step=4)
    sched.add_request(request("chat", 3, max_tokens=3))
    run(sched, alloc)  # the chat's prompt, and its first token
    sched.add_request(pooling("a", 10))
    sched.add_request(pooling("b", 10, first=20))
    plan, _ = run(sched, alloc)
    assert plan.num_scheduled_tokens == {"chat": 1, "a": 4}
    plan, _ = run(sched, alloc)
    assert plan.num_scheduled_tokens == {"chat": 1, "a": 4}  # the chat's last token
    plan, _ = run(sched, alloc)  # the chat has ended: the budget is the embeddings'
    assert plan.num_scheduled_tokens == {"a": 2, "b": 10}


def test_a_prompt_the_cache_holds_whole_waits_when_the_share_is_spent():
    """A pooling prompt found whole in the prefix cache still computes its last token; once the
    step's share is spent it waits like the others (it took a token past the share, and the next
    pooling request was then planned -1 tokens: a plan the executor refuses)."""
    sched, alloc = make(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                        max_pooling_tokens_per_step=4)
    sched.add_request(pooling("x", 9))
    run(sched, alloc)  # alone: the whole budget; its two full blocks stay cached
    sched.add_request(request("chat", 3, max_tokens=8))
    run(sched, alloc)
    sched.add_request(pooling("d", 8, first=100))
    sched.add_request(pooling("c", 9))  # x's tokens: a hit for all but its last
    sched.add_request(pooling("e", 5, first=200))
    for _ in range(4):
        plan, _ = run(sched, alloc)
        assert min(plan.num_scheduled_tokens.values()) >= 1, plan.num_scheduled_tokens
        pooled = sum(n for r, n in plan.num_scheduled_tokens.items() if r != "chat")
        assert pooled <= 4, plan.num_scheduled_tokens
