"""Fault injection on a real ``folio serve``: under 64 concurrent streams (greedy, seeded
sampling, n=2, beam search, chat) each service in turn is killed with SIGKILL, or stopped with
SIGSTOP past the deadlines and resumed.

Checked each time: no client waits past its deadline; every request completes with exactly its
solo output (a scheduler or tokenizer crash replays the requests in flight, ``test_replay.py``
has the finer cases), or ends with the clear error README documents for that service (a gateway
crash drops its connections); afterwards the pool holds no block, nothing runs, and new requests
succeed. The server runs a tiny random model, so that all of it takes about two minutes.
"""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest

from folio.testing.faults import Outcome, Served, solo, start_serve, stream, workload_specs

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]  # a served stack under 16-64 streams, a minute or more

NUM_STREAMS = 64
MAX_TOKENS = 16
CLIENT_DEADLINE_S = 75.0  # above --request-timeout: the server's deadline must come first
REQUEST_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm_tokenizer_dir):
    from folio.testing.models import write_tiny_chat_model

    model = write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), smollm_tokenizer_dir)
    # batch-invariant: 64 concurrent streams, replayed or recomputed after a fault, must equal their solo outputs
    srv = start_serve(model, "--num-kv-blocks", "1024", "--max-num-seqs", "96", "--max-num-batched-tokens", "512",
                      "--request-timeout", str(REQUEST_TIMEOUT_S), "--max-restarts", "20", "--batch-invariant")
    yield srv
    assert srv.stop() == 0, srv.stderr()[-3000:]


@pytest.fixture(scope="module")
def solo_outputs(served):
    """Each distinct request alone, before any fault."""

    async def run():
        async with aiohttp.ClientSession() as http:
            return [await solo(http, served.base, route, body) for route, body in workload_specs(MAX_TOKENS)]

    return asyncio.run(run())


async def run_under_fault(served: Served, inject, min_started: int = 16) -> list[tuple[int, Outcome]]:
    """64 streams (each distinct request 4 times); ``inject()`` once ``min_started`` streams have
    output; every outcome with the index of its request."""
    specs = workload_specs(MAX_TOKENS)
    await asyncio.get_running_loop().run_in_executor(None, served.wait_healthy)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        events = [asyncio.Event() for _ in range(NUM_STREAMS)]
        tasks = [asyncio.ensure_future(stream(http, served.base, *specs[i % len(specs)], CLIENT_DEADLINE_S, events[i]))
                 for i in range(NUM_STREAMS)]
        deadline = time.monotonic() + 30
        while sum(e.is_set() for e in events) < min_started and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not all(t.done() for t in tasks), "the streams finished before the fault"
        await asyncio.get_running_loop().run_in_executor(None, inject)
        outcomes = await asyncio.gather(*tasks)
    return [(i % len(specs), o) for i, o in enumerate(outcomes)]


def check_outcomes(results, solo_outputs, allowed: set[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for spec, out in results:
        counts[out.kind] = counts.get(out.kind, 0) + 1
        assert out.kind != "timeout", f"a client waited past its deadline ({out.elapsed_s:.1f}s)"
        assert out.kind in allowed, f"{out.kind}: {out.error} (status {out.status})"
        assert out.elapsed_s < CLIENT_DEADLINE_S
        if out.kind == "ok":
            assert out.texts == solo_outputs[spec], f"request {spec} differs from its solo output"
        if out.kind == "error":
            assert out.status in (200, 503) and out.error, out
    return counts


async def check_recovered(served: Served, solo_outputs) -> None:
    served.wait_healthy()
    kv = await asyncio.get_running_loop().run_in_executor(None, served.wait_idle)
    assert kv["num_blocks_used"] == 0
    async with aiohttp.ClientSession() as http:  # new requests succeed, with their solo output
        for spec in (0, 8, 11, 13, 15):
            route, body = workload_specs(MAX_TOKENS)[spec]
            assert await solo(http, served.base, route, body) == solo_outputs[spec]


def kill(served: Served, name: str):
    return lambda: served.child(name).send_signal(signal.SIGKILL)


async def test_executor_crash_loses_nothing(served, solo_outputs):
    results = await run_under_fault(served, kill(served, "executor"))
    counts = check_outcomes(results, solo_outputs, {"ok"})
    assert counts == {"ok": NUM_STREAMS}
    assert served.admin("scheduler", "stats")["num_executor_restarts"] >= 1
    await check_recovered(served, solo_outputs)


async def test_kvmanager_crash_loses_nothing(served, solo_outputs):
    results = await run_under_fault(served, kill(served, "kvmanager"))
    counts = check_outcomes(results, solo_outputs, {"ok"})
    assert counts == {"ok": NUM_STREAMS}
    await check_recovered(served, solo_outputs)


@pytest.mark.parametrize("name", ["scheduler", "tokenizer"])
async def test_a_stateful_service_crash_loses_no_request(served, solo_outputs, name):
    replays = served.admin("gateway", "stats")["num_replays"]
    results = await run_under_fault(served, kill(served, name))
    assert check_outcomes(results, solo_outputs, {"ok"}) == {"ok": NUM_STREAMS}  # replayed, not lost
    assert served.admin("gateway", "stats")["num_replays"] > replays
    await check_recovered(served, solo_outputs)


async def test_gateway_crash_drops_its_connections_and_frees_their_work(served, solo_outputs):
    results = await run_under_fault(served, kill(served, "gateway"))
    counts = check_outcomes(results, solo_outputs, {"ok", "dropped"})
    assert counts.get("dropped", 0) > 0, counts
    await check_recovered(served, solo_outputs)


async def test_gateway_sigterm_drains_its_streams(served, solo_outputs):
    """Open streams finish (or, past the 8 s drain deadline, end with an error event: never a cut
    connection), and the gateway exits by itself within the supervisor's stop deadline."""
    gateway = served.child("gateway")
    results = await run_under_fault(served, lambda: gateway.send_signal(signal.SIGTERM))
    check_outcomes(results, solo_outputs, {"ok", "error"})  # on a busy machine the deadline may pass
    for _, out in results:
        if out.kind == "error":
            assert "shutting down" in out.error
    gateway.wait(timeout=10)  # exited on its own within the supervisor's stop deadline ...
    deadline = time.monotonic() + 5  # ... cleanly, as the supervisor says once it has reaped it
    while "the gateway service exited with code 0; restarting it" not in served.stderr():
        assert time.monotonic() < deadline, served.stderr()[-2000:]
        await asyncio.sleep(0.1)
    await check_recovered(served, solo_outputs)


def pause(served: Served, name: str, seconds: float, during=None):
    def inject():
        proc = served.child(name)
        proc.send_signal(signal.SIGSTOP)
        try:
            t_end = time.monotonic() + seconds
            if during is not None:
                during()
            time.sleep(max(0.0, t_end - time.monotonic()))
        finally:
            proc.send_signal(signal.SIGCONT)
    return inject


def new_request_is_refused_quickly(served: Served):
    """While a service hangs: /health names it and a new request gets 503 within two seconds."""
    import json
    import urllib.error
    import urllib.request

    time.sleep(2.0)  # past the 1.5 s after which a silent service counts as down
    status, body = served.health()
    assert status == 503 and body["down"], body
    t0 = time.monotonic()
    request = urllib.request.Request(served.base + "/v1/completions", data=json.dumps(
        {"prompt": "x", "max_tokens": 2}).encode(), headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=5)
        raise AssertionError("a request was accepted while a service hangs")
    except urllib.error.HTTPError as exc:
        assert exc.code == 503 and json.load(exc)["error"]["code"] == "service_unavailable"
    assert time.monotonic() - t0 < 2.0


async def test_a_hung_executor_delays_requests_but_loses_none(served, solo_outputs):
    inject = pause(served, "executor", 5.0, during=lambda: new_request_is_refused_quickly(served))
    results = await run_under_fault(served, inject)
    assert check_outcomes(results, solo_outputs, {"ok"}) == {"ok": NUM_STREAMS}
    await check_recovered(served, solo_outputs)


async def test_a_hung_scheduler_delays_its_streams_but_loses_none(served, solo_outputs):
    """Silent past the 5 s stall mark, then back: the same instance still holds its requests."""
    results = await run_under_fault(served, pause(served, "scheduler", 8.0))
    assert check_outcomes(results, solo_outputs, {"ok"}) == {"ok": NUM_STREAMS}
    await check_recovered(served, solo_outputs)
