"""The gateway serving requests through the real tokenizer service over real ``ipc://`` sockets,
with ``ScriptedScheduler`` standing in for the scheduler: response shapes (checked against the
OpenAI OpenAPI description), streams, n and lists of prompts, stop strings, logprobs, echo,
usage, context errors, client disconnects, malformed messages, /metrics."""

from __future__ import annotations

import asyncio
import json

import pytest
import zmq
from aiohttp.test_utils import TestClient, TestServer

from folio.shared.messages import AdminReply
from folio.shared.transport import encode, make_socket
from tests.services.frontend import SCRIPT_TEXT, admin_call, front_half, text_tokenizer, wait_for
from tests.services.openai_schema import validate

pytestmark = pytest.mark.asyncio

MODEL = "SmolLM2-135M-Instruct"
MSGS = [{"role": "user", "content": "Hi"}]


async def sse_events(response) -> list:
    """Every ``data:`` payload of an SSE response, ``[DONE]`` as the string."""
    events = []
    async for line in response.content:
        line = line.decode().strip()
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def completion_chunk_schema_check(chunk: dict) -> None:
    """Stream chunks share the completion object's shape, except that finish_reason (and, with
    include_usage, usage) may be null."""
    fixed = {k: v for k, v in chunk.items() if not (k == "usage" and v is None)}
    fixed = {**fixed, "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]}
    validate(fixed, "CreateCompletionResponse")


async def test_completion_shape_usage_and_defaults():
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say:"})
        body = await r.json()
        assert r.status == 200, body
        validate(body, "CreateCompletionResponse")
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        (choice,) = body["choices"]
        script_ids = text_tokenizer().hf.encode(SCRIPT_TEXT)
        assert choice["finish_reason"] == "length" and choice["logprobs"] is None
        assert choice["text"] == text_tokenizer().decode(script_ids[:16])  # OpenAI's default max_tokens
        num_prompt = len(text_tokenizer().hf.encode("Say:"))
        assert body["usage"]["prompt_tokens"] == num_prompt and body["usage"]["completion_tokens"] == 16
        assert body["usage"]["total_tokens"] == num_prompt + 16


async def test_list_of_prompts_with_n_fans_out_with_seeds():
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        prompts = [[1, 2683], [9690, 198, 2683]]
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "n": 2, "seed": 7,
                                                       "max_tokens": 3, "temperature": 0.8})
        body = await r.json()
        validate(body, "CreateCompletionResponse")
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        received = sorted(fh.scheduler.received, key=lambda e: e.req_id)
        assert [e.req_id for e in received] == [f"{body['id']}-{i}" for i in range(4)]
        assert [e.sampling.seed for e in received] == [7, 8, 7, 8]
        assert received[2].prompt_token_ids == [9690, 198, 2683]
        assert all(e.sampling.temperature == 0.8 and e.sampling.max_tokens == 3 for e in received)
        # each prompt counted once, every choice's tokens counted
        assert body["usage"]["prompt_tokens"] == 2 + 3
        assert body["usage"]["completion_tokens"] == 12


async def test_streamed_completion_equals_whole_and_ends_with_usage():
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        req = {"model": MODEL, "prompt": "Say:", "max_tokens": 12}
        whole = await (await client.post("/v1/completions", json=req)).json()
        r = await client.post("/v1/completions", json={**req, "stream": True,
                                                       "stream_options": {"include_usage": True}})
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_events(r)
        assert events[-1] == "[DONE]"
        chunks, usage_chunk = events[:-2], events[-2]
        for chunk in chunks:
            completion_chunk_schema_check(chunk)
            assert chunk["usage"] is None and chunk["id"] == chunks[0]["id"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]


async def test_chat_stream_shapes_role_first_and_usage_last():
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        req = {"model": MODEL, "messages": MSGS, "max_tokens": 6, "n": 2, "stream": True,
               "stream_options": {"include_usage": True}}
        events = await sse_events(await client.post("/v1/chat/completions", json=req))
        assert events[-1] == "[DONE]"
        for chunk in events[:-1]:
            validate(chunk, "CreateChatCompletionStreamResponse")
            assert chunk["object"] == "chat.completion.chunk"
        texts = {0: "", 1: ""}
        for chunk in events[:-2]:
            (choice,) = chunk["choices"]
            texts[choice["index"]] += choice["delta"].get("content", "")
        firsts = {}
        for chunk in events[:-2]:
            firsts.setdefault(chunk["choices"][0]["index"], chunk["choices"][0]["delta"])
        assert firsts == {0: {"role": "assistant", "content": ""}, 1: {"role": "assistant", "content": ""}}
        script_ids = text_tokenizer().hf.encode(SCRIPT_TEXT)
        assert texts[0] == texts[1] == text_tokenizer().decode(script_ids[:6])
        assert events[-2]["usage"]["completion_tokens"] == 12
        (e,) = [e for e in fh.scheduler.received if e.req_id.endswith("-0")]
        assert e.sampling.max_tokens == 6


async def test_chat_logprobs_and_default_max_tokens():
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        req = {"model": MODEL, "messages": MSGS, "logprobs": True, "top_logprobs": 2}
        body = await (await client.post("/v1/chat/completions", json=req)).json()
        validate(body, "CreateChatCompletionResponse")
        (choice,) = body["choices"]
        assert choice["finish_reason"] == "stop"  # the script ran out: EOS
        content = choice["logprobs"]["content"]
        assert "".join(x["token"] for x in content[:-1]) == choice["message"]["content"]
        assert content[-1]["token"] == "<|im_end|>"  # EOS is scored, not shown in the text
        assert all(len(x["top_logprobs"]) == 2 and x["bytes"] == list(x["token"].encode()) for x in content)
        (e,) = fh.scheduler.received
        assert e.sampling.max_tokens is None and e.sampling.logprobs == 2  # None: what the context leaves


async def test_chat_logprob_bytes_join_split_characters():
    script = text_tokenizer().hf.encode(" 😀 世界 ok")
    async with front_half(script=lambda req: script) as fh, TestClient(TestServer(fh.app)) as client:
        req = {"model": MODEL, "messages": MSGS, "logprobs": True, "max_tokens": len(script)}
        body = await (await client.post("/v1/chat/completions", json=req)).json()
        validate(body, "CreateChatCompletionResponse")
        (choice,) = body["choices"]
        assert choice["message"]["content"] == " 😀 世界 ok"
        content = choice["logprobs"]["content"]
        assert any(x["token"] == "\ufffd" for x in content)  # the premise: split characters
        assert bytes(b for x in content for b in x["bytes"]).decode() == " 😀 世界 ok"


async def test_stop_string_cut_reported_and_aborted():
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        req = {"model": MODEL, "prompt": "Say:", "max_tokens": 40, "stop": ["42. EN", "never"]}
        body = await (await client.post("/v1/completions", json=req)).json()
        (choice,) = body["choices"]
        assert choice["text"] == " The answer is "
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "42. EN"
        await wait_for(lambda: [a.reason for a in fh.scheduler.aborts] == ["stop"])
        events = await sse_events(await client.post("/v1/completions", json={**req, "stream": True}))
        streamed = "".join(c["choices"][0]["text"] for c in events[:-1])
        assert streamed == " The answer is " and "4" not in streamed


async def test_echo_with_logprobs_and_token_prompt():
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        prompt_ids = text_tokenizer().hf.encode("Hello there")
        req = {"model": MODEL, "prompt": prompt_ids, "max_tokens": 3, "echo": True, "logprobs": 1}
        body = await (await client.post("/v1/completions", json=req)).json()
        validate({**body, "choices": [{**c, "logprobs": None} for c in body["choices"]]}, "CreateCompletionResponse")
        (choice,) = body["choices"]
        assert choice["text"].startswith("Hello there The answer")
        lp = choice["logprobs"]
        assert lp["tokens"][: len(prompt_ids)] == [text_tokenizer().decode_with_specials([t]) for t in prompt_ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["tokens"]) == len(prompt_ids) + 3
        assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]


async def test_echo_with_logprobs_0_returns_each_chosen_token_in_top_logprobs():
    """lm-eval's loglikelihood request: ``echo, logprobs=0, max_tokens=1``; OpenAI always returns the
    chosen token's logprob, so each position's top_logprobs holds exactly that token."""
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        prompt_ids = text_tokenizer().hf.encode("Hello there friend")
        req = {"model": MODEL, "prompt": "Hello there friend", "max_tokens": 1, "echo": True, "logprobs": 0}
        for stream in (False, True):
            r = await client.post("/v1/completions", json={**req, "stream": stream})
            if stream:
                chunks = [c for c in await sse_events(r) if c != "[DONE]"]
                lp = {k: [v for c in chunks if c["choices"][0]["logprobs"] for v in c["choices"][0]["logprobs"][k]]
                      for k in ("tokens", "token_logprobs", "top_logprobs")}
            else:
                lp = (await r.json())["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == len(prompt_ids) + 1
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
                assert top == {token: value}, stream


async def test_chat_top_logprobs_0_still_returns_the_chosen_token():
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        req = {"model": MODEL, "messages": MSGS, "logprobs": True, "top_logprobs": 0, "max_tokens": 4}
        body = await (await client.post("/v1/chat/completions", json=req)).json()
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == 4
        assert all(x["top_logprobs"] == [{"token": x["token"], "logprob": x["logprob"], "bytes": x["bytes"]}]
                   for x in content)
        chunks = [c for c in await sse_events(await client.post("/v1/chat/completions", json={**req, "stream": True}))
                  if c != "[DONE]" and c["choices"] and c["choices"][0]["logprobs"]]
        streamed = [x for c in chunks for x in c["choices"][0]["logprobs"]["content"]]
        assert streamed == content


async def test_context_too_long_is_a_400_streamed_or_not():
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        for stream in (False, True):
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 8192,
                                                           "stream": stream})
            assert r.status == 400
            body = await r.json()
            validate(body, "ErrorResponse")
            assert "maximum context length is 8192" in body["error"]["message"]
            assert body["error"]["param"] == "max_tokens"
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 99999]})
        assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
        assert fh.scheduler.received == []


async def test_concurrent_streams_each_get_their_own_text():
    tok = text_tokenizer()

    def echo_prompt(req):  # every request's script depends on its prompt: cross-talk would show
        return tok.hf.encode(f" echo:{tok.decode(req.prompt_token_ids)}")

    async def one(client, i: int) -> str:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": f"client {i}", "max_tokens": 50,
                                                       "stream": True})
        return "".join(c["choices"][0]["text"] for c in (await sse_events(r))[:-1])

    async with front_half(script=echo_prompt) as fh, TestClient(TestServer(fh.app)) as client:
        texts = await asyncio.gather(*[one(client, i) for i in range(32)])
        assert texts == [f" echo:client {i}" for i in range(32)]
        assert not fh.gateway.mailboxes and not fh.tokenizer.outputs.requests


async def test_client_disconnect_mid_stream_aborts_the_request():
    script = text_tokenizer().hf.encode(SCRIPT_TEXT * 20)
    async with front_half(script=lambda req: script, step_s=0.02) as fh, TestClient(TestServer(fh.app)) as client:
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": MSGS, "stream": True,
                                                            "max_tokens": 500})
        await r.content.readline()  # the stream is flowing
        (engine_req,) = fh.scheduler.received
        r.close()  # the client hangs up
        # the handler aborts it; a step's output that reaches the gateway after the handler left is a
        # stray, and the gateway aborts its request again (the scheduler ignores a second abort)
        await wait_for(lambda: {a.req_id for a in fh.scheduler.aborts} == {engine_req.req_id})
        assert len(fh.scheduler.aborts) <= 2 and all(a.reason == "abort" for a in fh.scheduler.aborts)
        assert engine_req.req_id not in fh.scheduler.requests
        await wait_for(lambda: not fh.gateway.mailboxes and not fh.tokenizer.outputs.requests)


async def test_client_gone_before_a_whole_response_aborts_the_request():
    script = text_tokenizer().hf.encode(SCRIPT_TEXT * 20)
    async with front_half(script=lambda req: script, step_s=0.02) as fh, TestClient(TestServer(fh.app)) as client:
        request = asyncio.ensure_future(client.post("/v1/completions", json={"model": MODEL, "prompt": "Say:",
                                                                             "max_tokens": 500, "n": 2}))
        await wait_for(lambda: len(fh.scheduler.received) == 2)
        request.cancel()  # the client gives up: its connection closes
        await asyncio.gather(request, return_exceptions=True)
        # every choice is aborted (an abort may arrive twice: the gateway also drops output nobody reads)
        await wait_for(lambda: {a.req_id for a in fh.scheduler.aborts} == {e.req_id for e in fh.scheduler.received})
        assert not fh.scheduler.requests


async def test_gateway_and_tokenizer_survive_malformed_messages():
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        push_gw = make_socket(fh.ctx, zmq.PUSH, fh.endpoints.gateway_in)
        push_tok = make_socket(fh.ctx, zmq.PUSH, fh.endpoints.tokenizer_in)
        wrong_type = encode(AdminReply(ok=True))  # valid msgpack, not a message this socket takes
        bad_generate = b"\x82\xa4type\xa8generate\xa6req_id\xa3r-1"  # tagged, but no sampling params
        for sock in (push_gw, push_tok):
            for data in (b"\x00garbage\xff", wrong_type, bad_generate):
                await sock.send(data)
        await wait_for(lambda: fh.gateway.stats["num_malformed"] == 3 and fh.tokenizer.stats["num_malformed"] == 3)
        for address in (fh.endpoints.admin_tokenizer, fh.endpoints.admin_gateway):  # admin sockets too
            junk = make_socket(fh.ctx, zmq.DEALER, address)
            await junk.send(b"\x00garbage\xff")
            junk.close(linger=500)
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say:", "max_tokens": 4})
        assert r.status == 200 and (await r.json())["choices"][0]["text"]
        reply = await admin_call(fh.ctx, fh.endpoints.admin_tokenizer, "stats")
        assert reply.ok and reply.data["num_malformed"] == 3 and reply.data["num_generate"] == 1
        reply = await admin_call(fh.ctx, fh.endpoints.admin_gateway, "stats")
        assert reply.ok and reply.data["num_malformed"] == 3
        push_gw.close(linger=0)
        push_tok.close(linger=0)


async def _fake_admin(ctx, address: str, data: dict) -> None:
    """A scheduler's or kvmanager's admin socket that answers every request with ``data``."""
    sock = make_socket(ctx, zmq.ROUTER, address)
    try:
        while True:
            *envelope, _ = await sock.recv_multipart()
            await sock.send_multipart([*envelope, encode(AdminReply(ok=True, data=data))])
    finally:
        sock.close(linger=0)


async def test_metrics_count_tokens_and_read_engine_stats():
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say:", "max_tokens": 5})
        fakes = [
            asyncio.ensure_future(_fake_admin(fh.ctx, fh.endpoints.admin_scheduler,
                                              {"num_running": 3, "num_waiting": 2})),
            asyncio.ensure_future(_fake_admin(fh.ctx, fh.endpoints.admin_kvmanager,
                                              {"num_blocks_total": 200, "num_blocks_used": 50})),
        ]
        try:
            text = await (await client.get("/metrics")).text()
        finally:
            for f in fakes:
                f.cancel()
            await asyncio.gather(*fakes, return_exceptions=True)
        label = '{model_name="SmolLM2-135M-Instruct"}'
        assert f"folio:num_requests_running{label} 3.0" in text
        assert f"folio:num_requests_waiting{label} 2.0" in text
        assert f"folio:kv_cache_usage_perc{label} 0.25" in text
        assert f"folio:generation_tokens_total{label} 5.0" in text
        assert f"folio:prompt_tokens_total{label} {len(text_tokenizer().hf.encode('Say:'))}.0" in text
        assert f"folio:time_to_first_token_seconds_count{label} 1.0" in text
        assert f"folio:inter_token_latency_seconds_count{label} 4.0" in text
        assert 'folio:inter_token_latency_seconds_bucket{le="+Inf",model_name="SmolLM2-135M-Instruct"} 4.0' in text
        assert f"folio:e2e_request_latency_seconds_count{label} 1.0" in text
