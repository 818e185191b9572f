"""A continuation (``EngineRequest.forced_token_ids``) in the real scheduler and executor: the tokens
it was given are placed as output already generated and computed, not sampled; what follows is
exactly what the original request generated after them (greedy, seeded, with penalties), whatever
else runs beside it, and nothing is sent for the forced tokens themselves."""

from __future__ import annotations

import msgspec
import pytest

from tests.core.engine import LocalEngine, engine_request, make_runner


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return make_runner(tiny_model_dir, num_kv_blocks=128)


REQUESTS = [
    engine_request("greedy", [5, 9, 11, 3, 7], 24, ignore_eos=True),
    engine_request("seeded", [8, 1, 30, 2], 24, temperature=0.9, top_p=0.95, seed=123, ignore_eos=True),
    engine_request("penalised", [4, 4, 6], 24, temperature=0.7, seed=5, frequency_penalty=0.8,
                   presence_penalty=0.3, repetition_penalty=1.2, ignore_eos=True),
    engine_request("logprobs", [12, 13, 14, 15, 16, 17], 20, temperature=1.0, seed=9, logprobs=2, ignore_eos=True),
]


def test_a_continuation_generates_exactly_what_the_original_did_after_its_forced_tokens(runner):
    engine = LocalEngine(runner)
    for msg in REQUESTS:
        engine.add(msg)
    originals = engine.run()
    for k in (1, 7, 19):
        engine = LocalEngine(runner)
        engine.add(engine_request("beside", [40, 41, 42], 30, temperature=0.8, seed=1, ignore_eos=True))
        for msg in REQUESTS:
            want = originals[msg.req_id].token_ids
            engine.add(msgspec.structs.replace(msg, req_id=f"{msg.req_id}.r", forced_token_ids=want[:k]))
        outputs = engine.run()
        for msg in REQUESTS:
            got = outputs[f"{msg.req_id}.r"]
            assert got.token_ids == originals[msg.req_id].token_ids[k:], (msg.req_id, k)
            assert got.finish_reason == "length"


def test_a_continuation_with_nothing_left_or_with_choices_is_refused(runner):
    engine = LocalEngine(runner)
    engine.add(msgspec.structs.replace(engine_request("full", [1, 2, 3], 4), forced_token_ids=[5, 6, 7, 8]))
    engine.add(msgspec.structs.replace(engine_request("forks", [1, 2, 3], 8, fork_req_ids=["forks-1"]),
                                       forced_token_ids=[5]))
    outputs = engine.run()
    assert outputs["full"].finish_reason == "error" and "nothing is left" in outputs["full"].error
    assert outputs["forks"].finish_reason == "error" and "one choice" in outputs["forks"].error
