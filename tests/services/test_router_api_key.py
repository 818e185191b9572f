"""The router's ``--api-key``: its /v1/ routes want the key as a gateway's do; /health does not."""

from __future__ import annotations

import shutil

import pytest
import zmq.asyncio

from folio.services.router.main import parse_config
from folio.shared.config import Endpoints, RouterConfig
from folio.services.in_process import short_run_dir


def test_the_router_takes_the_flag_and_the_environment(monkeypatch):
    assert parse_config(["--replica", "http://a:8000", "--api-key", "k1"]).api_key == "k1"
    monkeypatch.setenv("FOLIO_API_KEY", "k2")
    assert parse_config(["--replica", "http://a:8000"]).api_key == "k2"


@pytest.mark.asyncio
async def test_a_request_without_the_key_is_a_401():
    from aiohttp.test_utils import TestClient, TestServer

    from folio.services.router.service import RouterService

    run_dir = short_run_dir()
    ctx = zmq.asyncio.Context()
    service = RouterService(RouterConfig(endpoints=Endpoints.ipc(run_dir), api_key="sesame"), None, ctx)
    client = TestClient(TestServer(service.app()))
    await client.start_server()
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            resp = await client.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
            assert resp.status == 401
            assert (await resp.json())["error"]["code"] == "invalid_api_key"
        resp = await client.get("/v1/models", headers={"Authorization": "Bearer sesame"})
        assert resp.status != 401  # past the key: the router's own answer (no replica is up)
        resp = await client.get("/health")
        assert resp.status != 401
    finally:
        await client.close()
        service.recv_from_admin.close(0)
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)
