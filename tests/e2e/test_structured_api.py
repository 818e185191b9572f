"""Structured output and tool calling through ``folio serve`` on SmolLM2 with the official openai
client: response_format (json_object, json_schema strict), vLLM's guided_regex/choice/grammar,
the SDK's ``parse()`` with a Pydantic model, tool_choice required and named (streamed and not), a
tool turn in the next request, max_tokens mid-structure, the 400s, and the /metrics counters."""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Annotated, Literal

import jsonschema
import openai
import pydantic
import pytest

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 16},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 16}}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def chat(client, content: str, **kw):
    kw.setdefault("max_tokens", 48)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          temperature=0, **kw)


def test_json_schema_strict_and_json_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = chat(client, "Describe a person as JSON.", response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = chat(client, 'Return the JSON object {"a": 1}.', response_format={"type": "json_object"}, max_tokens=24)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_regex_choice_grammar_and_completions(client):
    r = chat(client, "Give a code.", extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2,5}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", r.choices[0].message.content)
    r = chat(client, "Is the sky blue?", extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert r.choices[0].message.content in ("yes", "no", "maybe")
    r = chat(client, "Write something.", extra_body={"guided_grammar": 'root ::= "x" [0-9] [0-9]? "y"'})
    assert re.fullmatch(r"x[0-9][0-9]?y", r.choices[0].message.content)
    r = client.completions.create(model=MODEL, prompt="The year is", max_tokens=8, temperature=0,
                                  extra_body={"guided_regex": r" (19|20)[0-9]{2}"})
    assert re.fullmatch(r" (19|20)[0-9]{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"


def test_parse_with_pydantic_n3_sampled(client):
    class Person(pydantic.BaseModel):
        name: Annotated[str, pydantic.Field(max_length=12)]
        age: Annotated[int, pydantic.Field(ge=0, le=120)]
        role: Literal["admin", "user"]

    r = client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe a user."}],
                                           response_format=Person, max_tokens=48, n=3, temperature=1.0, seed=3)
    assert len(r.choices) == 3
    for choice in r.choices:
        assert isinstance(choice.message.parsed, Person)


def _check_calls(calls, names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_named_and_required(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = chat(client, "What is the weather in Paris?", tools=TOOLS, tool_choice=named)
    msg = r.choices[0].message
    assert msg.content is None and r.choices[0].finish_reason == "stop"
    _check_calls(msg.tool_calls, {"get_time"})
    r = chat(client, "What is the weather in Paris?", tools=TOOLS, tool_choice="required",
             parallel_tool_calls=False, max_tokens=64)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message.tool_calls, {"get_weather", "get_time"})
    assert len(r.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_stream_as_deltas(client, tool_choice):
    stream = chat(client, "Weather in Rome?", tools=TOOLS, tool_choice=tool_choice, stream=True, max_tokens=64,
                  parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] = call["name"] or (d.function.name if d.function else None)
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    assert calls and reasons[-1] == ("tool_calls" if tool_choice == "required" else "stop")
    for call in calls.values():
        assert call["id"].startswith("call_") and call["name"] in SCHEMAS
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_tool_result_in_the_next_turn(client):
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=16, temperature=0)
    assert r.choices[0].message.content or r.choices[0].message.tool_calls


def test_max_tokens_mid_structure_is_length(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = chat(client, "Describe a person as JSON.", response_format=fmt, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"extra_body": {"guided_regex": "(ab"}}, "guided_regex"),
    ({"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "guided_grammar"),
    ({"extra_body": {"guided_json": {"$ref": "#/$defs/missing"}}}, "guided_json"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "response_format"),
])
def test_bad_specs_are_400s_naming_the_problem(client, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, "hi", **kw)
    assert err.value.body["param"] == param
    chat(client, "hi", max_tokens=2)  # and the server keeps serving


def test_metrics_count_compiles_and_constrained_steps(client, server):
    chat(client, "Pick.", extra_body={"guided_choice": ["left", "right"]})
    with urllib.request.urlopen(server.base_url.removesuffix("/v1") + "/metrics") as r:
        text = r.read().decode()

    def value(name):
        return float(re.search(rf"^{name}_total{{[^}}]*}} (\S+)$", text, re.M).group(1))

    assert value("folio:grammar_compiles") >= 1 and value("folio:constrained_steps") >= 1
    assert value("folio:grammar_errors") >= 0 and value("folio:grammar_cache_hits") >= 0
