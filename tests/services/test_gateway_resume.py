"""A stream resumed on this gateway (the router's ``continue_choices``, with ``return_token_ids``),
with the real tokenizer and a scripted scheduler: the continuation sends only what follows the
tokens its client has (no role chunk, no echo, no text again), finished choices not at all; and
the router's side (``resume.ResumableStream``) keeps whole events and each choice's token ids."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from folio.services.router.resume import ResumableStream
from tests.services.frontend import front_half

pytestmark = pytest.mark.asyncio

MODEL = "SmolLM2-135M-Instruct"


def events(raw: str) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


async def test_a_continuation_streams_only_what_follows_the_clients_tokens():
    body = {"model": MODEL, "prompt": "Say:", "max_tokens": 30, "ignore_eos": True, "stream": True, "n": 2,
            "echo": True, "return_token_ids": True, "stop": ["twice over"]}
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        whole = events(await (await client.post("/v1/completions", json=body)).text())
        texts, ids = {0: "", 1: ""}, {0: [], 1: []}
        for e in whole:
            for c in e["choices"]:
                texts[c["index"]] += c["text"]
                ids[c["index"]] += c["token_ids"]
        assert texts[0].startswith("Say:") and ids[0]  # echoed, and the ids came with the chunks
        # choice 0 had its first 5 tokens, choice 1 had finished
        k = 5
        r = await client.post("/v1/completions", json={**body, "continue_choices": [
            {"index": 0, "token_ids": ids[0][:k]}, {"index": 1, "token_ids": ids[1], "finished": True}]})
        rest = events(await r.text())
        assert all(c["index"] == 0 for e in rest for c in e["choices"])
        head = fh.tokenizer.tokenizer.decode(ids[0][:k])
        assert "Say:" + head + "".join(c["text"] for e in rest for c in e["choices"]) == texts[0]
        assert [t for e in rest for c in e["choices"] for t in c["token_ids"]] == ids[0][k:]
        cont = [m for m in fh.scheduler.received if m.forced_token_ids]
        assert cont[-1].forced_token_ids == ids[0][:k] and not cont[-1].fork_req_ids
        # nothing left: just the end of the stream
        r = await client.post("/v1/completions", json={**body, "continue_choices": [
            {"index": i, "token_ids": ids[i], "finished": True} for i in (0, 1)]})
        assert (await r.text()).strip() == "data: [DONE]"
        r = await client.post("/v1/completions", json={**body, "stream": False, "continue_choices": [{"index": 0}]})
        assert r.status == 400 and (await r.json())["error"]["param"] == "continue_choices"


def test_the_router_forwards_whole_events_and_keeps_each_choices_token_ids():
    stream = ResumableStream({"stream": True, "prompt": "x"})
    a = b'data: {"id":"c1","created":1,"choices":[{"index":0,"text":"He","token_ids":[5,6],"finish_reason":null}]}'
    out = stream.feed(a[:30])
    assert out == b""  # half an event is never forwarded
    out = stream.feed(a[30:] + b"\n\ndata: {\"id\":\"c2\",\"created\":2,\"choices\":[{\"index\":1,\"text\":\"x\","
                      b"\"token_ids\":[9],\"finish_reason\":\"length\"}]}\n\n")
    chunks = [json.loads(line[6:]) for line in out.decode().split("\n\n") if line]
    assert [c["id"] for c in chunks] == ["c1", "c1"]  # one id for the client's whole stream
    assert all("token_ids" not in ch for c in chunks for ch in c["choices"])
    assert stream.token_ids == {0: [5, 6], 1: [9]} and stream.finished == {1}
    stream.feed(b'data: {"id":"c1","choices":[{"index":0,"text":"llo","token_ids":[7]')  # cut by a break
    stream._buffer = b""
    body = json.loads(stream.continuation_body())
    assert body["continue_choices"] == [{"index": 0, "token_ids": [5, 6], "finished": False},
                                        {"index": 1, "token_ids": [9], "finished": True}]
    assert body["return_token_ids"] is True and not stream.done
    stream.feed(b"data: [DONE]\n\n")
    assert stream.done
    assert ResumableStream.for_body({"stream": True, "tools": [{}]}) is None
