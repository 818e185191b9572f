"""The Responses API (``/v1/responses``) driven by the official ``openai`` client and the Messages
API (``/v1/messages``) by the official ``anthropic`` client, against ``folio serve`` on a tiny
random Qwen3 that speaks Qwen3's format (``write_tiny_qwen3_chat_model``): plain, streamed, with
tools, chained by ``previous_response_id``; reasoning split off (``--reasoning-parser`` auto picks
qwen3 from the checkpoint); bad input a 400 in each API's shape, and the server serving on.

The tiny model writes noise, so where a test needs reasoning and a tool call it forces the text
with ``guided_regex`` (vLLM's extra parameter, which constrains the whole output)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from folio.testing.models import write_tiny_qwen3_chat_model
from folio.testing.server import start_server, stop_server

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3"
FORCED = (r'<think>\nParis, so weather\.\n</think>\n\n<tool_call>\n\{"name": "get_weather", '
          r'"arguments": \{"city": "Paris"\}\}\n</tool_call>')
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather", "parameters": SCHEMA}]
MESSAGES_TOOLS = [{"name": "get_weather", "description": "the weather", "input_schema": SCHEMA}]


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm_tokenizer_dir):
    folder = write_tiny_qwen3_chat_model(tmp_path_factory.mktemp("tiny-qwen3"), smollm_tokenizer_dir)
    srv = start_server(folder, "--num-kv-blocks", "256", "--served-model-name", MODEL)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def anthropic_client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"), api_key="unused", max_retries=0,
                               timeout=60)


def test_responses_plain_streamed_and_tools_chained(openai_client):
    r = openai_client.responses.create(model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=5)
    assert r.object == "response" and r.status == "incomplete" and r.usage.output_tokens == 5
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text
    with openai_client.responses.stream(model=MODEL, input="Hi", max_output_tokens=5) as stream:  # the SDK's helper
        streamed = list(stream)
    # cut by max_output_tokens: the stream ends in response.incomplete, as OpenAI's does (the helper's
    # get_final_response() waits for response.completed alone; the last event holds the response)
    text = "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    final = streamed[-1].response
    assert streamed[-1].type == "response.incomplete" and final.status == "incomplete"
    assert text and final.output_text == text and final.incomplete_details.reason == "max_output_tokens"

    events = list(openai_client.responses.create(model=MODEL, input="Weather?", tools=RESPONSES_TOOLS, stream=True,
                                                 max_output_tokens=200, extra_body={"guided_regex": FORCED}))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and [e.sequence_number for e in events] == list(range(len(events)))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == "\nParis, so weather.\n"
    done = events[-1].response
    assert [o.type for o in done.output] == ["reasoning", "function_call"]
    call = done.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments

    whole = openai_client.responses.create(model=MODEL, input="Weather?", tools=RESPONSES_TOOLS, max_output_tokens=200,
                                           extra_body={"guided_regex": FORCED})
    assert [o.type for o in whole.output] == ["reasoning", "function_call"]
    assert whole.output[0].content[0].text == thought
    # the next turn continues the stored one: the call and its output are in the prompt
    follow = openai_client.responses.create(
        model=MODEL, previous_response_id=whole.id, max_output_tokens=2, tools=RESPONSES_TOOLS,
        input=[{"type": "function_call_output", "call_id": whole.output[1].call_id, "output": "sunny, 21 C"}])
    assert follow.previous_response_id == whole.id
    assert follow.usage.input_tokens > whole.usage.input_tokens + 10
    assert openai_client.responses.retrieve(follow.id).id == follow.id


def test_responses_structured_output_through_text_format(openai_client):
    import pydantic

    class Answer(pydantic.BaseModel):
        ok: bool

    # thinking off: the grammar then constrains the whole reply (with it on, the noise of a random
    # model would have to close its think block first)
    parsed = openai_client.responses.parse(model=MODEL, input="Is it?", text_format=Answer, max_output_tokens=20,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Answer)
    assert parsed.output_text == json.dumps(parsed.output_parsed.model_dump())


def test_messages_plain_streamed_and_tools(anthropic_client):
    m = anthropic_client.messages.create(model=MODEL, max_tokens=4, system="Be brief.",
                                         messages=[{"role": "user", "content": "Hi"}])
    assert m.type == "message" and m.stop_reason == "max_tokens" and m.usage.output_tokens == 4
    assert m.content[0].type == "text"
    with anthropic_client.messages.stream(model=MODEL, max_tokens=4, system="Be brief.",
                                          messages=[{"role": "user", "content": "Hi"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.content[0].text == text and final.usage.output_tokens == 4
    # the prompt's tokens: input (not cached) plus cache reads, as Anthropic counts them
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        m.usage.input_tokens + m.usage.cache_read_input_tokens
    counted = anthropic_client.messages.count_tokens(model=MODEL, system="Be brief.",
                                                     messages=[{"role": "user", "content": "Hi"}])
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens

    with anthropic_client.messages.stream(model=MODEL, max_tokens=200, tools=MESSAGES_TOOLS,
                                          messages=[{"role": "user", "content": "Weather?"}],
                                          extra_body={"guided_regex": FORCED}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == "\nParis, so weather.\n"
    assert final.content[1].name == "get_weather" and final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"

    whole = anthropic_client.messages.create(model=MODEL, max_tokens=200, tools=MESSAGES_TOOLS,
                                             messages=[{"role": "user", "content": "Weather?"}],
                                             extra_body={"guided_regex": FORCED})
    assert [b.type for b in whole.content] == ["thinking", "tool_use"] and whole.stop_reason == "tool_use"
    use = whole.content[1]
    # the tool's result goes back as a tool_result block; a stop sequence ends the answer
    after = anthropic_client.messages.create(
        model=MODEL, max_tokens=50, stop_sequences=["!"], extra_body={"guided_regex": "Sunny!"},
        messages=[{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                     "input": use.input}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}])
    assert after.content[0].text == "Sunny" and after.stop_reason == "stop_sequence" and after.stop_sequence == "!"


def test_chat_reasoning_and_template_kwargs(openai_client):
    forced = {"guided_regex": r"<think>\nabc\n</think>\n\nHello"}
    whole = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=60, extra_body=forced)
    message = whole.choices[0].message
    assert message.content == "Hello" and message.reasoning_content == "\nabc\n"
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=60, stream=True, extra_body=forced))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "\nabc\n"
    assert "".join(d.content or "" for d in deltas) == "Hello"
    # enable_thinking false reaches the template: it closes an empty think block in the prompt
    off = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking":
                                                                                                   False}})
    assert off.usage.prompt_tokens > whole.usage.prompt_tokens


def _literal(text: str) -> str:
    """A regex that matches ``text`` alone (xgrammar's syntax: no escaped spaces)."""
    return "".join("\\" + c if c in "\\^$.|?*+()[]{}" else "\\n" if c == "\n" else c for c in text)


FAMILY_CALLS = [  # what each family writes for get_weather(city="Paris")
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',  # Hermes / Qwen
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',  # Llama 3.1 JSON
    '[get_weather(city="Paris")]',  # Llama 3.2 / 4 pythonic
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',  # Mistral
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",  # Qwen3-Coder
]


@pytest.mark.parametrize("call", FAMILY_CALLS, ids=["hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder"])
def test_each_familys_tool_call_forced_on_the_model_is_parsed_whole_and_streamed(openai_client, call):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    forced = {"guided_regex": _literal("<think>\nweather\n</think>\n\n" + call)}
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=tools, max_tokens=200,
                  extra_body=forced)
    whole = openai_client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert whole.message.reasoning_content == "\nweather\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)  # nothing of the call leaked out as text
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert [json.loads(t.function.arguments) for t in calls] == [{"city": "Paris"}]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("path,body,shape", [
    ("/v1/responses", {"model": MODEL}, "openai"),  # no input
    ("/v1/responses", {"input": "x", "tools": [{"type": "web_search"}]}, "openai"),
    ("/v1/responses", {"input": [{"type": "input_image"}]}, "openai"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 0}, "openai"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}, "anthropic"),  # no max_tokens
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}, "anthropic"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "anthropic"),
    ("/v1/responses", {"input": [1, 2]}, "openai"),
    ("/v1/responses", {"input": [{"role": "user", "content": None}], "stream": True}, "openai"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function"}]}, "openai"),  # no name
    ("/v1/responses", {"input": "x", "text": {"format": "json"}}, "openai"),
    ("/v1/messages", {"max_tokens": 5, "messages": [], "stream": True}, "anthropic"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [5]}]}, "anthropic"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                      "tools": [{"name": "f", "input_schema": 5}]}, "anthropic"),
    ("/v1/messages", {"max_tokens": 10 ** 6, "messages": [{"role": "user", "content": "x"}]}, "anthropic"),
])
def test_bad_input_is_a_400_in_the_apis_shape_and_the_server_serves_on(server, path, body, shape):
    base = server.base_url.removesuffix("/v1")
    status, answer = post(base + path, body)
    assert status == 400, answer
    if shape == "openai":
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
    else:
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    status, answer = post(base + "/v1/responses", {"input": "hi", "previous_response_id": "resp_nope"})
    assert status == 404 and answer["error"]["code"] == "previous_response_not_found"
    status, answer = post(base + path, {"input": "hi", "max_output_tokens": 1} if shape == "openai" else
                          {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, answer


def test_folio_chat_in_tmux_streams_keeps_and_clears_the_conversation(server, tmp_path):
    """``folio chat`` driven as a person would, in a terminal (tmux): an answer streams in, the
    conversation is kept, ``/clear`` forgets it (``/save`` shows what it holds)."""
    import os
    import shutil
    import subprocess
    import sys
    import time

    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed: folio chat's terminal test needs it (scripts/setup.sh --test installs "
                    "it; apt-get install tmux)", pytrace=False)
    session = f"folio-chat-{os.getpid()}"
    cmd = (f"env PYTHONPATH={os.pathsep.join(sys.path)} {sys.executable} -m folio.cli.main chat "
           f"--url {server.base_url} --max-tokens 6 --system 'Be brief.'")

    def tmux(*args: str) -> str:
        return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout

    def pane_until(predicate, what: str) -> str:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = tmux("capture-pane", "-p", "-t", session)
            if predicate(text):
                return text
            time.sleep(0.1)
        raise AssertionError(f"no {what} in the pane:\n{text}")

    def waiting(text: str) -> bool:  # the last line is an empty prompt (tmux trims its space)
        lines = [line for line in text.splitlines() if line.strip()]
        return bool(lines) and lines[-1].strip() == ">"

    def saved(name: str) -> list[dict]:
        path = tmp_path / name
        tmux("send-keys", "-t", session, f"/save {path}", "Enter")
        pane_until(lambda t: f"to {path}" in t.replace("\n", ""), "save")
        return json.loads(path.read_text())

    tmux("new-session", "-d", "-s", session, "-x", "200", "-y", "50", cmd)
    try:
        pane_until(lambda t: "folio chat: tiny-qwen3" in t and waiting(t), "greeting")
        tmux("send-keys", "-t", session, "Hello there", "Enter")
        pane_until(lambda t: waiting(t) and sum(line.startswith(">") for line in t.splitlines()) >= 2,
                   "answer and a new prompt")
        kept = saved("before.json")
        assert [m["role"] for m in kept] == ["system", "user", "assistant"] and kept[1]["content"] == "Hello there"
        assert kept[2]["content"]  # the streamed answer's text was kept
        tmux("send-keys", "-t", session, "/clear", "Enter")
        pane_until(lambda t: "conversation cleared" in t, "clear")
        assert saved("after.json") == [{"role": "system", "content": "Be brief."}]
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
