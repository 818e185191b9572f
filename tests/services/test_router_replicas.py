"""The router's replica bookkeeping against a real kvmanager over ipc:// sockets: it follows the KV
event stream, and a router that joins late (or resyncs) gets the cache's contents from a snapshot;
and DNS discovery adds and drops replicas as a name's addresses change."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import zmq
import zmq.asyncio

from folio.services.kvmanager.service import KVManagerService
from folio.services.router.index import KVIndex
from folio.services.router.metrics import RouterMetrics
from folio.services.router.replicas import Replica, ReplicaSet
from folio.core.kv.block_hash import block_extra_keys, chain_block_hashes
from folio.shared.config import Endpoints, KVManagerConfig, RouterConfig
from folio.shared.messages import KVAllocate, KVConfirm, KVFree, KVReset, KVStepReply, KVStepRequest, PoolInfo, RegisterPool
from folio.shared.transport import Decoder, encode, make_socket
from folio.services.in_process import short_run_dir

BS = 4


async def ask(sock, message):
    await sock.send(encode(message))
    return Decoder(PoolInfo, KVStepReply).decode(await asyncio.wait_for(sock.recv(), 5))


async def wait_for(predicate, what: str, timeout_s: float = 5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_events_and_snapshots_of_a_real_kvmanager_build_the_same_view():
    run_dir = short_run_dir()
    ep = Endpoints.ipc(run_dir)
    ctx = zmq.asyncio.Context()
    kv_task = asyncio.ensure_future(KVManagerService(KVManagerConfig(endpoints=ep), ctx).run())
    config = RouterConfig(endpoints=ep)
    early, late = KVIndex(), KVIndex()
    sets = [ReplicaSet(config, index, RouterMetrics(), ctx) for index in (early, late)]
    try:
        scheduler = make_socket(ctx, zmq.DEALER, ep.kvmanager)
        info = await ask(scheduler, RegisterPool(num_blocks=16, block_size=BS, bytes_per_block=64, epoch="e1"))
        await ask(scheduler, KVReset(generation=1, pool=info))
        replica = Replica(name="http://replica:1", kv_events=ep.kv_events, kv_snapshot=ep.kv_snapshot)
        sets[0].add(replica)
        sets[0].resync(replica, "up")
        await wait_for(lambda: early.in_sync(replica.name), "the first snapshot")
        await asyncio.sleep(0.2)  # the SUB's subscription reaches the PUB
        prompt = list(range(1, 19))  # 4 full blocks
        await ask(scheduler, KVStepRequest(step_id=0, generation=1, ops=[KVAllocate("a", 0, 18, prompt, "t")]))
        # computed: indexed, then freed
        await ask(scheduler, KVStepRequest(step_id=1, generation=1, ops=[KVConfirm(), KVFree(["a"])]))
        expected = set(chain_block_hashes(prompt, BS, block_extra_keys("t")))
        await wait_for(lambda: early.view(replica.name).block_hashes == expected, "the stored blocks' events")
        # a router that joins now learns the same from a snapshot
        late_replica = Replica(name=replica.name, kv_events=ep.kv_events, kv_snapshot=ep.kv_snapshot)
        sets[1].add(late_replica)
        sets[1].resync(late_replica, "up")
        await wait_for(lambda: late.in_sync(replica.name), "the late router's snapshot")
        assert late.view(replica.name).block_hashes == expected and late.view(replica.name).block_size == BS
        # a new executor epoch clears everything, for both
        await ask(scheduler, RegisterPool(num_blocks=16, block_size=BS, bytes_per_block=64, epoch="e2"))
        await wait_for(lambda: not early.view(replica.name).block_hashes and not late.view(replica.name).block_hashes,
                       "AllBlocksCleared")
        scheduler.close(linger=0)
    finally:
        for s in sets:
            for name in list(s.replicas):
                s.remove(name)
        kv_task.cancel()
        await asyncio.gather(kv_task, return_exceptions=True)
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.asyncio
async def test_dns_discovery_adds_and_drops_replicas_as_addresses_change(monkeypatch):
    ctx = zmq.asyncio.Context()
    config = RouterConfig(endpoints=Endpoints.ipc(short_run_dir()), replica_dns="folio-replicas:8000",
                          dns_interval_s=0.01, replicas=("http://static:9000",))
    replicas = ReplicaSet(config, KVIndex(), RouterMetrics(), ctx)
    answers = [["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3"], OSError("no such name"), []]

    async def getaddrinfo(host, port, type=0):
        assert (host, port) == ("folio-replicas", 8000)
        answer = answers[0] if len(answers) == 1 else answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return [(2, type, 6, "", (ip, port)) for ip in answer]

    loop = asyncio.get_running_loop()
    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    seen = []

    async def watch():
        while True:
            seen.append(sorted(replicas.replicas))
            await asyncio.sleep(0.002)

    replicas.add(Replica(name="http://static:9000", kv_events="tcp://static:5555", kv_snapshot="tcp://static:5561"))
    tasks = [asyncio.ensure_future(replicas._discover_forever(config.replica_dns)), asyncio.ensure_future(watch())]
    try:
        await wait_for(lambda: len(answers) == 1 and sorted(replicas.replicas) == ["http://static:9000"],
                       "the last answer")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for name in list(replicas.replicas):
            replicas.remove(name)
        ctx.destroy(linger=0)
    assert ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://static:9000"] in seen
    assert ["http://10.0.0.2:8000", "http://10.0.0.3:8000", "http://static:9000"] in seen
    # a failed lookup kept what was known: no state between the second answer and the empty one lost 10.0.0.3 early
    second = seen.index(["http://10.0.0.2:8000", "http://10.0.0.3:8000", "http://static:9000"])
    assert all(s in (seen[second], ["http://static:9000"]) for s in seen[second:])


@pytest.mark.asyncio
async def test_with_no_replica_up_the_router_answers_503_and_is_not_healthy():
    from aiohttp.test_utils import TestClient, TestServer

    from folio.services.router.service import RouterService

    run_dir = short_run_dir()
    ctx = zmq.asyncio.Context()
    service = RouterService(RouterConfig(endpoints=Endpoints.ipc(run_dir)), None, ctx)
    service.replicas.add(Replica(name="http://127.0.0.1:9", kv_events="tcp://127.0.0.1:9", kv_snapshot="tcp://127.0.0.1:9"))
    client = TestClient(TestServer(service.app()))
    await client.start_server()
    try:
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert resp.status == 503 and (await resp.json())["error"]["type"] == "service_unavailable"
        assert (await client.get("/health")).status == 503
        assert service.counts["num_failed"] == 1
        # up but refusing connections: marked down after the attempt, and still a clean 503
        service.replicas.replicas["http://127.0.0.1:9"].up = True
        service.session = client.session
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert resp.status == 503 and not service.replicas.replicas["http://127.0.0.1:9"].up
        assert service.counts["num_retries"] == 1
    finally:
        await client.close()
        for name in list(service.replicas.replicas):
            service.replicas.remove(name)
        service.recv_from_admin.close(linger=0)
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.asyncio
async def test_a_request_held_by_a_replica_that_goes_down_is_retried_on_another():
    """A replica that hangs (its process stopped, say) holds a request until it is found down; the
    request then goes to the other replica, and a stream already under way is left alone."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from folio.services.router.service import RouterService

    async def hang(request):
        await asyncio.sleep(3600)

    async def answer(request):
        return web.json_response({"answered": True})

    servers = []
    for handler in (hang, answer):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        servers.append(TestServer(app))
        await servers[-1].start_server()
    run_dir = short_run_dir()
    ctx = zmq.asyncio.Context()
    service = RouterService(RouterConfig(endpoints=Endpoints.ipc(run_dir)), None, ctx)
    hung, live = (Replica(name=str(s.make_url("")).rstrip("/"), kv_events="tcp://127.0.0.1:9",
                          kv_snapshot="tcp://127.0.0.1:9") for s in servers)
    for r in (hung, live):
        service.replicas.add(r)
        r.up = True
    live.num_running = 5  # the hung one looks cheaper: it is tried first
    client = TestClient(TestServer(service.app()))
    await client.start_server()
    service.session = client.session
    try:
        pending = asyncio.ensure_future(client.post("/v1/completions", json={"model": "m", "prompt": "hi"}))
        await wait_for(lambda: hung.num_inflight == 1, "the request on the hung replica")
        await asyncio.sleep(0.2)
        assert not pending.done()
        service.replicas.mark_down(hung, "poll: timeout")
        resp = await asyncio.wait_for(pending, 5)
        assert resp.status == 200 and await resp.json() == {"answered": True}
        assert resp.headers["X-Folio-Replica"] == live.name
        assert service.counts["num_retries"] == 1 and hung.num_inflight == 0
    finally:
        await client.close()
        for s in servers:
            await s.close()
        for name in list(service.replicas.replicas):
            service.replicas.remove(name)
        service.recv_from_admin.close(linger=0)
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)
