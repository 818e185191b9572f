"""The tokenizer service on its real sockets, the test playing gateway and scheduler: what goes to
the scheduler (EngineRequest, AbortRequest), what comes back to the gateway (one TextBatch per
TokenBatch, errors), malformed messages, and ``main`` as a process stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from folio.services.tokenizer.service import TokenizerService
from folio.shared.config import Endpoints, TokenizerConfig
from folio.shared.messages import (
    AbortRequest,
    ChatMessage,
    EngineRequest,
    GenerateRequest,
    TextBatch,
    TokenBatch,
    TokenDelta,
    ToolCall,
)
from folio.shared.sampling import SamplingParams
from folio.shared.transport import Decoder, encode, make_socket
from tests.services.frontend import admin_call, short_run_dir, text_tokenizer

pytestmark = pytest.mark.asyncio
ROOT = Path(__file__).resolve().parents[2]


class Peers:
    """The test's ends of the tokenizer's sockets."""

    def __init__(self, ctx, ep: Endpoints):
        self.to_tokenizer = make_socket(ctx, zmq.PUSH, ep.tokenizer_in)
        self.from_tokenizer_to_scheduler = make_socket(ctx, zmq.PULL, ep.scheduler_in)
        self.from_tokenizer_to_gateway = make_socket(ctx, zmq.PULL, ep.gateway_in)
        self.engine = Decoder(EngineRequest, AbortRequest)
        self.text = Decoder(TextBatch)

    async def send(self, msg) -> None:
        await self.to_tokenizer.send(encode(msg) if not isinstance(msg, bytes) else msg)

    async def scheduler_gets(self):
        return self.engine.decode(await asyncio.wait_for(self.from_tokenizer_to_scheduler.recv(), 5))

    async def gateway_gets(self) -> TextBatch:
        return self.text.decode(await asyncio.wait_for(self.from_tokenizer_to_gateway.recv(), 5))

    def close(self) -> None:
        for s in (self.to_tokenizer, self.from_tokenizer_to_scheduler, self.from_tokenizer_to_gateway):
            s.close(linger=0)


@pytest_asyncio.fixture
async def tokenizer_peers():
    run_dir = short_run_dir()
    ep = Endpoints.ipc(run_dir)
    ctx = zmq.asyncio.Context()
    service = TokenizerService(TokenizerConfig(endpoints=ep), text_tokenizer(), ctx)
    task = asyncio.ensure_future(service.run())
    peers = Peers(ctx, ep)
    yield service, peers, ctx, ep
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    peers.close()
    service.close()
    ctx.destroy(linger=0)
    shutil.rmtree(run_dir, ignore_errors=True)


async def test_request_tokenized_and_tokens_detokenized(tokenizer_peers):
    service, peers, ctx, ep = tokenizer_peers
    tok = text_tokenizer()
    msgs = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")]
    sampling = SamplingParams(temperature=0.0, max_tokens=None)  # what the context leaves
    await peers.send(GenerateRequest(req_id="a-0", sampling=sampling, messages=msgs, priority=3))
    engine_req = await peers.scheduler_gets()
    expected = tok.hf.encode(tok.hf.apply_chat_template([{"role": m.role, "content": m.content} for m in msgs],
                                                        add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False)
    assert engine_req.prompt_token_ids == expected
    assert engine_req.sampling == sampling  # as it was sent: the scheduler works out the tokens left
    assert engine_req.eos_token_id == tok.eos_token_id and engine_req.priority == 3
    ids = tok.hf.encode(" Sure 😀")
    await peers.send(TokenBatch(step_id=1, deltas=[TokenDelta(req_id="a-0", token_ids=ids[:2],
                                                              num_prompt_tokens=len(expected))]))
    await peers.send(TokenBatch(step_id=2, deltas=[TokenDelta(req_id="a-0", token_ids=ids[2:] + [tok.eos_token_id],
                                                              finish_reason="stop")]))
    first, second = await peers.gateway_gets(), await peers.gateway_gets()
    assert len(first.deltas) == len(second.deltas) == 1
    assert first.deltas[0].text + second.deltas[0].text == " Sure 😀"
    assert second.deltas[0].finish_reason == "stop" and second.deltas[0].num_output_tokens == len(ids) + 1
    assert second.deltas[0].num_prompt_tokens == len(expected)


async def test_abort_and_stop_string_reach_the_scheduler(tokenizer_peers):
    service, peers, ctx, ep = tokenizer_peers
    tok = text_tokenizer()
    await peers.send(GenerateRequest(req_id="b-0", sampling=SamplingParams(stop=["answer"]), prompt="x"))
    await peers.send(GenerateRequest(req_id="c-0", sampling=SamplingParams(), prompt="y"))
    assert (await peers.scheduler_gets()).req_id == "b-0"
    assert (await peers.scheduler_gets()).req_id == "c-0"
    await peers.send(AbortRequest(req_id="c-0"))
    assert await peers.scheduler_gets() == AbortRequest(req_id="c-0", reason="abort")
    ids = tok.hf.encode(" The answer is")
    deltas = [TokenDelta(req_id=r, token_ids=[t]) for t in ids for r in ("b-0", "c-0")]
    await peers.send(TokenBatch(step_id=1, deltas=deltas))
    batch = await peers.gateway_gets()
    assert [(d.req_id, d.text, d.finish_reason, d.stop_reason) for d in batch.deltas] == [
        ("b-0", " The ", "stop", "answer")
    ]
    assert await peers.scheduler_gets() == AbortRequest(req_id="b-0", reason="stop")


async def test_context_overflow_and_bad_tokens_answer_the_gateway(tokenizer_peers):
    service, peers, ctx, ep = tokenizer_peers
    await peers.send(GenerateRequest(req_id="d-0", sampling=SamplingParams(max_tokens=9000), prompt="x"))
    await peers.send(GenerateRequest(req_id="e-0", sampling=SamplingParams(), prompt_token_ids=[10**6]))
    errors = [(await peers.gateway_gets()).deltas[0] for _ in range(2)]
    assert [(d.req_id, d.error_code, d.error_param, d.finish_reason) for d in errors] == [
        ("d-0", 400, "max_tokens", "error"), ("e-0", 400, "prompt", "error")]
    assert "maximum context length is 8192" in errors[0].error
    assert await peers.from_tokenizer_to_scheduler.poll(100) == 0  # nothing was scheduled


async def test_garbage_is_dropped_and_the_service_keeps_serving(tokenizer_peers):
    service, peers, ctx, ep = tokenizer_peers
    for junk in (b"", b"\xc1", b"\x93\x01\x02\x03", encode(SamplingParams())):
        await peers.send(junk)
    await peers.send(GenerateRequest(req_id="f-0", sampling=SamplingParams(), prompt="still here"))
    assert (await peers.scheduler_gets()).req_id == "f-0"
    reply = await admin_call(ctx, ep.admin_tokenizer, "stats")
    assert reply.ok and reply.data["num_malformed"] == 4 and reply.data["num_requests"] == 1


async def test_main_serves_and_stops_on_sigterm():
    run_dir = short_run_dir()
    env = {**os.environ, "FOLIO_RUN_DIR": run_dir, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "folio.services.tokenizer.main", "--max-model-len", "64"], env=env,
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ctx = zmq.asyncio.Context()
    peers = Peers(ctx, Endpoints.ipc(run_dir))
    try:
        await peers.send(GenerateRequest(req_id="g-0", sampling=SamplingParams(max_tokens=100), prompt="x"))
        err = (await asyncio.wait_for(peers.from_tokenizer_to_gateway.recv(), 60))
        assert "maximum context length is 64" in Decoder(TextBatch).decode(err).deltas[0].error
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, proc.stderr.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        peers.close()
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_structured_specs_are_checked_once_and_bad_ones_answered(tokenizer_peers):
    from folio.shared.messages import GuidedSpec

    service, peers, ctx, ep = tokenizer_peers
    regex = GuidedSpec(kind="regex", spec="[0-9]{3}", param="guided_regex")
    for req_id in ("g-0", "g-1"):
        await peers.send(GenerateRequest(req_id=req_id, sampling=SamplingParams(), prompt="Code:", guided=regex))
    got = [await peers.scheduler_gets(), await peers.scheduler_gets()]
    assert {g.req_id for g in got} == {"g-0", "g-1"}
    assert all(g.grammar.kind == "regex" and g.grammar.spec == "[0-9]{3}" and g.sampling == SamplingParams()
               for g in got)
    assert service.grammars.stats["num_grammar_checks"] == 1
    bad = GuidedSpec(kind="grammar", spec="root ::= missing", param="guided_grammar")
    await peers.send(GenerateRequest(req_id="b-0", sampling=SamplingParams(), prompt="x", guided=bad,
                                     fork_req_ids=["b-1"]))
    errors = {d.req_id: d for _ in range(2) for d in (await peers.gateway_gets()).deltas}
    assert set(errors) == {"b-0", "b-1"}
    assert errors["b-0"].error_code == 400 and errors["b-0"].error_param == "guided_grammar"
    assert "missing" in errors["b-0"].error
    # a request aborted while its spec is checked never reaches the scheduler
    slow = GuidedSpec(kind="regex", spec="[a-z]{2,9}")
    await peers.send(GenerateRequest(req_id="c-0", sampling=SamplingParams(), prompt="x", guided=slow))
    await peers.send(AbortRequest(req_id="c-0"))
    assert isinstance(await peers.scheduler_gets(), AbortRequest)
    await peers.send(GenerateRequest(req_id="d-0", sampling=SamplingParams(), prompt="x"))
    assert (await peers.scheduler_gets()).req_id == "d-0"


async def test_tools_reach_the_prompt(tokenizer_peers):
    service, peers, ctx, ep = tokenizer_peers
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    msgs = [ChatMessage("user", "Weather?"),
            ChatMessage("assistant", "", tool_calls=[ToolCall(id="c1", name="get_weather", arguments='{"city": "Oslo"}')]),
            ChatMessage("tool", '{"temp": 3}', tool_call_id="c1")]
    await peers.send(GenerateRequest(req_id="t-0", sampling=SamplingParams(), messages=msgs, tools=[tool]))
    text = text_tokenizer().decode_with_specials((await peers.scheduler_gets()).prompt_token_ids)
    assert '"name": "get_weather"' in text and "<tools>" in text  # SmolLM2's template: the Hermes form
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temp": 3}\n</tool_response>' in text
