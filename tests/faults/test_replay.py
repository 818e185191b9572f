"""Replay after a scheduler or tokenizer crash, on a real ``folio serve`` (tiny random model, fp32):
SIGKILL under 16 mixed streams (greedy, seeded sampling, n=2, a stop string, logprobs, echo, a
JSON-schema chat, a plain chat); every stream ends with exactly its solo output (its text and its
logprob tokens; no token repeated or missing), and the stack keeps serving. A poison request that
crashes the scheduler on arrival is replayed ``--max-replays`` times, then ends with the error,
while the streams beside it finish with their solo output.

One server for the module; the poison hook is the scheduler's test-only
``$FOLIO_TESTING_CRASH_ON_PROMPT``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from folio.testing.faults import start_serve

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]  # a served stack under 16-64 streams, a minute or more

MAX_TOKENS = 40
MAX_REPLAYS = 3
POISON = [49000, 48999, 48998]
PROMPTS = ["The river", "Once upon a time", "In the beginning", "A list of colors:", "Dear friend,",
           "The answer is", "Here is a poem", "Numbers: 1, 2,"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def specs(stop: str) -> list[tuple[str, dict]]:
    """16 distinct streams."""
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    out = [("completions", {"prompt": p, **greedy}) for p in PROMPTS[:5]]
    out += [("completions", {"prompt": PROMPTS[5 + i], "max_tokens": MAX_TOKENS, "temperature": 0.9, "top_p": 0.9,
                             "seed": 100 + i, "ignore_eos": True}) for i in range(3)]
    # (a top-k or top-p cut: until the kernels are batch-invariant, a draw over the whole vocabulary
    # of a random model can flip at a borderline sample between the decode and the replay's prefill)
    out += [("completions", {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 1.0, "top_k": 40,
                             "n": 2, "seed": 7 + i, "ignore_eos": True}) for i in range(2)]
    out.append(("completions", {"prompt": PROMPTS[0], **greedy, "stop": [stop]}))
    out.append(("completions", {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 1.0, "top_k": 40,
                                "seed": 3, "logprobs": 2, "ignore_eos": True}))
    out.append(("completions", {"prompt": PROMPTS[2], **greedy, "echo": True}))
    out.append(("chat/completions", {"messages": [{"role": "user", "content": "Who are you?"}], **greedy,
                                     "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "person", "schema": SCHEMA}}}))
    out.append(("chat/completions", {"messages": [{"role": "user", "content": "Name three rivers."}], **greedy}))
    out.append(("completions", {"prompt": PROMPTS[3], "max_tokens": MAX_TOKENS, "temperature": 0.7, "top_p": 0.9,
                                "seed": 11, "frequency_penalty": 0.5, "ignore_eos": True}))
    assert len(out) == 16
    return out


async def read_stream(http, base: str, route: str, body: dict, started: asyncio.Event | None = None) -> dict:
    """{choice index: (text, logprob tokens)}, plus "error" when an error event or status came."""
    result: dict = {}
    async with http.post(f"{base}/v1/{route}", json={**body, "stream": True}) as r:
        if r.status != 200:
            return {"error": (await r.json())["error"]["message"], "status": r.status}
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                result["error"] = event["error"]["message"]
                continue
            for c in event["choices"]:
                text, lps = result.get(c["index"], ("", []))
                if route == "completions":
                    text += c.get("text") or ""
                    lps = lps + list((c.get("logprobs") or {}).get("tokens") or [])
                else:
                    text += (c.get("delta") or {}).get("content") or ""
                result[c["index"]] = (text, lps)
                if started is not None and text:
                    started.set()
    return result


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm_tokenizer_dir):
    from folio.testing.models import write_tiny_chat_model

    model = write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), smollm_tokenizer_dir)
    os.environ["FOLIO_TESTING_CRASH_ON_PROMPT"] = ",".join(map(str, POISON))
    try:
        # batch-invariant: replayed streams, prefilled again beside others, must equal their solo outputs
        srv = start_serve(model, "--quantization", "none", "--num-kv-blocks", "512", "--max-num-seqs", "64",
                          "--max-restarts", "20", "--max-replays", str(MAX_REPLAYS), "--request-timeout", "90",
                          "--batch-invariant")
    finally:
        del os.environ["FOLIO_TESTING_CRASH_ON_PROMPT"]
    yield srv
    assert srv.stop() == 0, srv.stderr()[-3000:]


@pytest.fixture(scope="module")
def workload(served):
    """The 16 streams and each one's output alone, before any fault."""

    async def run():
        async with aiohttp.ClientSession() as http:
            plain = await read_stream(http, served.base, "completions", {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                                                         "temperature": 0, "ignore_eos": True})
            text = plain[0][0]
            stop = text[len(text) // 2: len(text) // 2 + 3]  # met halfway through: it ends that stream early
            work = specs(stop)
            return work, [await solo(http, route, body) for route, body in work]

    async def solo(http, route, body):
        for _ in range(10):  # a loaded machine may miss a ping: 503 "not answering" for a moment
            out = await read_stream(http, served.base, route, body)
            if out.get("status") != 503:
                return out
            await asyncio.sleep(1.0)
        return out

    return asyncio.run(run())


async def under_fault(served, work, inject, extra=None) -> list[dict]:
    await asyncio.get_running_loop().run_in_executor(None, served.wait_healthy)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        events = [asyncio.Event() for _ in work]
        tasks = [asyncio.ensure_future(read_stream(http, served.base, route, body, events[i]))
                 for i, (route, body) in enumerate(work)]
        deadline = time.monotonic() + 30
        while sum(e.is_set() for e in events) < 12 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        assert not all(t.done() for t in tasks), "the streams finished before the fault"
        extra_result = None
        if extra is not None:
            extra_result = await extra(http)
        else:
            inject()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return results, extra_result


def check_same(results, solos) -> None:
    for i, (got, want) in enumerate(zip(results, solos)):
        assert "error" not in got, (i, got)
        assert got == want, f"stream {i} differs from its solo output:\n{got}\n{want}"


async def check_serving(served, work, solos) -> None:
    await asyncio.get_running_loop().run_in_executor(None, served.wait_healthy)
    await asyncio.get_running_loop().run_in_executor(None, served.wait_idle)
    async with aiohttp.ClientSession() as http:
        for i in (0, 8, 14):
            assert await read_stream(http, served.base, *work[i]) == solos[i]


def deaths(served, name: str) -> int:
    return served.stderr().count(f"the {name} service was killed") + served.stderr().count(
        f"the {name} service exited with code")


@pytest.mark.parametrize("name", ["scheduler", "tokenizer"])
async def test_a_crash_of_a_stateful_service_loses_no_stream(served, workload, name):
    work, solos = workload
    before = served.admin("gateway", "stats")["num_replays"]
    results, _ = await under_fault(served, work, lambda: served.child(name).send_signal(signal.SIGKILL))
    check_same(results, solos)
    assert served.admin("gateway", "stats")["num_replays"] > before  # streams were in flight, and replayed
    await check_serving(served, work, solos)


async def test_a_poison_request_is_replayed_at_most_max_replays_times_and_the_others_survive(served, workload):
    work, solos = workload
    before = deaths(served, "scheduler")
    exhausted = served.admin("gateway", "stats")["num_replays_exhausted"]

    async def poison(http):
        t0 = time.monotonic()
        async with http.post(f"{served.base}/v1/completions", json={
                "prompt": POISON + [5, 6], "max_tokens": 8, "stream": True}) as r:
            body = await r.json()
        return r.status, body, time.monotonic() - t0

    results, (status, body, _) = await under_fault(served, work, None, extra=poison)
    assert status == 503 and "the scheduler restarted; the request was lost" in body["error"]["message"], body
    assert f"replayed {MAX_REPLAYS} times" in body["error"]["message"]
    check_same(results, solos)
    assert deaths(served, "scheduler") - before == MAX_REPLAYS + 1  # the first arrival, then each replay
    assert served.admin("gateway", "stats")["num_replays_exhausted"] == exhausted + 1
    await check_serving(served, work, solos)
