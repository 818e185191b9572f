"""The gateway's limits and deadlines, with the real tokenizer and a scripted scheduler: 413 past
the body limit, 429 past the queue and open-request limits, the request timeout (an error, and
the request aborted), and a lost tokenizer or scheduler failing the requests in flight."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.services.frontend import SCRIPT_TEXT, front_half, text_tokenizer, wait_for
from tests.services.openai_schema import validate

pytestmark = pytest.mark.asyncio

MODEL = "SmolLM2-135M-Instruct"


async def test_a_body_past_the_limit_gets_413():
    async with front_half(max_body_bytes=2000) as fh, TestClient(TestServer(fh.app)) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 5000})
        assert r.status == 413
        validate(await r.json(), "ErrorResponse")
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say:", "max_tokens": 2})
        assert r.status == 200
        # a declared length over the limit: 413 at once, the body never sent (the client waits on no read)
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 99999999\r\n\r\n")
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 5)  # answered with no body byte sent
        writer.close()
        assert status.startswith(b"HTTP/1.1 413"), status


async def test_a_client_sending_its_body_a_byte_at_a_time_gets_408():
    async with front_half(body_timeout_s=0.5) as fh, TestClient(TestServer(fh.app)) as client:
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        await writer.drain()
        for _ in range(3):  # a byte every 0.3 s: never all in
            await asyncio.sleep(0.3)
            writer.write(b" ")
            await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 5)
        assert status.startswith(b"HTTP/1.1 408"), status
        writer.close()
        assert fh.scheduler.received == []  # nothing reached the engine
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say:", "max_tokens": 2})
        assert r.status == 200


async def test_a_client_sending_its_headers_a_byte_at_a_time_is_dropped():
    """Past the header timeout a connection whose headers are not whole is closed, no handler
    having run; a request that takes longer than that once begun is not cut."""
    from folio.services.gateway.app import runner_options

    async with front_half(header_timeout_s=0.6, step_s=0.05) as fh:
        server = TestServer(fh.app)
        options = {k: v for k, v in runner_options(fh.gateway.config).items() if k != "handler_cancellation"}
        await server.start_server(**options)  # (the test server sets handler_cancellation itself)
        async with TestClient(server) as client:
            reader, writer = await asyncio.open_connection(client.host, client.port)
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sent, t0 = 0, asyncio.get_running_loop().time()
            with pytest.raises((ConnectionError, AssertionError)):
                for byte in head:  # a byte every 0.1 s: 6.7 s for the whole head, were it let
                    writer.write(bytes([byte]))
                    await writer.drain()
                    sent += 1
                    assert not reader.at_eof()
                    await asyncio.sleep(0.1)
            try:
                answer = await asyncio.wait_for(reader.read(), 5)
            except ConnectionError:  # reset rather than closed: as good
                answer = b""
            assert answer == b""  # closed, not answered
            elapsed = asyncio.get_running_loop().time() - t0
            assert 0.5 < elapsed < 3.0 and sent < len(head), (elapsed, sent)
            writer.close()
            assert fh.scheduler.received == []  # nothing reached the engine
            # a stream that runs past the header timeout (30 steps of 0.05 s) is served whole
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say:", "max_tokens": 30,
                                                           "stream": True})
            assert r.status == 200
            body = await r.text()
            assert body.rstrip().endswith("data: [DONE]")


async def test_a_prompt_longer_than_any_context_is_a_400_before_it_is_tokenized():
    async with front_half(max_model_len=64) as fh, TestClient(TestServer(fh.app)) as client:
        tokenizer = fh.tokenizer.tokenizer
        encoded = []
        real_encode = tokenizer.hf.encode
        tokenizer.hf = type("Counted", (), {"__getattr__": lambda self, name: getattr(real_encode.__self__, name),
                                            "encode": lambda self, text, **kw: encoded.append(len(text))
                                            or real_encode(text, **kw)})()
        bound = tokenizer.max_token_chars * 64
        for body, param in (({"prompt": "x" * (bound + 1)}, "prompt"),
                            ({"messages": [{"role": "user", "content": "y" * (bound + 1)}]}, "messages")):
            r = await client.post("/v1/completions" if "prompt" in body else "/v1/chat/completions",
                                  json={"model": MODEL, "max_tokens": 2, **body})
            assert r.status == 400, await r.text()
            err = (await r.json())["error"]
            assert err["param"] == param and "maximum context length is 64" in err["message"], err
        assert not any(n > bound for n in encoded), encoded  # never tokenized
        # under the bound, over the context: tokenized, and refused by its count as before
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hello " * 100, "max_tokens": 2})
        assert r.status == 400 and "(101 in the prompt" in (await r.json())["error"]["message"]
        assert encoded and max(encoded) == 600
        assert fh.scheduler.received == []


async def test_stop_strings_and_tools_have_caps_named_in_the_400():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        for body, field in (({"prompt": "Say:", "stop": ["x" * 1025]}, "stop"),
                            ({"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{**tool, "function": {**tool["function"], "name": f"f{i}"}}
                                        for i in range(129)]}, "tools")):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = await client.post(path, json={"model": MODEL, **body})
            assert r.status == 400
            error = (await r.json())["error"]
            assert field in (error.get("param") or "") + error["message"], error


async def test_past_the_queue_limit_new_requests_get_429():
    async with front_half(max_queue_len=1) as fh, TestClient(TestServer(fh.app)) as client:
        fh.scheduler.paused = True  # the first request stays queued: no output yet
        first = asyncio.ensure_future(client.post("/v1/completions", json={"model": MODEL, "prompt": "Say:",
                                                                            "max_tokens": 3}))
        await wait_for(lambda: len(fh.scheduler.received) == 1)
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say:", "max_tokens": 3})
        assert r.status == 429
        body = await r.json()
        validate(body, "ErrorResponse")
        assert body["error"]["code"] == "too_many_requests" and "--max-queue-len 1" in body["error"]["message"]
        fh.scheduler.paused = False
        assert (await first).status == 200
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say:", "max_tokens": 3})
        assert r.status == 200  # the queue emptied: admitted again


async def test_past_the_open_request_limit_new_requests_get_429():
    async with front_half(max_concurrent_requests=1, step_s=0.05) as fh, TestClient(TestServer(fh.app)) as client:
        r1 = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say:", "max_tokens": 40,
                                                         "stream": True})
        assert r1.status == 200
        await r1.content.readline()  # streaming: running, not queued
        r2 = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say:", "max_tokens": 3})
        assert r2.status == 429 and "--max-concurrent-requests 1" in (await r2.json())["error"]["message"]
        await r1.read()


async def test_the_request_timeout_ends_a_request_with_an_error_and_aborts_it():
    async with front_half(request_timeout_s=0.5, step_s=0.1) as fh, TestClient(TestServer(fh.app)) as client:
        fh.scheduler.paused = True
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say:", "max_tokens": 3})
        assert r.status == 504
        body = await r.json()
        validate(body, "ErrorResponse")
        assert "--request-timeout 0.5s" in body["error"]["message"]
        await wait_for(lambda: len(fh.scheduler.aborts) == 1)  # its blocks would be freed
        # mid-stream: an error event, then the end of the stream
        fh.scheduler.paused = False
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say:", "max_tokens": 500,
                                                        "stream": True, "ignore_eos": True})
        text = (await r.read()).decode()
        assert r.status == 200 and '"error"' in text and text.rstrip().endswith("data: [DONE]")




async def test_a_restarted_tokenizer_replays_the_requests_in_flight_as_continuations():
    """A restart mid-stream (here: faked in the health monitor) sends the request again with the
    tokens it delivered as a forced prefix; the client's stream goes on with no text repeated or
    missing: a stop string spanning tokens, logprobs and their offsets included."""
    body = {"model": MODEL, "prompt": "Say:", "max_tokens": 60, "ignore_eos": True, "stop": ["over and"],
            "logprobs": 1}
    async with front_half(step_s=0.03) as fh, TestClient(TestServer(fh.app)) as client:
        solo = await (await client.post("/v1/completions", json=body)).json()
        r = await client.post("/v1/completions", json={**body, "stream": True})
        first = await r.content.readline()
        health = fh.gateway.health
        # (the next real probe sees the instance change back: a second replay, of a continuation)
        health.record("tokenizer", {"pong": True, "instance": "another"}, asyncio.get_running_loop().time())
        raw = (first + await r.read()).decode()
        assert raw.rstrip().endswith("data: [DONE]") and '"error"' not in raw
        events = [__import__("json").loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]
        text = "".join(c["text"] for e in events for c in e["choices"])
        offsets = [o for e in events for c in e["choices"] for o in (c["logprobs"] or {}).get("text_offset", [])]
        want = solo["choices"][0]
        assert text == want["text"] and want["finish_reason"] == "stop"
        assert offsets == want["logprobs"]["text_offset"]
        replayed = [m for m in fh.scheduler.received if m.req_id.endswith(".r1")]
        assert len(replayed) == 1 and replayed[0].forced_token_ids
        assert replayed[0].sampling.max_tokens == 60  # the forced tokens count against it
        assert fh.gateway.stats["num_replays"] >= 1
        await wait_for(lambda: any(a.req_id == replayed[0].req_id[:-3] for a in fh.scheduler.aborts))


async def test_past_max_replays_a_restart_fails_the_requests_in_flight():
    script = text_tokenizer().hf.encode(SCRIPT_TEXT * 20)  # long enough to be in flight
    async with front_half(script=lambda req: script, step_s=0.05, max_replays=0) as fh, \
            TestClient(TestServer(fh.app)) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say:", "max_tokens": 200,
                                                        "stream": True, "ignore_eos": True})
        await r.content.readline()
        health = fh.gateway.health
        health.record("tokenizer", {"pong": True, "instance": "another"}, asyncio.get_running_loop().time())
        text = (await r.read()).decode()
        assert "the tokenizer restarted; the request was lost" in text and text.rstrip().endswith("data: [DONE]")
        # aborted at the scheduler (a step under way may have sent a token after the abort: the
        # gateway aborts that stray once more)
        await wait_for(lambda: fh.scheduler.aborts and not fh.scheduler.requests)
        assert len({a.req_id for a in fh.scheduler.aborts}) == 1


async def test_a_crash_while_a_suspect_is_probed_is_charged_to_it_alone():
    """A poison request (the scheduler "crashes" as it arrives: ``on_lost``, as the health monitor
    calls it) beside two streams, one of whose continuations is slow to deliver (a long re-prefill):
    the poison is probed alone, replayed ``--max-replays`` times and fails; the slow stream, which
    delivers nothing between those crashes, is not charged for them and ends whole."""
    import time

    from folio.shared.messages import EngineRequest

    script = text_tokenizer().hf.encode(SCRIPT_TEXT * 20)
    async with front_half(script=lambda req: script, step_s=0.02, max_replays=3) as fh, \
            TestClient(TestServer(fh.app)) as client:
        sched, arrived = fh.scheduler, {}
        take, step = sched._take, sched._step

        def crashing_take(msg):
            if isinstance(msg, EngineRequest):
                if msg.sampling.max_tokens == 7:  # the poison
                    asyncio.get_running_loop().call_soon(fh.gateway.on_lost, "scheduler", "restarted")
                    return
                arrived[msg.req_id] = time.monotonic()
            take(msg)

        def slow_step():  # the slow stream's continuations deliver nothing for their first second
            held = {rid: r for rid, r in sched.requests.items() if r.sampling.max_tokens == 150
                    and r.forced_token_ids and time.monotonic() - arrived[rid] < 1.0}
            for rid in held:
                del sched.requests[rid]
            try:
                return step()
            finally:
                sched.requests.update(held)

        sched._take, sched._step = crashing_take, slow_step
        body = {"model": MODEL, "prompt": "Say:", "ignore_eos": True, "stream": True}
        slow = await client.post("/v1/completions", json={**body, "max_tokens": 150})
        fast = await client.post("/v1/completions", json={**body, "max_tokens": 160})
        firsts = [await slow.content.readline(), await fast.content.readline()]
        poison = await client.post("/v1/completions", json={**body, "max_tokens": 7})
        error = (await poison.json())["error"]["message"]
        assert poison.status == 503 and "replayed 3 times in a row without progress" in error, error
        assert fh.gateway.stats["num_replays_exhausted"] == 1
        for r, first, n in ((slow, firsts[0], 150), (fast, firsts[1], 160)):
            raw = (first + await r.read()).decode()
            assert '"error"' not in raw and raw.rstrip().endswith("data: [DONE]"), raw[-500:]
            events = [__import__("json").loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]
            text = "".join(c["text"] for e in events for c in e["choices"])
            assert text == text_tokenizer().hf.decode(script[:n])
        assert any(m.req_id.endswith(".r4") for m in sched.received)  # both streams went again each time
