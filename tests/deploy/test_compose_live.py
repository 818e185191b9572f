"""The compose stack on a real Docker engine: the image built by scripts/image.sh (with a registry
or without), `--profile cpu` up with only the gateway's port published, a streamed chat completion
through that port with a real client, an admin CLI through `compose exec`, each of the five service
containers crashed in turn under six streams (the restart policy brings it back and every stream
ends with its solo output; a gateway crash drops its connections, and the client resumes them with
``continue_choices`` as the router does), a prefix computed before `down` and `up` loaded from the
disk tier after, and `stop` draining. The scale-out profile (the router and two replicas) and the
disagg profile (the router, a prefill and a decode instance) come up beside the cpu one, as
projects of their own on the same image, and answer a streamed request through their published
port with the cpu profile's output. The cpu profile runs under Compose 1.29 and the other two under
a v2-line compose when both are here. Under CI=true a missing engine fails the module; elsewhere it
skips, saying why. Everything the test made is removed at the end, its image included, and what an
earlier run killed before its teardown left is removed at the start."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest

from tests.deploy.compose_stack import Stack, compose_commands, ensure_engine, in_ci, remove_image, sweep_stale

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

MODEL = "SmolLM2-135M-Instruct"
SERVICES = ["kvmanager", "executor-cpu", "scheduler", "tokenizer", "gateway"]
PROMPTS = [f"Write a short story about {t} and a bridge, in three sentences." for t in
           ("the moon", "owls", "copper", "tea", "glaciers", "maps")]
MAX_TOKENS = 40
LONG_PROMPT = " ".join(f"item {i}: river stone apple" for i in range(150)) + " Summarize the list."


@pytest.fixture(scope="module")
def stacks():
    """The three profiles up at once (after the model is prepared once), each its own project."""
    why = ensure_engine()
    if why is not None:
        if in_ci():
            pytest.fail(f"CI=true and no Docker engine: {why}")
        pytest.skip(why)
    swept = sweep_stale()
    found = compose_commands()
    cpu = Stack("cpu", compose_cmd=found.get("v1") or found["v2"])
    others = [Stack(profile, project=f"{cpu.project}{suffix}", compose_cmd=found.get("v2") or found["v1"])
              for profile, suffix in (("scale-out", "so"), ("disagg", "dg"))]
    every = [cpu, *others]
    t0 = time.monotonic()
    try:
        cpu.build()
        cpu.prepare()
        t_up = time.monotonic()
        with ThreadPoolExecutor(len(every)) as pool:
            list(pool.map(lambda s: s.up(), every))
        cpu.timings["all_up_s"] = time.monotonic() - t_up
        yield {s.profile: s for s in every}
    finally:
        for s in every:
            s.down()
        remove_image(cpu.tag)
        cpu.timings["total_s"] = time.monotonic() - t0
    timings = {s.profile: {k: round(v, 1) for k, v in s.timings.items()} for s in every}
    print(f"\ncompose stack timings: {json.dumps(timings)}; compose: "
          f"{ {s.profile: s.compose_version for s in every} }; stale projects removed first: {swept}")


@pytest.fixture(scope="module")
def stack(stacks):
    return stacks["cpu"]


def body(prompt: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "return_token_ids": True, **extra}


async def stream_once(http: aiohttp.ClientSession, base: str, req: dict, got: dict, first: asyncio.Event) -> bool:
    """One streamed request; appends to got["text"]/got["ids"]; True at [DONE], False when the
    connection broke (or was refused) first."""
    try:
        async with http.post(f"{base}/v1/chat/completions", json=req) as r:
            if r.status != 200:
                got.setdefault("errors", []).append(f"{r.status}: {await r.text()}")
                return False
            async for raw in r.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    return True
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                for c in event["choices"]:
                    got["text"] += c["delta"].get("content") or ""
                    got["ids"] += c.get("token_ids") or []
                    if len(got["ids"]) >= 2:
                        first.set()
    except (aiohttp.ClientError, ConnectionError) as exc:
        got.setdefault("errors", []).append(repr(exc))
    return False


async def resumable(http: aiohttp.ClientSession, base: str, prompt: str, first: asyncio.Event,
                    deadline_s: float = 300) -> dict:
    """A stream that, when its connection breaks, asks again for what follows the tokens it has."""
    got = {"text": "", "ids": [], "resumes": 0}
    t_end = time.monotonic() + deadline_s
    req = body(prompt)
    while not await stream_once(http, base, req, got, first):
        assert time.monotonic() < t_end, f"stream not finished in {deadline_s} s: {got}"
        got["resumes"] += 1
        # nothing yet (refused, 503): ask again; else only for what follows the tokens it has
        req = body(prompt, continue_choices=[{"index": 0, "token_ids": list(got["ids"])}]) if got["ids"] else body(prompt)
        await asyncio.sleep(1)
    return got


async def run_streams(base: str, prompts: list[str], on_first=None) -> list[dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=400)) as http:
        events = [asyncio.Event() for _ in prompts]
        tasks = [asyncio.create_task(resumable(http, base, p, e)) for p, e in zip(prompts, events)]
        if on_first is not None:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 300)
            await asyncio.to_thread(on_first)
        return await asyncio.gather(*tasks)


def test_a_streamed_chat_completion_through_the_only_published_port(stack):
    (got,) = asyncio.run(run_streams(stack.base, [PROMPTS[0]]))
    assert got["text"] and len(got["ids"]) == MAX_TOKENS and got["resumes"] == 0, got
    published = {svc: stack.inspect(svc)["NetworkSettings"]["Ports"] for svc in SERVICES}
    bound = {svc: [p for p, b in ports.items() if b] for svc, ports in published.items()}
    assert bound == {**{svc: [] for svc in SERVICES}, "gateway": ["8000/tcp"]}, bound
    # each service's admin CLI, inside its container
    stats = stack.exec("kvmanager", "folio", "kv", "stats").stdout
    assert "registered" in stats and "True" in stats.split("registered", 1)[1].splitlines()[0], stats
    for service, cli in (("scheduler", "scheduler"), ("executor-cpu", "executor"), ("tokenizer", "tokenizer"),
                         ("gateway", "gateway")):
        assert stack.exec(service, "folio", cli, "stats").stdout.strip(), service


def test_the_scale_out_and_disagg_profiles_answer_through_their_published_port(stacks):
    (solo,) = asyncio.run(run_streams(stacks["cpu"].base, [PROMPTS[1]]))
    for profile in ("scale-out", "disagg"):
        s = stacks[profile]
        (got,) = asyncio.run(run_streams(s.base, [PROMPTS[1]]))
        # greedy, batch-invariant: a whole `folio serve` behind the router, and a prefill instance
        # handing the prompt's KV to a decode instance, say what the five containers say
        assert got["text"] == solo["text"] and got["resumes"] == 0, (profile, got, solo)
        router = "router" if profile == "scale-out" else "disagg-router"
        bound = {c: [p for p, b in s.inspect(c)["NetworkSettings"]["Ports"].items() if b]
                 for c in ((router, "replica-a", "replica-b") if profile == "scale-out" else (router, "prefill", "decode"))}
        assert bound == {c: (["8080/tcp"] if c == router else []) for c in bound}, (profile, bound)
        stats = dict(line.split(None, 1) for line in s.exec(router, "folio", "router", "stats").stdout.splitlines()
                     if len(line.split(None, 1)) == 2)
        assert stats["num_replicas_up"].strip() == "2", (profile, stats)
        if profile == "disagg":  # two legs, the KV pulled over tcp between the containers, not recomputed
            assert stats["num_disagg_requests"].strip() == "1" and stats["num_colocated_fallbacks"].strip() == "0", stats
            pulls = s.exec("decode", "env", "FOLIO_ENDPOINTS=ipc", "folio", "executor", "stats").stdout
            pulled = pulls.split("kv_pulls:", 1)[1].split("pulled", 1)[1].split()[0]
            recomputed = pulls.split("kv_recomputed", 1)[1].split()[0]
            assert (pulled, recomputed) == ("1", "0"), pulls
        s.down()  # the cpu profile's tests below run alone


def test_each_container_crashed_under_six_streams_ends_every_stream_with_its_solo_output(stack):
    solo = [asyncio.run(run_streams(stack.base, [p]))[0]["ids"] for p in PROMPTS]
    report = {}
    for service in SERVICES:
        before = {}

        def crash(service=service):
            before["restarts"] = stack.crash(service)

        t0 = time.monotonic()
        outs = asyncio.run(run_streams(stack.base, PROMPTS, on_first=crash))
        stack.wait_healthy(service, 300, restarts_at_least=before["restarts"] + 1)
        stack.wait_healthy("gateway", 300)
        report[service] = (sum(o["ids"] == s for o, s in zip(outs, solo)), round(time.monotonic() - t0, 1))
        for i, (o, s) in enumerate(zip(outs, solo)):
            assert o["ids"] == s, f"{service} crash: stream {i} differs from solo ({o}, solo {s})"
    print(f"\nstreams equal to solo after each crash (of 6, seconds): {report}")


def ttft(base: str, prompt: str) -> tuple[float, dict]:
    """Seconds to the first content token of a streamed request, and its usage."""
    async def go():
        async with aiohttp.ClientSession() as http:
            t0, first, usage = time.monotonic(), None, {}
            req = {**body(prompt, max_tokens=2), "stream_options": {"include_usage": True}}
            async with http.post(f"{base}/v1/chat/completions", json=req) as r:
                assert r.status == 200, await r.text()
                async for raw in r.content:
                    if raw.startswith(b"data: {"):
                        event = json.loads(raw[6:])
                        if first is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                            first = time.monotonic() - t0
                        usage = event.get("usage") or usage
            return first, usage
    return asyncio.run(go())


def test_a_prefix_computed_before_down_and_up_is_a_disk_tier_hit(stack):
    cold, usage = ttft(stack.base, LONG_PROMPT)
    assert usage["prompt_tokens"] > 500, usage
    stack.compose("down", "-t", "20")  # volumes kept: the models and the disk tier
    t0 = time.monotonic()
    stack.up()
    stack.timings["up_again_s"] = time.monotonic() - t0
    ttft(stack.base, "Say hi.")  # a first request, so the figure below is the prefix's alone
    warm, usage = ttft(stack.base, LONG_PROMPT)
    stats = stack.exec("kvmanager", "folio", "kv", "stats").stdout
    disk_hits = int(next(line.split()[1] for line in stats.splitlines() if line.startswith("num_disk_hit_blocks")))
    stack.timings.update(ttft_cold_s=cold, ttft_after_down_up_s=warm)
    print(f"\nTTFT of a {usage['prompt_tokens']}-token prompt: cold {cold:.2f} s, after down and up "
          f"{warm:.2f} s ({warm / cold:.2f}x), disk-tier hit blocks {disk_hits}")
    assert disk_hits >= usage["prompt_tokens"] // 16 - 1, stats
    assert warm <= 0.5 * cold, (cold, warm)


def test_stop_drains_streams_in_flight_and_refuses_new_requests(stack):
    async def go():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as keepalive, \
                aiohttp.ClientSession() as http:
            async with keepalive.get(f"{stack.base}/v1/models") as r:  # read whole: the connection stays open
                assert r.status == 200 and await r.read()
            events = [asyncio.Event() for _ in PROMPTS[:3]]
            tasks = [asyncio.create_task(stream_once(http, stack.base, body(p), {"text": "", "ids": []}, e))
                     for p, e in zip(PROMPTS[:3], events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 300)
            gateway = stack.container("gateway")
            stopper = threading.Thread(target=stack.compose, args=("stop",))  # each service's own grace
            t0, since = time.monotonic(), time.time() - 1
            stopper.start()
            # the stop has reached the gateway (on a busy machine the compose client takes seconds to send it)
            assert await asyncio.to_thread(stack.wait_log, gateway, '"event": "draining"', 60, since), stack.logs()
            try:  # on the open connection: 503; a new one finds the port closed
                async with keepalive.post(f"{stack.base}/v1/chat/completions", json=body("Hi")) as r:
                    refused = r.status
            except aiohttp.ClientConnectorError:
                refused = "connection refused"
            done = await asyncio.gather(*tasks)
            await asyncio.to_thread(stopper.join)
            return refused, done, time.monotonic() - t0
    refused, done, stop_s = asyncio.run(go())
    print(f"\nstop: streams finished {sum(done)}/3, new request {refused}, stopped in {stop_s:.1f} s")
    assert refused in (503, "connection refused") and all(done) and stop_s < 90
