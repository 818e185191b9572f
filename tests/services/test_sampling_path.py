"""The sampling parameters from the HTTP body to the executor: the struct the gateway builds is the
struct the executor receives, field by field, over the real services (gateway, tokenizer,
scheduler, kvmanager, executor on ``ipc://`` sockets, msgpack between them) with a tiny model; the
executor's columns are made of it, and a reply without a token limit runs to the end of the context."""

from __future__ import annotations

import asyncio
import json
import shutil
from contextlib import asynccontextmanager

import msgspec
import pytest
import zmq.asyncio
from aiohttp.test_utils import TestClient, TestServer

from folio.core.executor.kernels.sampler_columns import column_values
from folio.core.tokenizer.text import TextTokenizer
from folio.services.executor.service import ExecutorService
from folio.services.gateway.app import build_app
from folio.services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from folio.services.gateway.service import GatewayService
from folio.services.kvmanager.service import KVManagerService
from folio.services.scheduler.service import SchedulerService
from folio.services.tokenizer.service import TokenizerService
from folio.shared.config import (Endpoints, ExecutorServiceConfig, GatewayConfig, KVManagerConfig, RuntimeConfig,
                                 SchedulerConfig, TokenizerConfig)
from folio.testing.models import write_tiny_chat_model
from tests.services.frontend import short_run_dir, wait_for

pytestmark = pytest.mark.asyncio

CONTEXT = 64  # the tiny model's context: a reply without a limit fills it quickly


@asynccontextmanager
async def served_stack(model: str):
    """Every service in this loop, on real sockets; yields (an HTTP client, what the executor's
    runner was handed: each new request with its parameter columns as the runner holds them)."""
    run_dir, ctx = short_run_dir(), zmq.asyncio.Context()
    endpoints = Endpoints.ipc(run_dir)
    runtime = RuntimeConfig(model=model, dtype="float32", device="cpu", block_size=8, num_kv_blocks=64,
                            max_num_seqs=8, max_num_batched_tokens=128)
    executor = ExecutorService(ExecutorServiceConfig(endpoints=endpoints, runtime=runtime, model_path=model), ctx)
    received = []
    execute, runner = executor.execute, executor.runner  # the step of each plan the service decoded

    def recording(plan):
        result = execute(plan)
        for new in plan.new_reqs:
            row = runner.batch.row_of.get(new.req_id)
            received.append((new, None if row is None else runner.batch.params[row].tolist()))
        return result

    executor.execute = recording
    services = [KVManagerService(KVManagerConfig(endpoints=endpoints), ctx), executor,
                SchedulerService(SchedulerConfig(endpoints=endpoints, max_num_seqs=8, max_num_batched_tokens=128), ctx),
                TokenizerService(TokenizerConfig(endpoints=endpoints), TextTokenizer(model), ctx)]
    gateway = GatewayService(GatewayConfig(endpoints=endpoints, model=model, admin_timeout_s=0.5), ctx)
    tasks = [asyncio.ensure_future(s.run()) for s in services]
    try:
        async with TestClient(TestServer(build_app(gateway))) as client:
            await wait_for(lambda: not gateway.health.down(), timeout_s=60.0)
            yield client, received
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        services[-1].close()
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.slow  # five services and a model start: ~15 s on a loaded machine
async def test_the_executor_receives_the_struct_the_gateway_built(tmp_path, smollm_tokenizer_dir):
    model = write_tiny_chat_model(tmp_path, smollm_tokenizer_dir, max_position_embeddings=CONTEXT)
    completion = {"prompt": "The river runs", "n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05,
                  "presence_penalty": 0.1, "frequency_penalty": 0.2, "repetition_penalty": 1.1, "seed": 3,
                  "max_tokens": 4, "stop": ["zzzz"], "stop_token_ids": [5], "ignore_eos": True, "logprobs": 2}
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.0}  # no limit: what the context leaves
    built = msgspec.json.decode(json.dumps(completion), type=CompletionRequest).sampling_params()
    built_chat = msgspec.json.decode(json.dumps(chat), type=ChatCompletionRequest).sampling_params()
    async with served_stack(model) as (client, received):
        reply = await client.post("/v1/completions", json=completion)
        assert reply.status == 200, await reply.text()
        reply = await client.post("/v1/chat/completions", json=chat)
        assert reply.status == 200, await reply.text()
        body = await reply.json()
    first, fork = sorted((r for r in received if r[0].req_id.startswith("cmpl-")), key=lambda r: r[0].req_id)
    (answer,) = [r for r in received if r[0].req_id.startswith("chatcmpl-")]
    assert first[0].sampling == built  # field by field, after msgpack over three sockets
    assert fork[0].sampling == built.with_seed_offset(1)  # the second choice: seed + 1, the rest the same
    assert answer[0].sampling == built_chat and built_chat.max_tokens is None
    assert first[1] == pytest.approx(column_values(built, 49152))  # the runner's row: the struct's columns
    usage = body["usage"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT  # the scheduler filled the context
