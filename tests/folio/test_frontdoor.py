"""The one front door: the gateway's OpenAI bodies and ``folio.SamplingParams`` become the same
engine requests through the same rules (``folio/core/frontdoor.py``)."""

from __future__ import annotations

import msgspec
import pytest

from folio import SamplingParams
from folio.core.frontdoor import ParamError, RULES, best_of_order, chat_messages
from folio.services.gateway import convert
from folio.services.gateway.protocol import ApiError, ChatCompletionRequest, CompletionRequest


def completion(**body) -> CompletionRequest:
    return msgspec.convert({"prompt": "hello", **body}, CompletionRequest)


def same(a: msgspec.Struct, b: msgspec.Struct) -> None:
    strip = {"arrival_time": 0.0}
    assert msgspec.structs.replace(a, **strip) == msgspec.structs.replace(b, **strip)


@pytest.mark.parametrize(("body", "params"), [
    ({}, SamplingParams()),
    ({"n": 3, "seed": 7, "temperature": 0.5, "top_k": 5, "stop": "x"},
     SamplingParams(n=3, seed=7, temperature=0.5, top_k=5, stop="x")),
    ({"n": 2, "best_of": 4, "top_p": 0.9}, SamplingParams(n=2, best_of=4, top_p=0.9)),  # logprobs 0 to rank
    ({"n": 2, "best_of": 3, "use_beam_search": True, "temperature": 0, "length_penalty": 0.5},
     SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, length_penalty=0.5)),
    ({"top_k": -1, "max_tokens": 9, "stop_token_ids": [3], "logprobs": 2},
     SamplingParams(top_k=-1, max_tokens=9, stop_token_ids=[3], logprobs=2)),
])
def test_the_gateway_and_the_offline_api_build_the_same_request(body, params):
    (http,) = convert.completion_generate_requests(completion(**body), "cmpl-1")
    offline = params.to_generate_request("cmpl-1", prompt="hello")
    same(http, msgspec.structs.replace(offline, stream=False))


def test_several_prompts_number_their_sequences_per_prompt():
    reqs = convert.completion_generate_requests(completion(prompt=["a", "b"], n=2, best_of=3), "c")
    assert [(r.req_id, r.fork_req_ids) for r in reqs] == [("c-0", ["c-1", "c-2"]), ("c-3", ["c-4", "c-5"])]
    beams = convert.completion_generate_requests(
        completion(prompt=["a", "b"], n=2, best_of=3, use_beam_search=True), "c")
    assert [(r.req_id, r.fork_req_ids, r.beam_search.width) for r in beams] == [("c-0", ["c-1"], 3), ("c-2", ["c-3"], 3)]


@pytest.mark.parametrize(("body", "kwargs", "param"), [
    ({"n": 3, "best_of": 2}, {"n": 3, "best_of": 2}, "best_of"),
    ({"use_beam_search": True, "top_p": 0.5}, {"use_beam_search": True, "temperature": 0.0, "top_p": 0.5},
     "use_beam_search"),
    ({"use_beam_search": True, "stop": "x"}, {"use_beam_search": True, "temperature": 0.0, "stop": "x"},
     "use_beam_search"),
    ({"stop": ["a", ""]}, {"stop": ["a", ""]}, "stop"),
])
def test_one_rule_list_refuses_the_same_parameters_at_both_doors(body, kwargs, param):
    with pytest.raises(ParamError) as offline:
        SamplingParams(**kwargs)
    with pytest.raises(ApiError) as http:
        convert.completion_params(completion(**body))
    assert offline.value.param == http.value.param == param
    assert str(offline.value) == http.value.message
    assert any(p == param and m == str(offline.value) for p, _, m in RULES)


def test_chat_bodies_and_offline_chats_read_messages_alike():
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    (http,) = convert.chat_generate_requests(msgspec.convert({"messages": msgs}, ChatCompletionRequest), "chat-1")
    assert http.messages == chat_messages(msgs)
    assert http.messages[1].content == "hi there" and http.fill_max_tokens
    with pytest.raises(ValueError, match="invalid messages"):
        chat_messages([{"role": "robot", "content": "x"}])


def test_best_of_keeps_the_highest_cumulative_logprobs_ties_in_order():
    assert best_of_order([-3.0, -1.0, -2.0, -1.0], 2) == [1, 3]
    assert best_of_order([-0.5], 1) == [0]


def test_the_wire_sampling_is_built_from_the_front_door_field_by_field():
    """Every ``WireSampling`` field but the grammar (the tokenizer's) comes from a front-door field
    of the same name: a field added to one class and not the other fails here."""
    from folio.core.frontdoor import WIRE_FIELDS
    from folio.shared.messages import WireSampling

    set_apart = {"top_k", "logprobs", "stop_token_ids"}
    assert set(WIRE_FIELDS) | set_apart | {"grammar"} == set(WireSampling.__struct_fields__)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05, presence_penalty=0.1,
                            frequency_penalty=0.2, repetition_penalty=1.1, seed=3, max_tokens=9,
                            stop_token_ids=[5], ignore_eos=True, prompt_logprobs=2, n=1, best_of=2)
    wire = params.engine_sampling()
    assert {name: getattr(wire, name) for name in WIRE_FIELDS} == {name: getattr(params, name) for name in WIRE_FIELDS}
    assert (wire.top_k, wire.logprobs, wire.stop_token_ids, wire.grammar) == (None, 0, [5], None)
    assert wire.stop_token_ids is not params.stop_token_ids
