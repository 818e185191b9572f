"""A request cut by its token limit ends in the same final status streamed and unstreamed, on every
endpoint that streams, against ``folio serve`` on a tiny random model with SmolLM2's tokenizer and
chat template: chat and completions say ``finish_reason`` ``length``; Responses says ``status``
``incomplete`` (reason ``max_output_tokens``), and its stream ends in ``response.incomplete``, as
OpenAI's API ends it; Messages says ``stop_reason`` ``max_tokens``. ``ignore_eos`` makes sure the
limit is what ends each request. The raw SSE is read, so an event's name is checked as sent."""

from __future__ import annotations

import json
import urllib.request

import pytest

from folio.testing.models import write_tiny_chat_model
from folio.testing.server import start_server, stop_server

pytestmark = pytest.mark.slow  # a served stack: about 20 s to start on a busy 2-core machine

MODEL = "tiny"
LIMIT = 6
QUESTION = "Name a river."


@pytest.fixture(scope="module")
def base(tmp_path_factory, smollm_tokenizer_dir):
    folder = write_tiny_chat_model(tmp_path_factory.mktemp("tiny-final-status"), smollm_tokenizer_dir)
    server = start_server(folder, "--served-model-name", MODEL, "--num-kv-blocks", "64", "--dtype", "float32")
    yield server.base_url.removesuffix("/v1")
    stop_server(server)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def post_stream(url: str, body: dict) -> list[tuple[str | None, dict]]:
    """The stream's events as (SSE event name or None, data), up to ``[DONE]`` or the end."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    events, name = [], None
    with urllib.request.urlopen(req, timeout=60) as r:
        for raw in r:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event:"):
                name = line.removeprefix("event:").strip()
            elif line.startswith("data:"):
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                events.append((name, json.loads(data)))
                name = None
    return events


def test_chat_and_completions_say_length_streamed_and_not(base):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": LIMIT,
            "temperature": 0, "ignore_eos": True}
    whole = post(f"{base}/v1/chat/completions", chat)
    streamed = [c["finish_reason"] for _, e in post_stream(f"{base}/v1/chat/completions", chat)
                for c in e["choices"] if c["finish_reason"] is not None]
    assert whole["choices"][0]["finish_reason"] == "length" and streamed == ["length"]

    completion = {"model": MODEL, "prompt": QUESTION, "max_tokens": LIMIT, "temperature": 0, "ignore_eos": True}
    whole = post(f"{base}/v1/completions", completion)
    streamed = [c["finish_reason"] for _, e in post_stream(f"{base}/v1/completions", completion)
                for c in e["choices"] if c["finish_reason"] is not None]
    assert whole["choices"][0]["finish_reason"] == "length" and streamed == ["length"]


def test_responses_end_incomplete_streamed_and_not(base):
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": LIMIT, "temperature": 0, "ignore_eos": True}
    whole = post(f"{base}/v1/responses", body)
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["output"][-1]["status"] == "incomplete"  # the item the limit cut

    events = post_stream(f"{base}/v1/responses", body)
    kinds = [e["type"] for _, e in events]
    assert [name for name, _ in events] == kinds  # each SSE event is named as its type
    assert kinds[-1] == "response.incomplete" and "response.completed" not in kinds
    final = events[-1][1]["response"]
    assert final["status"] == whole["status"] and final["incomplete_details"] == whole["incomplete_details"]
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"] == LIMIT
    done = [e["item"] for _, e in events if e["type"] == "response.output_item.done"]
    assert done[-1]["status"] == "incomplete" and final["output"][-1]["status"] == "incomplete"
    stored = json.loads(urllib.request.urlopen(f"{base}/v1/responses/{final['id']}", timeout=10).read())
    assert stored["status"] == "incomplete"

    body["max_output_tokens"] = 200  # not cut: the stream completes, as the whole response does
    body.pop("ignore_eos")
    whole = post(f"{base}/v1/responses", body)
    kinds = [e["type"] for _, e in post_stream(f"{base}/v1/responses", body)]
    assert kinds[-1] == f"response.{whole['status']}"


def test_messages_say_max_tokens_streamed_and_not(base):
    body = {"model": MODEL, "max_tokens": LIMIT, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": QUESTION}]}
    whole = post(f"{base}/v1/messages", body)
    events = post_stream(f"{base}/v1/messages", body)
    streamed = [e["delta"]["stop_reason"] for name, e in events if name == "message_delta"]
    assert whole["stop_reason"] == "max_tokens" and streamed == ["max_tokens"]
    assert events[-1][0] == "message_stop"
