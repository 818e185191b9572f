"""The served side of LoRA without an engine: ``folio serve``'s LoRA flags reach the services that
take them (``--lora-modules`` takes several NAME=PATH and may be repeated), the runtime endpoints
answer 404 naming ``--allow-runtime-lora`` when it is off, and the adapters' metrics read as the
router reads them (vLLM's ``lora_requests_info``). Through a real server: ``tests/e2e/test_lora_api.py``."""

from __future__ import annotations

import argparse
import shutil

import pytest
import pytest_asyncio
import zmq.asyncio
from aiohttp.test_utils import TestClient, TestServer

from folio.services.gateway.app import build_app
from folio.services.gateway.metrics import GatewayMetrics
from folio.services.gateway.service import GatewayService
from folio.services.router.replicas import read_active_adapters
from folio.services.serve import add_serve_args, service_argv
from folio.shared.config import Endpoints, GatewayConfig, RuntimeConfig, SchedulerConfig
from folio.shared.flags import config_values, service_parser
from tests.services.frontend import short_run_dir
from tests.services.openai_schema import validate


def test_serve_hands_the_lora_flags_to_the_services_that_take_them():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--enable-lora", "--lora-modules", "sql=/a/sql", "chat=/a/my chat",
                              "--lora-modules", "late=/b", "--max-loras", "3", "--max-lora-rank", "64",
                              "--max-cpu-loras", "8", "--allow-runtime-lora"])
    configs = {}
    for service, cls in (("executor", RuntimeConfig), ("scheduler", SchedulerConfig), ("gateway", GatewayConfig)):
        got = service_parser(service, "").parse_args(service_argv(service, args, "/m"))
        configs[service] = config_values(cls, got, service)
    assert {k: configs["executor"][k] for k in ("enable_lora", "lora_modules", "max_loras", "max_lora_rank",
                                                 "max_cpu_loras", "allow_runtime_lora")} == {
        "enable_lora": True, "lora_modules": ("sql=/a/sql", "chat=/a/my chat", "late=/b"), "max_loras": 3,
        "max_lora_rank": 64, "max_cpu_loras": 8, "allow_runtime_lora": True}
    assert configs["scheduler"]["max_loras"] == 3 and "enable_lora" not in configs["scheduler"]
    assert configs["gateway"]["enable_lora"] and configs["gateway"]["allow_runtime_lora"]
    assert "lora_modules" not in configs["gateway"]
    # not given: the defaults, and nothing forwarded
    bare = parser.parse_args([])
    assert not any(a.startswith(("--lora", "--enable-lora", "--max-lora")) for a in service_argv("executor", bare, "/m"))
    executor = RuntimeConfig(**config_values(RuntimeConfig, service_parser("executor", "").parse_args([]), "executor"))
    assert (executor.enable_lora, executor.lora_modules, executor.max_loras, executor.max_cpu_loras) == \
        (False, (), 4, None)


@pytest_asyncio.fixture
async def gateway_client():
    clients, run_dirs = [], []
    ctx = zmq.asyncio.Context()

    async def make(**config):
        run_dirs.append(short_run_dir())
        service = GatewayService(GatewayConfig(endpoints=Endpoints.ipc(run_dirs[-1]), **config), ctx)
        client = TestClient(TestServer(build_app(service)))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()
    ctx.destroy(linger=0)
    for d in run_dirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.asyncio
async def test_runtime_endpoints_need_their_flags(gateway_client):
    load = {"lora_name": "x", "lora_path": "/nowhere"}
    for config, status, words in (({}, 404, "--allow-runtime-lora"), ({"enable_lora": True}, 404,
                                                                       "--allow-runtime-lora"),
                                  ({"allow_runtime_lora": True}, 400, "--enable-lora")):
        client = await gateway_client(**config)
        for path, body in (("/v1/load_lora_adapter", load), ("/v1/unload_lora_adapter", {"lora_name": "x"})):
            r = await client.post(path, json=body)
            reply = await r.json()
            assert r.status == status and words in reply["error"]["message"], (config, path, reply)
            validate(reply, "ErrorResponse")
    client = await gateway_client(api_key="k", allow_runtime_lora=True, enable_lora=True)
    assert (await client.post("/v1/load_lora_adapter", json=load)).status == 401  # behind the key
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": "x"}, headers={"Authorization": "Bearer k"})
    assert r.status == 400 and (await r.json())["error"]["param"] == "lora_path"


def test_adapter_metrics_read_as_the_router_reads_them():
    metrics = GatewayMetrics("base")
    scheduler = {"lora_running": {"sql": 3, "chat": 1}, "lora_waiting": {"late": 2}, "max_loras": 2}
    metrics.set_lora_stats(scheduler, {"lora_loads": 5, "lora_evictions": 2})
    text = metrics.render().decode()
    assert read_active_adapters(text) == {"sql", "chat", "late"}
    assert 'folio:lora_requests_info{max_lora="2",running_lora_adapters="chat,sql",waiting_lora_adapters="late"}' \
        in text
    assert 'folio:lora_num_requests_running{lora_name="sql",model_name="base"} 3.0' in text
    assert 'folio:lora_num_requests_waiting{lora_name="late",model_name="base"} 2.0' in text
    assert 'folio:lora_loads_total{model_name="base"} 5.0' in text
    # the next scrape: counters grow by the difference, gauges show only what is there now
    metrics.set_lora_stats({"lora_running": {}, "lora_waiting": {}, "max_loras": 2},
                           {"lora_loads": 7, "lora_evictions": 2})
    text = metrics.render().decode()
    assert read_active_adapters(text) == frozenset()
    assert "lora_num_requests_running{" not in text and 'folio:lora_loads_total{model_name="base"} 7.0' in text
    assert 'folio:lora_evictions_total{model_name="base"} 2.0' in text


def test_lora_modules_without_enable_lora_are_refused(capsys):
    from folio.services.serve import serve

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert serve(parser.parse_args(["--lora-modules", "sql=/a/sql"])) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        from folio.services.executor.main import parse_config

        parse_config(["--lora-modules", "sql=/a/sql"])
