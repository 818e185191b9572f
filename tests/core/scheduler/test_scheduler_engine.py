"""The scheduler with a real model (a tiny random Llama) and the real allocator, stepped in one
process (``engine.LocalEngine``): whatever the pool size, preemption mode, forks and chunking do to
the batch, every request's output is exactly what it would have been alone."""

from __future__ import annotations

import random

import msgspec
import pytest

from folio.core.kv.allocator import cdiv
from tests.core.engine import LocalEngine, alone, engine_request, make_runner

BLOCK = 16


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return make_runner(tiny_model_dir, num_kv_blocks=256, num_host_blocks=128)


@pytest.fixture(scope="module")
def small_pool_runner(tiny_model_dir):
    return make_runner(tiny_model_dir, num_kv_blocks=24, num_host_blocks=128)


def mixed_requests(n: int, seed: int, vocab: int = 128) -> list:
    """Greedy and seeded sampling, prompts of 3..60 tokens, outputs of 4..40."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(3, 60))]
        sampling = {} if i % 2 else dict(temperature=0.9, seed=1000 + i, top_p=0.95)
        reqs.append(engine_request(f"r{i}", prompt, rng.randint(4, 40), ignore_eos=True, **sampling))
    return reqs


ASYNC = pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])


@ASYNC
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_small_pool_changes_no_output(runner, small_pool_runner, mode, async_scheduling):
    reqs = mixed_requests(40, seed=1)
    expected = {m.req_id: alone(runner, m).token_ids for m in reqs}
    engine = LocalEngine(small_pool_runner, max_num_batched_tokens=256, preemption_mode=mode,
                         async_scheduling=async_scheduling)
    for m in reqs:
        engine.add(m)
    outputs = engine.run()
    assert {r: o.token_ids for r, o in outputs.items()} == expected
    counters = engine.sched.counters
    assert counters["num_preemptions"] > 0
    assert (counters["num_swap_outs"] > 0) == (mode == "swap")
    assert counters["num_swap_ins"] == counters["num_swap_outs"]
    assert engine.alloc.num_used_blocks == 0 and engine.alloc.host.num_used_blocks == 0
    assert (counters["num_steps_planned_ahead"] > 0) == async_scheduling


@ASYNC
def test_requests_that_stop_early_drop_the_token_planned_past_their_end(runner, async_scheduling):
    """Each request's EOS is a token it generates alone (its 2nd..7th); planned ahead, the step
    after the EOS still decodes it, and that token is never emitted."""
    reqs = mixed_requests(24, seed=3)
    stopping = []
    for i, m in enumerate(reqs):
        token_ids = alone(runner, m).token_ids
        stopping.append(msgspec.structs.replace(
            m, eos_token_id=token_ids[(1 + i % 6) % len(token_ids)], sampling=msgspec.structs.replace(m.sampling, ignore_eos=False)))
    expected = {m.req_id: alone(runner, m) for m in stopping}
    engine = LocalEngine(runner, max_num_batched_tokens=256, async_scheduling=async_scheduling)
    for m in stopping:
        engine.add(m)
    outputs = engine.run()
    assert {r: (o.token_ids, o.finish_reason) for r, o in outputs.items()} == \
        {r: (o.token_ids, o.finish_reason) for r, o in expected.items()}
    assert any(o.finish_reason == "stop" for o in outputs.values())
    placeholders = sum(p.num_placeholder_tokens for p in engine.plans)
    assert (placeholders > 0) == async_scheduling == (engine.sched.counters["num_steps_planned_ahead"] > 0)
    assert engine.alloc.num_used_blocks == 0 and not engine.sched.requests


def test_n_choices_fork_after_the_prompt_and_equal_their_solo_runs(runner):
    prompt = list(range(3, 40))  # 37 tokens: the fork point (36) is inside the third block
    msg = engine_request("a", prompt, 12, temperature=0.8, seed=5, ignore_eos=True, fork_req_ids=["b", "c", "d"])
    engine = LocalEngine(runner)
    engine.add(msg)
    while not engine.sched.counters["num_forks"]:
        engine.step()
    engine.step()  # every choice computes the last prompt token in its own copy of the last block
    tables = [engine.alloc.block_table(r) for r in "abcd"]
    assert len({tuple(t[:2]) for t in tables}) == 1  # the two full prompt blocks: stored once
    assert len({t[2] for t in tables}) == 4  # the partly filled one: copied on write, three times
    assert engine.alloc.counters["num_cow_copies"] == 3
    outputs = engine.run()
    # the prompt was computed once (but its last token, once per choice)
    assert engine.sched.counters["num_scheduled_tokens_total"] == len(prompt) - 1 + 4 + 4 * 11
    for i, choice in enumerate("abcd"):
        solo = engine_request(choice, prompt, 12, temperature=0.8, seed=5 + i, ignore_eos=True)
        assert outputs[choice].token_ids == alone(runner, solo).token_ids
    assert len({tuple(o.token_ids) for o in outputs.values()}) > 1  # the seeds differ per choice
    again = LocalEngine(runner)
    again.add(msg)
    assert {r: o.token_ids for r, o in again.run().items()} == {r: o.token_ids for r, o in outputs.items()}


@ASYNC
def test_forks_under_preemption_and_swapping(runner, small_pool_runner, async_scheduling):
    reqs = [engine_request(f"g{i}", list(range(5 + i, 30 + 3 * i)), 24, temperature=0.7, seed=i, ignore_eos=True,
                           fork_req_ids=[f"g{i}.{k}" for k in range(1, 3)]) for i in range(8)]
    for mode in ("recompute", "swap"):
        engine = LocalEngine(small_pool_runner, preemption_mode=mode, async_scheduling=async_scheduling)
        for m in reqs:
            engine.add(m)
        outputs = engine.run()
        assert engine.sched.counters["num_preemptions"] > 0
        for m in reqs:
            for k, choice in enumerate((m.req_id, *m.fork_req_ids)):
                solo = engine_request(choice, m.prompt_token_ids, 24, temperature=0.7, seed=m.sampling.seed + k,
                                      ignore_eos=True)
                assert outputs[choice].token_ids == alone(runner, solo).token_ids, (mode, choice)
        assert engine.alloc.num_used_blocks == 0


@pytest.fixture(scope="module")
def long_context_runner(tmp_path_factory):
    from folio.testing.models import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("long"), max_position_embeddings=4096)
    return make_runner(path, num_kv_blocks=400)


@pytest.mark.parametrize("chunked", [True, False])
def test_a_long_prompt_does_not_stall_the_decodes_with_chunked_prefill(long_context_runner, chunked):
    budget = 256
    engine = LocalEngine(long_context_runner, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    decoders = [engine_request(f"d{i}", [1 + i, 2, 3, 4], 60, ignore_eos=True) for i in range(8)]
    for m in decoders:
        engine.add(m)
    for _ in range(3):
        engine.step()  # they all decode now
    rng = random.Random(0)
    engine.add(engine_request("long", [rng.randrange(1, 128) for _ in range(2000)], 1, ignore_eos=True))
    first = len(engine.plans)
    while engine.outputs["long"].finish_reason is None:
        engine.step()
    window = engine.plans[first:]
    long_steps = [p for p in window if "long" in p.num_scheduled_tokens]
    if chunked:
        assert len(long_steps) == cdiv(2000, budget - 8)  # chunks of what the decodes leave
        for plan in long_steps:  # every decoder got its token in every one of those steps
            assert all(plan.num_scheduled_tokens.get(f"d{i}") == 1 for i in range(8))
            assert sum(plan.num_scheduled_tokens.values()) <= budget
    else:
        assert len(long_steps) == 1 and long_steps[0].num_scheduled_tokens["long"] == 2000
    outputs = engine.run()
    for m in decoders:  # and the batch changed nothing
        assert outputs[m.req_id].token_ids == alone(long_context_runner, m).token_ids


def test_long_prefill_token_threshold_caps_one_prefill_per_step(long_context_runner):
    engine = LocalEngine(long_context_runner, max_num_batched_tokens=512, long_prefill_token_threshold=100)
    engine.add(engine_request("p", list(range(1, 120)) * 3, 2, ignore_eos=True))
    engine.run()
    chunks = [p.num_scheduled_tokens["p"] for p in engine.plans if "p" in p.num_scheduled_tokens]
    assert chunks[:3] == [100, 100, 100] and max(chunks) == 100
