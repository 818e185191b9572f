"""A replica dies mid-stream behind ``folio run router``: two real ``folio serve`` replicas (tiny
random model, fp32), 6 mixed streams (greedy, seeded, n=2, a stop string, logprobs, chat) through
the router; the whole replica serving them is SIGKILLed. Every stream goes on from the other
replica and ends with exactly its solo output: no duplicated or missing token in the SSE, one
``id`` throughout, one ``[DONE]``."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import aiohttp
import pytest

from folio.testing.routerstack import ReplicaProcess, start_router

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]  # a served stack under 16-64 streams, a minute or more

# batch-invariant: a stream resumed on the other replica, its text prefilled there, must equal its solo output
FLAGS = ("--served-model-name", "m", "--dtype", "float32", "--quantization", "none", "--block-size", "8",
         "--num-kv-blocks", "256", "--max-num-seqs", "16", "--log-level", "warning", "--batch-invariant")
MAX_TOKENS = 48


def specs(stop: str) -> list[tuple[str, dict]]:
    base = {"model": "m", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    return [
        ("completions", {**base, "prompt": "The river", "temperature": 0}),
        ("completions", {**base, "prompt": "Once upon a time", "temperature": 0.9, "top_k": 40, "seed": 4}),
        ("completions", {**base, "prompt": "In the beginning", "temperature": 1.0, "top_k": 40, "seed": 8, "n": 2}),
        ("completions", {**base, "prompt": "The river", "temperature": 0, "stop": [stop]}),
        ("completions", {**base, "prompt": "Dear friend,", "temperature": 1.0, "top_k": 40, "seed": 2, "logprobs": 2}),
        ("chat/completions", {**base, "messages": [{"role": "user", "content": "Name three rivers."}],
                              "temperature": 0}),
    ]


async def read(http, url: str, route: str, body: dict, started: asyncio.Event | None = None):
    """(the replica that began it, {index: (text, logprob tokens)}, chunk ids, number of [DONE])."""
    out: dict = {}
    ids, num_done = set(), 0
    async with http.post(f"{url}/v1/{route}", json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        replica = r.headers.get("X-Folio-Replica")
        async for raw in r.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                num_done += 1
                continue
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            ids.add(event["id"])
            for c in event["choices"]:
                assert "token_ids" not in c  # the router asked for them, the client did not
                text, lps = out.get(c["index"], ("", []))
                if route == "completions":
                    text += c.get("text") or ""
                    lps = lps + list((c.get("logprobs") or {}).get("tokens") or [])
                else:
                    text += (c.get("delta") or {}).get("content") or ""
                out[c["index"]] = (text, lps)
                if started is not None and text:
                    started.set()
    return replica, out, ids, num_done


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm_tokenizer_dir):
    from folio.testing.models import write_tiny_chat_model

    model = write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-resume"), smollm_tokenizer_dir)
    a, b = ReplicaProcess(model, FLAGS).start(), ReplicaProcess(model, FLAGS).start()
    router = None
    try:
        a.wait_ready(), b.wait_ready()
        router = start_router(model, [a, b], "--policy", "least_loaded")
        yield a, b, router
    finally:
        if router is not None:
            router.stop()
        for r in (a, b):
            if r.proc.poll() is None:
                r.proc.terminate()
        a.cleanup(), b.cleanup()


async def test_a_replica_killed_mid_stream_loses_no_token(stack):
    a, b, router = stack
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        _, plain, _, _ = await read(http, router.url, *specs("x")[0])
        text = plain[0][0]
        work = specs(text[len(text) // 2: len(text) // 2 + 3])
        solos = [(await read(http, router.url, route, body))[1] for route, body in work]
        events = [asyncio.Event() for _ in work]
        tasks = [asyncio.ensure_future(read(http, router.url, route, body, events[i]))
                 for i, (route, body) in enumerate(work)]
        deadline = time.monotonic() + 60
        while not all(e.is_set() for e in events) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        assert not all(t.done() for t in tasks), "the streams finished before the fault"
        # the replica serving most of them (the router balances: the header says which)
        served_by = Counter()
        for replica in (a, b):
            served_by[replica.url] = replica.admin("gateway", "stats")["num_open"]
        victim = a if served_by[a.url] >= served_by[b.url] else b
        victim.kill()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    for i, ((replica, got, ids, num_done), want) in enumerate(zip(results, solos)):
        assert got == want, f"stream {i} differs from its solo output:\n{got}\n{want}"
        assert len(ids) == 1 and num_done == 1, (i, ids, num_done)
    assert router.admin("stats")["num_resumed_streams"] >= served_by[victim.url] > 0
