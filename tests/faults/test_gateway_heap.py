"""The gateway and tokenizer keep no memory per finished request: after a warm-up, a second round
of requests leaves their Python heap where the first round left it.

The soak benchmark watches the gateway's resident memory over ten minutes, where the allocator's
own bookkeeping and aiohttp's bounded caches blur a slow leak. Here ``tracemalloc`` counts only
what is still allocated from a frame in ``services/`` or ``shared/`` (the real tokenizer and
gateway; the scheduler is scripted), so a dict entry left behind per request shows as hundreds of
bytes times the number of requests.
"""

from __future__ import annotations

import asyncio
import gc
import os
import tracemalloc

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from tests.services.frontend import front_half

pytestmark = pytest.mark.asyncio

MODEL = "SmolLM2-135M-Instruct"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OURS = [tracemalloc.Filter(True, os.path.join(ROOT, d, "*")) for d in ("services", "shared")]


def bodies(n: int) -> list[tuple[str, dict]]:
    """A mix of the request kinds: completions and chat, streamed or not, n=2, logprobs, a stop."""
    out = []
    for i in range(n):
        if i % 4 == 0:
            out.append(("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": f"Hi {i}"}],
                                                 "max_tokens": 4, "stream": i % 8 == 0}))
        else:
            out.append(("/v1/completions", {"model": MODEL, "prompt": f"Say {i}:", "max_tokens": 4,
                                            "stream": i % 2 == 0, "n": 1 + i % 3 // 2,
                                            "logprobs": 2 if i % 5 == 0 else None, "stop": ["zz"]}))
    return out


async def round_of(session: aiohttp.ClientSession, base: str, n: int, fh) -> None:
    async def one(route: str, body: dict) -> None:
        async with session.post(base + route, json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()

    for k in range(0, n, 25):  # 25 at a time: requests overlap, as they do when served
        await asyncio.gather(*(one(route, body) for route, body in bodies(n)[k:k + 25]))
    fh.scheduler.received.clear()  # the scripted scheduler's own record of what it was sent


async def heap(n: int, session, base, fh) -> int:
    await round_of(session, base, n, fh)
    await asyncio.sleep(0.05)  # the last finished requests' bookkeeping runs
    gc.collect()
    return sum(s.size for s in tracemalloc.take_snapshot().filter_traces(OURS).statistics("filename"))


async def test_a_second_round_of_requests_leaves_the_heap_where_the_first_left_it():
    async with front_half(step_s=0.001) as fh, TestServer(fh.app) as server, aiohttp.ClientSession() as session:
        base = str(server.make_url(""))
        await round_of(session, base, 50, fh)  # warm-up: first-use caches fill before counting
        tracemalloc.start(1)  # the innermost frame: allocations made by our code itself
        try:
            first = await heap(200, session, base, fh)
            second = await heap(200, session, base, fh)
        finally:
            tracemalloc.stop()
        assert not fh.gateway.mailboxes and not fh.gateway.queued and fh.gateway.num_open == 0
        # a leak of even 40 bytes a request would add 8 KB over the second round's 200 requests
        assert second - first < 8192, f"heap grew by {second - first} bytes over 200 requests"
