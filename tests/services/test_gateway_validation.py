"""The gateway's HTTP edge without an engine behind it: validation errors (OpenAI error objects),
auth, unknown models, malformed JSON, /health and /v1/models. Bad requests never reach the
tokenizer, so nothing listens on the pipeline sockets here."""

from __future__ import annotations

import shutil

import pytest
import pytest_asyncio
import zmq.asyncio
from aiohttp.test_utils import TestClient, TestServer

from folio.services.gateway.app import build_app
from folio.services.gateway.service import GatewayService
from folio.shared.config import Endpoints, GatewayConfig
from tests.services.frontend import short_run_dir
from tests.services.openai_schema import validate

pytestmark = pytest.mark.asyncio

MODEL = "SmolLM2-135M-Instruct"
MSGS = [{"role": "user", "content": "hi"}]


@pytest_asyncio.fixture
async def gateway_client():
    clients = []
    run_dirs = []
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


def assert_error(body: dict, param) -> None:
    validate(body, "ErrorResponse")
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param


COMPLETION_BAD = [
    ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**20}, "max_tokens"),
    ({"prompt": [10**12]}, "prompt"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x", "stop": 7}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "seed": "abc"}, "seed"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "stream": "true"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [-5]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"max_tokens": 5}, "prompt"),
]

CHAT_BAD = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.role"),
    ({"messages": [{"content": "hi"}]}, "messages.role"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": MSGS, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": MSGS, "logprobs": True, "top_logprobs": 25}, "top_logprobs"),
    ({"messages": MSGS, "logprobs": 2}, "logprobs"),
    ({"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MSGS, "temperature": None, "top_p": "high"}, "top_p"),
    ({"model": MODEL}, "messages"),
]


@pytest.mark.parametrize("body,param", COMPLETION_BAD)
async def test_completion_validation_errors(gateway_client, body, param):
    client = await gateway_client()
    r = await client.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status == 400, await r.text()
    assert_error(await r.json(), param)


@pytest.mark.parametrize("body,param", CHAT_BAD)
async def test_chat_validation_errors(gateway_client, body, param):
    client = await gateway_client()
    r = await client.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert r.status == 400, await r.text()
    assert_error(await r.json(), param)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'{"prompt": "x",}', b"\xff\xfe"])
async def test_malformed_json_is_a_400(gateway_client, raw):
    client = await gateway_client()
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        assert r.status == 400
        assert_error(await r.json(), None)


async def test_unknown_model_is_a_404(gateway_client):
    client = await gateway_client()
    r = await client.post("/v1/completions", json={"model": "gpt-5", "prompt": "x"})
    assert r.status == 404
    body = await r.json()
    validate(body, "ErrorResponse")
    assert body["error"]["param"] == "model" and body["error"]["code"] == "model_not_found"


async def test_served_model_name_is_the_name_clients_use(gateway_client):
    client = await gateway_client(served_model_name="my-model")
    r = await client.get("/v1/models")
    body = await r.json()
    validate(body, "ListModelsResponse")
    assert [m["id"] for m in body["data"]] == ["my-model"]
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": MSGS})
    assert r.status == 404


async def test_api_key_required_when_set(gateway_client):
    client = await gateway_client(api_key="sekret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers)
        assert r.status == 401
        body = await r.json()
        validate(body, "ErrorResponse")
        assert body["error"]["code"] == "invalid_api_key"
    r = await client.get("/v1/models", headers={"Authorization": "Bearer sekret"})
    assert r.status == 200
    # validation runs after auth: a good key with a bad body gets the 400
    r = await client.post("/v1/completions", json={"prompt": "x", "n": 0}, headers={"Authorization": "Bearer sekret"})
    assert r.status == 400
    assert (await client.get("/live")).status == 200  # probes need no key
    assert (await client.get("/health")).status == 503


async def test_health_names_the_services_that_do_not_answer(gateway_client):
    client = await gateway_client()
    r = await client.get("/health")  # nothing behind this gateway
    assert r.status == 503
    body = await r.json()
    assert body["status"] == "unavailable"
    assert sorted(body["down"]) == ["executor", "kvmanager", "scheduler", "tokenizer"]
    assert (await client.get("/ready")).status == 503
    assert (await client.get("/live")).status == 200
    # a request that would need them gets 503 at once, as an OpenAI error object
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status == 503
    body = await r.json()
    validate(body, "ErrorResponse")
    assert body["error"]["code"] == "service_unavailable" and "scheduler" in body["error"]["message"]
    r = await client.get("/v1/models")
    body = await r.json()
    validate(body, "ListModelsResponse")
    assert body["data"][0]["id"] == MODEL


async def test_metrics_answer_without_scheduler_or_kvmanager(gateway_client):
    client = await gateway_client()
    r = await client.get("/metrics")
    assert r.status == 200
    text = await r.text()
    for name in ("folio:time_to_first_token_seconds", "folio:inter_token_latency_seconds",
                 "folio:e2e_request_latency_seconds", "folio:num_requests_running", "folio:num_requests_waiting",
                 "folio:kv_cache_usage_perc", "folio:prompt_tokens_total", "folio:generation_tokens_total"):
        assert name in text


async def test_http_errors_of_aiohttp_are_openai_error_objects(gateway_client):
    client = await gateway_client()
    r = await client.get("/v1/nothing-here")
    assert r.status == 404
    validate(await r.json(), "ErrorResponse")
    r = await client.get("/v1/completions")
    assert r.status == 405
    validate(await r.json(), "ErrorResponse")
