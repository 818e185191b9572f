"""One sampling type: the gateway's OpenAI bodies and ``folio.SamplingParams`` give the same struct
(``shared/sampling.py``) and the same engine requests (``folio/core/frontdoor.py``), and the
struct's rules refuse the same parameters at both doors."""

from __future__ import annotations

import msgspec
import pytest

from folio import SamplingParams
from folio.core.frontdoor import best_of_order, chat_messages, generate_request
from folio.services.gateway import convert
from folio.services.gateway.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from folio.shared.sampling import RULES, ParamError


def completion(**body) -> CompletionRequest:
    return msgspec.convert({"prompt": "hello", **body}, CompletionRequest)


def same(a: msgspec.Struct, b: msgspec.Struct) -> None:
    strip = {"arrival_time": 0.0}
    assert msgspec.structs.replace(a, **strip) == msgspec.structs.replace(b, **strip)


@pytest.mark.parametrize(("body", "params"), [
    ({}, SamplingParams()),
    ({"n": 3, "seed": 7, "temperature": 0.5, "top_k": 5, "stop": "x"},
     SamplingParams(n=3, seed=7, temperature=0.5, top_k=5, stop="x")),
    ({"n": 2, "best_of": 4, "top_p": 0.9}, SamplingParams(n=2, best_of=4, top_p=0.9)),
    ({"n": 2, "best_of": 3, "use_beam_search": True, "temperature": 0, "length_penalty": 0.5},
     SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, length_penalty=0.5)),
    ({"top_k": -1, "max_tokens": 9, "stop_token_ids": [3], "logprobs": 2},
     SamplingParams(top_k=-1, max_tokens=9, stop_token_ids=[3], logprobs=2)),
    ({"echo": True, "logprobs": 1}, SamplingParams(logprobs=1, prompt_logprobs=1)),
])
def test_the_gateway_and_the_offline_api_build_the_same_request(body, params):
    http_params = completion(**body).sampling_params()
    assert http_params == params
    (http,) = convert.completion_generate_requests(completion(**body), "cmpl-1")
    offline = generate_request(params, "cmpl-1", prompt="hello", echo=bool(body.get("echo")))
    same(http, msgspec.structs.replace(offline, stream=False))
    assert http.sampling == params  # the struct itself, unchanged, rides in the request


def test_chat_maps_its_own_fields_onto_the_struct():
    msgs = [{"role": "user", "content": "hi"}]
    chat = msgspec.convert({"messages": msgs, "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 7,
                            "temperature": 0.2}, ChatCompletionRequest)
    assert chat.sampling_params() == SamplingParams(logprobs=3, max_tokens=7, temperature=0.2)
    plain = msgspec.convert({"messages": msgs, "logprobs": False}, ChatCompletionRequest).sampling_params()
    assert plain.logprobs is None and plain.max_tokens is None  # no limit: what the context leaves


def test_several_prompts_number_their_sequences_per_prompt():
    reqs = convert.completion_generate_requests(completion(prompt=["a", "b"], n=2, best_of=3), "c")
    assert [(r.req_id, r.fork_req_ids) for r in reqs] == [("c-0", ["c-1", "c-2"]), ("c-3", ["c-4", "c-5"])]
    beams = convert.completion_generate_requests(
        completion(prompt=["a", "b"], n=2, best_of=3, use_beam_search=True), "c")
    assert [(r.req_id, r.fork_req_ids, r.sampling.num_sequences) for r in beams] == \
        [("c-0", ["c-1"], 3), ("c-2", ["c-3"], 3)]


@pytest.mark.parametrize(("body", "kwargs", "param"), [
    ({"n": 3, "best_of": 2}, {"n": 3, "best_of": 2}, "best_of"),
    ({"use_beam_search": True, "top_p": 0.5}, {"use_beam_search": True, "temperature": 0.0, "top_p": 0.5},
     "use_beam_search"),
    ({"use_beam_search": True, "stop": "x"}, {"use_beam_search": True, "temperature": 0.0, "stop": "x"},
     "use_beam_search"),
    ({"stop": ["a", ""]}, {"stop": ["a", ""]}, "stop"),
    ({"top_p": 0}, {"top_p": 0.0}, "top_p"),
    ({"top_k": -2}, {"top_k": -2}, "top_k"),
    ({"temperature": -0.5}, {"temperature": -0.5}, "temperature"),
])
def test_one_rule_list_refuses_the_same_parameters_at_both_doors(body, kwargs, param):
    with pytest.raises(ParamError) as offline:
        SamplingParams(**kwargs)
    with pytest.raises(ApiError) as http:
        completion(**body).sampling_params()
    assert offline.value.param == http.value.param == param and http.value.status == 400
    assert str(offline.value) == http.value.message
    assert any(p == param and m == str(offline.value) for p, _, m in RULES)


def test_each_off_value_is_one_value_and_greedy_is_decided_once():
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0) == SamplingParams()
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams(stop=None).stop == SamplingParams(stop="").stop == []
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(3,)) == SamplingParams(stop=["a", "b"], stop_token_ids=[3])
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy
    # beam search is refused anything that is not greedy, by the same property
    SamplingParams(use_beam_search=True, temperature=1e-6)
    with pytest.raises(ParamError):
        SamplingParams(use_beam_search=True, temperature=0.01)


def test_the_struct_decodes_to_itself_and_a_bad_one_on_the_wire_is_malformed():
    params = SamplingParams(n=2, temperature=0.3, top_k=4, seed=9, stop=["a"], logprobs=1, max_tokens=None)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"top_p": 3.0}), type=SamplingParams)


def test_best_of_asks_the_engine_for_logprobs_without_showing_them():
    ranked = SamplingParams(n=2, best_of=4)
    assert ranked.logprobs is None and ranked.engine_logprobs == 0
    assert SamplingParams(n=2, best_of=4, logprobs=3).engine_logprobs == 3
    assert SamplingParams(n=2).engine_logprobs is None
    assert SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0).engine_logprobs is None


def test_seed_offsets_give_each_choice_its_own_reproducible_seed():
    params = SamplingParams(seed=5)
    assert params.with_seed_offset(0) is params and params.with_seed_offset(2).seed == 7
    assert SamplingParams(seed=2**63 - 1).with_seed_offset(1).seed == 2**63 - 2
    assert SamplingParams().with_seed_offset(3).seed is None


def test_chat_bodies_and_offline_chats_read_messages_alike():
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    (http,) = convert.chat_generate_requests(msgspec.convert({"messages": msgs}, ChatCompletionRequest), "chat-1")
    assert http.messages == chat_messages(msgs)
    assert http.messages[1].content == "hi there" and http.sampling.max_tokens is None
    with pytest.raises(ValueError, match="invalid messages"):
        chat_messages([{"role": "robot", "content": "x"}])


def test_best_of_keeps_the_highest_cumulative_logprobs_ties_in_order():
    assert best_of_order([-3.0, -1.0, -2.0, -1.0], 2) == [1, 3]
    assert best_of_order([-0.5], 1) == [0]
