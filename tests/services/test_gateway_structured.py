"""The gateway's side of structured output and tools, without a model: request fields -> the
spec the engine enforces, the 400 rules, and text -> tool calls (Hermes/Qwen ``<tool_call>``,
Llama 3 JSON, the forced forms), whole and as stream deltas."""

from __future__ import annotations

import json

import pytest

from folio.services.gateway.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse
from folio.services.gateway.structured import ToolCallReader, guided_spec, parse_auto

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
OTHER = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return parse(json.dumps(body).encode(), ChatCompletionRequest)


def test_fields_become_specs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = guided_spec(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert (spec.kind, json.loads(spec.spec), spec.param) == ("json_schema", schema, "response_format")
    assert guided_spec(chat(response_format={"type": "json_object"})).kind == "json_object"
    assert guided_spec(chat(response_format={"type": "text"})) is None
    assert guided_spec(chat(guided_choice=["a", "b"])).spec == '["a", "b"]'
    comp = parse(json.dumps({"prompt": "x", "guided_regex": "[0-9]+"}).encode(), CompletionRequest)
    assert (guided_spec(comp).kind, guided_spec(comp).param) == ("regex", "guided_regex")
    named = guided_spec(chat(tools=[TOOL, OTHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert json.loads(named.spec) == TOOL["function"]["parameters"] and named.param == "tools"
    required = json.loads(guided_spec(chat(tools=[TOOL, OTHER], tool_choice="required", parallel_tool_calls=False)).spec)
    assert required["type"] == "array" and required["minItems"] == required["maxItems"] == 1
    assert [c["properties"]["name"]["const"] for c in required["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert guided_spec(chat(tools=[TOOL])) is None  # auto: free text, parsed afterwards


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "a", "guided_json": {}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"tools": [TOOL, TOOL]}, "tools"),
])
def test_conflicting_fields_are_400s(fields, param):
    with pytest.raises(ApiError) as err:
        chat(**fields)
    assert err.value.status == 400 and err.value.param == param


def test_parse_auto_hermes_llama3_and_plain_text():
    names = {"get_weather", "get_time"}
    content, calls = parse_auto('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', names)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    content, calls = parse_auto('<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}', names)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"tz": "UTC"}
    assert parse_auto('{"name": "unknown_tool", "arguments": {}}', names) == ('{"name": "unknown_tool", "arguments": {}}', [])
    assert parse_auto("It is sunny.", names) == ("It is sunny.", [])


def test_stream_auto_sends_text_at_once_and_holds_a_call_until_the_end():
    reader = ToolCallReader(mode="auto", names={"get_weather"})
    assert reader.stream_delta("It is ", False) == [{"content": "It is "}]
    assert reader.stream_delta("sunny <", False) == [{"content": "sunny "}]  # "<" may open a call
    assert reader.stream_delta("tool_call>", False) == []
    out = reader.stream_delta('{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', True)
    assert len(out) == 1 and out[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert reader.finish_reason("stop", reader.calls) == "tool_calls"
    plain = ToolCallReader(mode="auto", names={"get_weather"})
    assert plain.stream_delta("<b>bold", False) == [{"content": "<b>bold"}]


def test_stream_named_streams_arguments_and_required_parses_the_list():
    named = ToolCallReader(mode="named", names={"get_weather"}, named="get_weather")
    first = named.stream_delta('{"city": ', False)
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1]["tool_calls"][0]["function"] == {"arguments": '{"city": '}
    assert named.stream_delta('"Oslo"}', True) == [{"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}]
    assert named.finish_reason("stop", [1]) == "stop"
    required = ToolCallReader(mode="required", names={"get_weather"})
    content, calls = required.message('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert content is None and calls[0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert required.message('[{"name": "get_weather", "argu') == (None, [])  # cut by max_tokens
