"""Many models behind one router. In process, against small HTTP replicas answering ``/v1/models``
and ``/metrics`` as folio's gateway does (base models, adapters with a ``parent``, the adapters
running): each model goes only where it is served, an adapter prefers the replica running it,
lists that change at run time are seen, unknown models get OpenAI's 404, ``/v1/models`` is the
union. Then two real ``folio serve`` replicas of different tiny models (model-a, model-b) behind
``folio run router``: each model's requests reach only its replica (the replicas' own counters
say so), ``/v1/models`` lists both, an unknown model is a 404 and the router keeps serving."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.request
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from folio.services.router.replicas import Replica, read_active_adapters, read_models
from folio.shared.config import Endpoints, RouterConfig
from folio.services.in_process import short_run_dir
from folio.testing.peft_adapters import write_peft_adapter
from folio.testing.models import write_tiny_chat_model, write_tiny_model
from folio.testing.routerstack import ReplicaProcess as ServedReplica
from folio.testing.routerstack import http_json, post, start_router


def lora_info(running: str, waiting: str = "", at: float = 1.0) -> str:
    return (f'folio:lora_requests_info{{max_lora="4",running_lora_adapters="{running}",'
            f'waiting_lora_adapters="{waiting}"}} {at}\n')


def test_model_lists_and_running_adapters_are_read_as_the_gateway_writes_them():
    models = read_models({"object": "list", "data": [
        {"id": "base", "object": "model", "root": "/models/base"},
        {"id": "sql", "object": "model", "root": "/adapters/sql", "parent": "base"},
        {"id": "sql", "parent": "other"}, {"no_id": 1}, "junk"]})
    assert [(m.id, m.parent, m.root) for m in models.values()] == [
        ("base", None, "/models/base"), ("sql", "base", "/adapters/sql")]
    with pytest.raises(ValueError):
        read_models({"error": {"message": "Incorrect API key provided."}})
    text = ("# TYPE folio:lora_requests_info gauge\n" + lora_info("sql", "", 10.0) + lora_info("a,b", "c", 20.0)
            + "folio:num_requests_running 2\n")
    assert read_active_adapters(text) == {"a", "b", "c"}  # the latest state, not every state it was in
    assert read_active_adapters("folio:num_requests_running 2\n") == frozenset()


class FakeReplica:
    """An HTTP server with a gateway's model list, load and running adapters, answering completions
    with its own name: what the router reads of a replica, nothing more."""

    def __init__(self, models: list[dict], running_adapters: str = ""):
        self.models = models
        self.running_adapters = running_adapters
        self.num_running = 0
        self.seen: list[str | None] = []  # the model of each completion it answered
        self.server = None

    async def start(self) -> "FakeReplica":
        from aiohttp import web
        from aiohttp.test_utils import TestServer

        async def models(request):
            return web.json_response({"object": "list", "data": self.models})

        async def metrics(request):
            return web.Response(text=f"folio:num_requests_running {self.num_running}\n"
                                     + lora_info(self.running_adapters))

        async def completions(request):
            self.seen.append((await request.json()).get("model"))
            return web.json_response({"object": "text_completion", "choices": []})

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/completions", completions)
        self.server = TestServer(app)
        await self.server.start_server()
        return self

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


@pytest.mark.asyncio
async def test_requests_go_only_to_replicas_serving_their_model_and_adapters_to_where_they_run():
    from aiohttp.test_utils import TestClient, TestServer

    from folio.services.router.service import RouterService

    base_x = {"id": "base-x", "object": "model", "root": "/models/x"}
    r1 = await FakeReplica([base_x, {"id": "sql", "root": "/a/sql", "parent": "base-x"}]).start()
    r2 = await FakeReplica([base_x, {"id": "sql", "root": "/a/sql", "parent": "base-x"},
                            {"id": "chat", "root": "/a/chat", "parent": "base-x"}], running_adapters="sql").start()
    r3 = await FakeReplica([{"id": "base-y", "object": "model", "root": "/models/y"}]).start()
    fakes = [r1, r2, r3]
    run_dir = short_run_dir()
    ctx = zmq.asyncio.Context()
    service = RouterService(RouterConfig(endpoints=Endpoints.ipc(run_dir), poll_interval_s=0.0), None, ctx)
    client = TestClient(TestServer(service.app()))
    await client.start_server()
    service.session = service.replicas.session = client.session
    replicas = {}
    for fake in fakes:
        replicas[fake] = Replica(name=fake.url, kv_events="tcp://127.0.0.1:9", kv_snapshot="tcp://127.0.0.1:9")
        service.replicas.add(replicas[fake])

    async def poll():
        await asyncio.gather(*(service.replicas.poll(r) for r in replicas.values()))

    async def send(model: str | None) -> tuple[int, dict, str]:
        body = {"prompt": "hi"} if model is None else {"model": model, "prompt": "hi"}
        resp = await client.post("/v1/completions", json=body)
        return resp.status, await resp.json(), resp.headers.get("X-Folio-Replica", "")

    try:
        await poll()
        assert all(r.up for r in replicas.values())
        assert sorted(replicas[r2].models) == ["base-x", "chat", "sql"] and replicas[r2].active_adapters == {"sql"}
        for _ in range(4):
            assert (await send("base-y"))[2] == r3.url
            assert (await send("chat"))[2] == r2.url
            assert (await send("base-x"))[2] in (r1.url, r2.url)
        assert set(r3.seen) == {"base-y"} and "base-y" not in r1.seen + r2.seen and "chat" not in r1.seen
        assert {"base-x"} <= set(r1.seen) and {"base-x"} <= set(r2.seen)  # a base model's requests spread
        # an adapter goes where it runs, while that replica is no busier than one request more
        for _ in range(3):
            assert (await send("sql"))[2] == r2.url
        r2.num_running = 1
        await poll()
        assert (await send("sql"))[2] == r2.url
        r2.num_running = 2
        await poll()
        assert (await send("sql"))[2] == r1.url
        # unknown: OpenAI's 404, and the router goes on
        status, body, replica = await send("nope")
        assert status == 404 and replica == "" and body == {"error": {
            "message": "The model `nope` does not exist.", "type": "invalid_request_error", "param": "model",
            "code": "model_not_found"}}
        assert service.counts["num_unknown_model"] == 1
        # an adapter loaded at run time is found before the next poll: an unknown model reads the lists again
        r1.models = [*r1.models, {"id": "math", "root": "/a/math", "parent": "base-x"}]
        service.replicas._models_refreshed_at = float("-inf")
        assert (await send("math"))[2] == r1.url and r1.seen[-1] == "math"
        # the replicas' --model values (the gateway's alias without --served-model-name) route too
        assert (await send("/models/y"))[2] == r3.url
        # no model: any replica, as with one model
        status, _, replica = await send(None)
        assert status == 200 and replica in {r.url for r in fakes}
        # /v1/models: the union, each id once; an unloaded adapter leaves it at the next read
        resp = await client.get("/v1/models")
        listed = [m["id"] for m in (await resp.json())["data"]]
        assert resp.status == 200 and sorted(listed) == ["base-x", "base-y", "chat", "math", "sql"]
        r2.models = [m for m in r2.models if m["id"] != "chat"]
        await poll()
        assert (await send("chat"))[0] == 404
        metrics = (await (await client.get("/metrics")).read()).decode()
        assert 'folio_router:requests_failed_total{cause="model_not_found"} 2.0' in metrics
        assert f'folio_router:replica_models{{model="sql",parent="base-x",replica="{r2.url}"}} 1.0' in metrics
        # a replica down: its models are still its own (a 503, not a 404, while it is away)
        service.replicas.mark_down(replicas[r3], "test")
        assert (await send("base-y"))[0] == 503
    finally:
        await client.close()
        for fake in fakes:
            await fake.server.close()
        for name in list(service.replicas.replicas):
            service.replicas.remove(name)
        service.recv_from_admin.close(linger=0)
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


# ---------------------------------------------------------------------- real replicas
FLAGS = ("--dtype", "float32", "--num-kv-blocks", "64", "--max-num-batched-tokens", "512", "--max-num-seqs", "4")
PROMPT = " ".join(f"Line {i} of a shared document about model routing." for i in range(12))


def finished_requests(replica: ServedReplica) -> dict[str, int]:
    """The replica's own count of finished requests, by the (base) model name it serves."""
    with urllib.request.urlopen(replica.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    counts = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "folio:e2e_request_latency_seconds_count":
                counts[sample.labels["model_name"]] = int(sample.value)
    return counts


def write_adapter(base: str, out_dir: Path) -> str:
    """A PEFT adapter of ``base`` (rank 4 on q and v, peft's own non-zero A and B)."""
    return write_peft_adapter(base, out_dir, 4, ["q_proj", "v_proj"], alpha=8, seed=None, std=None)


@pytest.mark.slow  # over 8 s: the full suite only
def test_two_base_models_and_their_adapters_behind_one_router(tmp_path, smollm_tokenizer_dir):
    """model-a with adapter ``sql`` from the start, model-b with ``notes`` loaded at run time."""
    model_a = write_tiny_chat_model(tmp_path / "model-a", smollm_tokenizer_dir, max_position_embeddings=512)
    model_b = str(tmp_path / "model-b")  # another model: one layer, other sizes, the same tokenizer files
    write_tiny_model(model_b, vocab_size=49152, max_position_embeddings=512, num_hidden_layers=1, hidden_size=32)
    for f in Path(model_a).iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, Path(model_b) / f.name)
    sql, notes = write_adapter(model_a, tmp_path / "sql"), write_adapter(model_b, tmp_path / "notes")
    a = ServedReplica(model_a, (*FLAGS, "--enable-lora", "--lora-modules", f"sql={sql}")).start()
    b = ServedReplica(model_b, (*FLAGS, "--enable-lora", "--allow-runtime-lora")).start()
    router = None

    def complete(model: str | None, prompt: str, max_tokens: int = 2) -> tuple[int, dict, str]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return post(router.url + "/v1/completions", body if model is None else {"model": model, **body})

    def cache_hits() -> int:
        return router.admin("stats")["num_cache_aware_hits"]

    def indexed(replica: ServedReplica, at_least: int) -> None:
        deadline = time.monotonic() + 20
        while router.replicas()[replica.url]["indexed_blocks"] < at_least:
            assert time.monotonic() < deadline, "the replica's blocks never reached the router's index"
            time.sleep(0.1)

    try:
        a.wait_ready(), b.wait_ready()
        router = start_router(model_a, [a, b])
        listed = {m["id"]: m.get("parent") for m in http_json(router.url + "/v1/models")["data"]}
        assert listed == {"model-a": None, "sql": "model-a", "model-b": None}
        for i in range(3):
            for model, replica in (("model-a", a), ("model-b", b), ("sql", a)):
                status, body, answered = complete(model, f"{PROMPT} {i}")
                assert status == 200 and answered == replica.url and body["model"] == model, body
        status, body, answered = complete("model-c", "hi")
        assert status == 404 and body["error"]["code"] == "model_not_found" and answered == ""
        # each replica finished exactly its own model's requests (an adapter's count under its base)
        assert finished_requests(a) == {"model-a": 6} and finished_requests(b) == {"model-b": 3}
        # model-b's prompts were tokenized with its own folder's tokenizer: its prefix is found on its replica
        indexed(b, 1)
        hits = cache_hits()
        status, _, answered = complete("model-b", f"{PROMPT} 0")
        assert status == 200 and answered == b.url and cache_hits() == hits + 1
        # an adapter's blocks are hashed as the engine hashes them: the base model's prefix is no hit
        # for it, its own is
        indexed(a, 1)
        hits = cache_hits()
        long = " ".join(f"Another text {i} read first by the base model." for i in range(12))
        for model, hit in (("model-a", 0), ("sql", 0), ("sql", 1)):
            blocks = router.replicas()[a.url]["indexed_blocks"]
            assert complete(model, long)[0] == 200 and cache_hits() == hits + hit, model
            if not hit:  # new blocks: wait for their events
                indexed(a, blocks + 1)
        # an adapter loaded on a replica at run time is routed there, and listed
        req = urllib.request.Request(b.url + "/v1/load_lora_adapter", method="POST", headers={
            "Content-Type": "application/json"}, data=json.dumps({"lora_name": "notes", "lora_path": notes}).encode())
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
        status, body, answered = complete("notes", "hi")
        assert status == 200 and answered == b.url and body["model"] == "notes"
        listed = {m["id"]: m.get("parent") for m in http_json(router.url + "/v1/models")["data"]}
        assert listed == {"model-a": None, "sql": "model-a", "model-b": None, "notes": "model-b"}
        rows = router.replicas()
        assert rows[a.url]["models"] == "model-a,sql" and rows[b.url]["models"] == "model-b,notes"
        # the router keeps serving, a request without a model too
        status, body, answered = complete(None, "hi", 1)
        assert status == 200 and answered in (a.url, b.url)
    finally:
        if router is not None:
            router.stop()
        for r in (a, b):
            if r.proc.poll() is None:
                r.proc.terminate()
        a.cleanup(), b.cleanup()

def test_the_prefix_index_keeps_adapters_apart_as_the_engine_does():
    """Blocks a replica computed for one adapter are a hit for that adapter only: not for the base
    model, not for another adapter (the engine's own rule, ``block_extra_keys``)."""
    from folio.services.router.index import KVIndex
    from folio.services.router.routing import Router
    from folio.core.kv.block_hash import block_extra_keys, chain_block_hashes
    from folio.shared.messages import BlockStored, KVEventBatch

    index, bs = KVIndex(), 4
    prompt = list(range(1, 18))
    with_sql, on_base = (Replica(name=f"http://{n}:8000", kv_events="", kv_snapshot="", up=True)
                         for n in ("sql", "base"))
    for replica, lora_name in ((with_sql, "sql"), (on_base, None)):
        index.view(replica.name).next_event_seq = 0
        hashes = chain_block_hashes(prompt[:-1], bs, block_extra_keys(None, lora_name))
        index.apply_batch(replica.name, 0, KVEventBatch(ts=0.0, events=[
            BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=prompt[:16], block_size=bs,
                        medium="GPU")]))
    router = Router(index, default_block_size=bs)
    for lora_name, expected in (("sql", with_sql), (None, on_base)):
        for _ in range(2):  # whoever's turn it is
            decision = router.choose([with_sql, on_base], prompt, None, set(), lora_name)
            assert (decision.replica, decision.reason, decision.num_cached_tokens) == (expected, "cache", 16)
    decision = router.choose([with_sql, on_base], prompt, None, set(), "chat")
    assert decision.reason == "load" and decision.num_cached_tokens == 0
