"""Test helpers for the front half (gateway, tokenizer): the real services on real ``ipc://``
sockets as asyncio tasks in the test's loop, and ``ScriptedScheduler``, a stand-in for the
scheduler that speaks its real protocol (PULL ``EngineRequest``/``AbortRequest``, PUSH scripted
``TokenBatch``es). The end-to-end tests run the real scheduler and executor instead."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable
from contextlib import asynccontextmanager
from functools import lru_cache

import msgspec
import zmq
import zmq.asyncio

from folio.shared.config import DEFAULT_MODEL_NAME, Endpoints, GatewayConfig, TokenizerConfig
from folio.shared.transport import QUIET, ask_admin
from folio.shared.messages import (
    AbortRequest,
    AdminReply,
    EngineRequest,
    TokenBatch,
    TokenDelta,
    TokenLogprobs,
)
from folio.shared.transport import Decoder, encode, make_socket

SCRIPT_TEXT = " The answer is 42. END of the story, told twice over and over again until the end."


@lru_cache(maxsize=1)
def text_tokenizer():
    """The real SmolLM2 tokenizer (loaded once per test process: ~1 s)."""
    from folio.core.model_files import resolve_model
    from folio.core.tokenizer.text import TextTokenizer

    return TextTokenizer(resolve_model(DEFAULT_MODEL_NAME))


def short_run_dir() -> str:
    """ipc:// paths must stay under ~100 bytes: pytest's tmp_path can be longer."""
    return tempfile.mkdtemp(prefix="folio-f-", dir="/tmp")


class ScriptedScheduler:
    """Answers each EngineRequest with the tokens of ``script(request)``, one per step, then
    finishes it: "length" at max_tokens (None: what ``max_model_len`` leaves), "stop" at a stop
    token id, else EOS with "stop"."""

    def __init__(self, ctx, endpoints: Endpoints, script: Callable[[EngineRequest], list[int]],
                 step_s: float = 0.005, max_model_len: int = 8192):
        self.recv_from_tokenizer = make_socket(ctx, zmq.PULL, endpoints.scheduler_in)
        self.send_to_tokenizer = make_socket(ctx, zmq.PUSH, endpoints.tokenizer_in)
        self.decoder = Decoder(EngineRequest, AbortRequest)
        self.script, self.step_s, self.max_model_len = script, step_s, max_model_len
        self.requests: dict[str, EngineRequest] = {}
        self.received: list[EngineRequest] = []
        self.aborts: list[AbortRequest] = []
        self._tokens: dict[str, list[int]] = {}
        self._step_id = 0
        self.paused = False  # tests hold tokens back to look at a request while it runs

    async def run(self) -> None:
        while True:
            while await self.recv_from_tokenizer.poll(0):
                self._take(self.decoder.decode(await self.recv_from_tokenizer.recv()))
            if self.requests and not self.paused:
                await self.send_to_tokenizer.send(encode(self._step()))
            await asyncio.sleep(self.step_s)

    def _take(self, msg) -> None:
        if isinstance(msg, AbortRequest):
            self.aborts.append(msg)
            self.requests.pop(msg.req_id, None)
            self._tokens.pop(msg.req_id, None)
            return
        # as the scheduler does: each choice of the prompt is a request, seeded ``seed + i``
        for i, req_id in enumerate((msg.req_id, *msg.fork_req_ids)):
            choice = msgspec.structs.replace(msg, req_id=req_id, fork_req_ids=[],
                                             sampling=msg.sampling.with_seed_offset(i))
            self.received.append(choice)
            self.requests[req_id] = choice
            self._tokens[req_id] = list(msg.forced_token_ids)  # a continuation goes on after them

    def _step(self) -> TokenBatch:
        deltas = []
        for req_id, req in list(self.requests.items()):
            out = self._tokens[req_id]
            script = self.script(req)
            token = script[len(out)] if len(out) < len(script) else req.eos_token_id
            out.append(token)
            sp = req.sampling
            finish = None
            if token in sp.stop_token_ids or token == req.eos_token_id:
                finish = "stop"
            elif len(out) >= (sp.max_tokens or self.max_model_len - len(req.prompt_token_ids)):
                finish = "length"
            first = len(out) == len(req.forced_token_ids) + 1
            deltas.append(TokenDelta(
                req_id=req_id,
                token_ids=[token],
                logprobs=None if sp.engine_logprobs is None else [_fake_logprobs(token, sp.engine_logprobs)],
                prompt_logprobs=_fake_prompt_logprobs(req) if first and sp.prompt_logprobs is not None else None,
                finish_reason=finish,
                num_prompt_tokens=len(req.prompt_token_ids) if first else 0,
            ))
            if finish:
                del self.requests[req_id], self._tokens[req_id]
        self._step_id += 1
        return TokenBatch(step_id=self._step_id, deltas=deltas)


def _fake_logprobs(token: int, num_top: int) -> TokenLogprobs:
    top = [token] + [t for t in (220, 28, 30) if t != token]
    top = top[:num_top]
    return TokenLogprobs(token, -0.25, 1, top, [-0.25 - i for i in range(len(top))])


def _fake_prompt_logprobs(req: EngineRequest) -> list:
    return [None] + [_fake_logprobs(t, req.sampling.prompt_logprobs) for t in req.prompt_token_ids[1:]]


def script_tokens(text: str = SCRIPT_TEXT) -> Callable[[EngineRequest], list[int]]:
    ids = text_tokenizer().hf.encode(text)
    return lambda req: ids


class FrontHalf:
    """The real tokenizer service, a scripted scheduler, and a gateway service (not yet serving
    HTTP: tests wrap ``gateway_app`` in aiohttp's test server)."""

    def __init__(self, ctx, endpoints, tokenizer_service, scheduler, gateway_service, app, tasks):
        self.ctx, self.endpoints, self.tasks = ctx, endpoints, tasks
        self.tokenizer, self.scheduler, self.gateway, self.app = tokenizer_service, scheduler, gateway_service, app


@asynccontextmanager
async def front_half(script=None, api_key: str | None = None, served_model_name: str | None = None,
                     max_model_len: int | None = None, step_s: float = 0.005, **gateway_options):
    from folio.services.gateway.app import build_app
    from folio.services.gateway.service import GatewayService
    from folio.services.tokenizer.service import TokenizerService

    run_dir = short_run_dir()
    endpoints = Endpoints.ipc(run_dir)
    ctx = zmq.asyncio.Context()
    tokenizer = text_tokenizer()
    if max_model_len is not None:
        tokenizer = _with_max_model_len(tokenizer, max_model_len)
    tok_service = TokenizerService(TokenizerConfig(endpoints=endpoints), tokenizer, ctx)
    scheduler = ScriptedScheduler(ctx, endpoints, script or script_tokens(), step_s, tokenizer.max_model_len)
    gw_service = GatewayService(GatewayConfig(endpoints=endpoints, api_key=api_key,
                                              served_model_name=served_model_name, admin_timeout_s=0.1,
                                              probed_services=("tokenizer",), **gateway_options), ctx)
    app = build_app(gw_service)

    async def until_probed(app):
        # a busy machine may start the tokenizer's admin socket after the gateway's first probe:
        # the test's first request must not meet a 503 for a service that is merely starting
        await wait_for(lambda: not gw_service.health.down(), timeout_s=60.0)
        yield

    app.cleanup_ctx.append(until_probed)  # after the gateway's own start
    tasks = [asyncio.ensure_future(tok_service.run()), asyncio.ensure_future(scheduler.run())]
    try:
        yield FrontHalf(ctx, endpoints, tok_service, scheduler, gw_service, app, tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        tok_service.close()
        scheduler.recv_from_tokenizer.close(linger=0)
        scheduler.send_to_tokenizer.close(linger=0)
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


def _with_max_model_len(tokenizer, max_model_len: int):
    import copy

    clone = copy.copy(tokenizer)
    clone.max_model_len = max_model_len
    return clone


async def admin_call(ctx, address: str, command: str, timeout_s: float = 5.0) -> AdminReply:
    reply = await ask_admin(ctx, address, command, None, timeout_s, QUIET)
    assert reply is not None, f"{address} did not answer {command!r} within {timeout_s}s"
    return reply


async def wait_for(predicate, timeout_s: float = 5.0, interval_s: float = 0.01) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval_s)
