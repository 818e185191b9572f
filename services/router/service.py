"""The router service: OpenAI-compatible HTTP in front of many replicas, each request proxied to
the replica ``routing.Router`` picks, streams passed through as they come.

Who talks to it: clients over HTTP (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``, ``/metrics``); ``folio router stats|replicas`` on its admin ROUTER
(``Endpoints.admin_router``). It talks to the replicas' gateways over HTTP and to their kvmanagers
over ZeroMQ (``replicas.py``).

More in docs/modules.md (services/router/service.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json

import aiohttp
import structlog
import zmq
import zmq.asyncio
from aiohttp import web

from folio.services.router.disagg import Disaggregated
from folio.services.router.index import KVIndex
from folio.services.router.metrics import RouterMetrics
from folio.services.router.prompt import PromptEncoder, PromptEncoders
from folio.services.router.replicas import Replica, ReplicaSet, read_models
from folio.services.router.resume import ClientGone, ResumableStream, to_client
from folio.services.router.routing import Decision, Router
from folio.shared.config import RouterConfig
from folio.services.shell import serve_admin
from folio.shared.transport import close_sockets
from folio.shared.tracing import TRACEPARENT, setup as tracing_setup, traceparent_of
from folio.shared.transport import make_socket

log = structlog.get_logger()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# a client's trace context goes on to the replica (with tracing on: the ``router.forward`` span's)
_PASSED_HEADERS = ("Authorization", "x-api-key", "anthropic-version", "Content-Type", "Accept", TRACEPARENT,
                   "tracestate")
# a stored response lives in the one replica that made it: a chained request, or a read of one, tries
# the replicas in turn and takes a 404 from one as "not here" (``_Retry``)
CHAINED_PATHS = ("/v1/responses",)
ROOT_SPAN, FORWARD_TRACEPARENT = "folio.router_span", "folio.forward_traceparent"  # keys on the aiohttp request
_RETRY_STATUSES = (502, 503, 504)  # the replica cannot take it now (draining, overloaded, gone)
REPLICA_HEADER = "X-Folio-Replica"  # which replica answered: for clients' logs, and tests


_CHAINED, _NOT_FOUND = "folio.chained", "folio.not_found"  # keys on the aiohttp request



# the pooling routes a replica serves with --task embed: one leg, prefill only, even with --prefill/--decode
POOLING_PATHS = ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score")

class _Retry(Exception):
    """This replica did not start answering: try another."""


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status)


class RouterService:
    def __init__(self, config: RouterConfig, encoder: PromptEncoder | None, ctx: zmq.asyncio.Context):
        self.config = config
        self.encoders = PromptEncoders(encoder if config.policy == "cache_aware" else None, config.model)
        self.metrics = RouterMetrics()
        self.index = KVIndex()
        self.replicas = ReplicaSet(config, self.index, self.metrics, ctx)
        self.router = Router(self.index, config.policy, config.load_cost_tokens, config.block_size)
        self.recv_from_admin = make_socket(ctx, zmq.ROUTER, config.endpoints.admin_router)
        self.session: aiohttp.ClientSession | None = None
        self.tracing = tracing_setup(config.otlp_traces_endpoint, "router")  # None: off
        self.disagg = Disaggregated(self) if config.prefill else None
        self.counts = {"num_requests": 0, "num_routed": 0, "num_cache_aware_hits": 0, "num_retries": 0,
                       "num_failed": 0, "num_broken_streams": 0, "num_unknown_model": 0, "num_resumed_streams": 0,
                       "num_client_disconnects": 0}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20, middlewares=[self.check_key])
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/v1/responses", self.generate)  # both through chat's path on the replica
        app.router.add_post("/v1/messages", self.generate)
        app.router.add_post("/v1/messages/count_tokens", self.generate)
        for path in POOLING_PATHS:  # embeddings, rerank and score: a replica served with --task embed answers
            app.router.add_post(path, self.generate)
        app.router.add_get("/v1/responses/{response_id}", self.stored_response)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_route)
        return app

    @web.middleware
    async def check_key(self, request: web.Request, handler):
        """``--api-key``: the /v1/ routes want it, as a gateway's do (401 in the OpenAI error shape)."""
        key = self.config.api_key
        if key and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "")
            anthropic_key = request.headers.get("x-api-key", "")  # Anthropic's clients send the key here
            if not (hmac.compare_digest(given.encode(), f"Bearer {key}".encode())
                    or hmac.compare_digest(anthropic_key.encode(), key.encode())):
                return web.json_response({"error": {"message": "Incorrect API key provided.", "type":
                                                    "invalid_request_error", "param": None, "code": "invalid_api_key"}},
                                         status=401)
        return await handler(request)

    async def run(self) -> None:
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=self.config.connect_timeout_s))
        try:
            await web.TCPSite(runner, self.config.host, self.config.port).start()
            log.info("router listening", host=self.config.host, port=self.config.port, policy=self.config.policy,
                     replicas=list(self.config.replicas), replica_dns=self.config.replica_dns)
            await asyncio.gather(self.replicas.run(self.session),
                                 serve_admin(self.recv_from_admin, {"stats": self.admin_stats,
                                                                    "replicas": self.admin_replicas}, log))
        finally:
            await self.session.close()
            await runner.cleanup()
            close_sockets(self.recv_from_admin)

    # ------------------------------------------------------------------ routes
    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.tracing is None:
            return await self._generate(request)
        span = self.tracing.start("router.request", request.headers.get(TRACEPARENT), kind="server",
                                  attributes={"url.path": request.path})
        request[ROOT_SPAN] = span
        try:
            response = await self._generate(request)
            span.set_attribute("http.response.status_code", response.status)
            return response
        finally:
            span.end()

    def _start_forward(self, request: web.Request, decision: Decision, attempt: int, lora_name: str | None):
        """Tracing on: the ``router.forward`` span of one attempt; the replica gets its context."""
        span = self.tracing.start("router.forward", request[ROOT_SPAN], kind="client", attributes={
            "folio.replica": decision.replica.name, "folio.route_reason": decision.reason,
            "folio.cached_tokens": decision.num_cached_tokens, "folio.attempt": attempt, "folio.lora_name": lora_name})
        request[FORWARD_TRACEPARENT] = traceparent_of(span)
        return span

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return error_response(400, "the body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object")
        self.counts["num_requests"] += 1
        model = body.get("model") if isinstance(body.get("model"), str) else None
        candidates, entry = self.replicas.serving(model)
        if not candidates and model is not None:
            await self.replicas.refresh_models(model, self.config.poll_interval_s)  # loaded since the last poll?
            candidates, entry = self.replicas.serving(model)
        if not candidates and model is not None:
            self.counts["num_unknown_model"] += 1
            self.metrics.failed.labels("model_not_found").inc()
            return error_response(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        lora_name = entry.id if entry is not None and entry.parent is not None else None
        base = self.replicas.base_of(entry) if entry is not None else None
        token_ids = None
        encoder = await self.encoders.for_model(base, len(self.replicas.base_models()))
        if encoder is not None:
            token_ids = await asyncio.to_thread(encoder.token_ids, body, request.path.endswith("/chat/completions"))
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        if self.disagg is not None and request.path not in POOLING_PATHS:  # --prefill/--decode: two legs (``disagg.py``)
            return await self.disagg.generate(request, body, token_ids, salt)
        tried: set[str] = set()
        # a stream cut mid-way goes on elsewhere (``resume.py``): OpenAI's completion and chat chunks only
        resume = ResumableStream.for_body(body) if request.path in ("/v1/completions", "/v1/chat/completions") else None
        if request.path in CHAINED_PATHS and isinstance(body.get("previous_response_id"), str):
            request[_CHAINED] = True
        if resume is not None:
            raw = resume.first_body()

            def pick():
                decision = self.router.choose(candidates, token_ids, salt, tried, lora_name)
                if decision is not None:
                    tried.add(decision.replica.name)
                return decision
            resume.pick = pick
        attempts = max(self.config.max_attempts, len(candidates)) if request.get(_CHAINED) else self.config.max_attempts
        for _ in range(attempts):
            decision = self.router.choose(candidates, token_ids, salt, tried, lora_name)
            if decision is None:
                break
            tried.add(decision.replica.name)
            self._count(decision, token_ids)
            if entry is not None:
                active = "" if lora_name is None else str(decision.replica.has_adapter_active(lora_name)).lower()
                self.metrics.model_requests.labels(entry.id, active).inc()
            decision.replica.num_inflight += 1
            if lora_name is not None:
                adapters = decision.replica.inflight_adapters
                adapters[lora_name] = adapters.get(lora_name, 0) + 1
            forward = self._start_forward(request, decision, len(tried), lora_name) if self.tracing else None
            try:
                return await self._forward(request, decision.replica, raw, resume)
            except _Retry as retry:
                if forward is not None:
                    forward.set_attribute("folio.retry", str(retry))
                self.counts["num_retries"] += 1
                self.metrics.retries.labels(decision.replica.name, str(retry)).inc()
                log.info("retrying on another replica", replica=decision.replica.name, cause=str(retry))
            finally:
                if forward is not None:
                    forward.end()
                decision.replica.num_inflight -= 1
                if lora_name is not None:
                    adapters = decision.replica.inflight_adapters
                    adapters[lora_name] -= 1
                    if not adapters[lora_name]:
                        del adapters[lora_name]
        if _NOT_FOUND in request:  # no replica holds the previous response
            return web.Response(status=404, body=request[_NOT_FOUND], content_type="application/json")
        self.counts["num_failed"] += 1
        cause = "all_failed" if tried else "no_replica_up"
        self.metrics.failed.labels(cause).inc()
        return error_response(503, f"no replica could take the request ({cause.replace('_', ' ')})",
                              "service_unavailable")

    def _count(self, decision: Decision, token_ids: list[int] | None) -> None:
        decision.replica.num_routed += 1
        self.counts["num_routed"] += 1
        self.metrics.routed.labels(decision.replica.name, decision.reason).inc()
        self.metrics.prompt_tokens.inc(len(token_ids or ()))
        if decision.reason == "cache":
            self.counts["num_cache_aware_hits"] += 1
            self.metrics.cache_hits.inc()
            self.metrics.cached_tokens.inc(decision.num_cached_tokens)

    async def _forward(self, request: web.Request, replica: Replica, raw: bytes,
                       resume: ResumableStream | None = None) -> web.StreamResponse:
        """Proxy one attempt. Until the replica begins to answer, its going down (a failed poll, or
        another request's failure) abandons the attempt for another replica: a hung replica holds
        no request longer than it takes to notice."""
        opening = asyncio.ensure_future(self._open(request, replica, raw))
        gone = asyncio.ensure_future(replica.went_down.wait())
        try:
            await asyncio.wait({opening, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not opening.done():
                opening.cancel()
                await asyncio.gather(opening, return_exceptions=True)
        if opening.cancelled():
            raise _Retry("replica_down")
        try:
            upstream, payload = opening.result()
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as exc:
            self.replicas.mark_down(replica, f"request: {type(exc).__name__}: {exc}")
            raise _Retry(type(exc).__name__) from exc
        try:
            if upstream.content_type != "text/event-stream":
                return web.Response(status=upstream.status, body=payload, headers={
                    "Content-Type": upstream.headers.get("Content-Type", ""), REPLICA_HEADER: replica.name})
            return await self._pass_stream(request, replica, upstream, payload, resume)
        finally:
            upstream.release()

    async def _open(self, request: web.Request, replica: Replica, raw: bytes) -> tuple[aiohttp.ClientResponse, bytes]:
        """Send the request: (the response, its whole body or, for a stream, its first bytes)."""
        headers = {h: request.headers[h] for h in _PASSED_HEADERS if h in request.headers}
        if FORWARD_TRACEPARENT in request:
            headers[TRACEPARENT] = request[FORWARD_TRACEPARENT]
            headers.pop("tracestate", None)
        upstream = await self.session.post(replica.name + request.path, data=raw, headers=headers)
        try:
            if upstream.status in _RETRY_STATUSES:
                raise _Retry(f"http_{upstream.status}")
            if upstream.status == 404 and request.get(_CHAINED):
                request[_NOT_FOUND] = await upstream.read()
                raise _Retry("previous_response_elsewhere")
            if upstream.content_type != "text/event-stream":
                return upstream, await upstream.read()
            first = await upstream.content.readany()
            if not first:
                raise aiohttp.ServerDisconnectedError("the stream closed before its first bytes")
            return upstream, first
        except BaseException:
            upstream.close()  # abandoned: the replica sees the client go and aborts the request
            raise

    async def _pass_stream(self, request: web.Request, replica: Replica, upstream: aiohttp.ClientResponse,
                           first: bytes, resume: ResumableStream | None = None) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, headers={
            "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"), "Cache-Control": "no-cache",
            REPLICA_HEADER: replica.name})
        try:
            await response.prepare(request)
            if resume is not None:
                await resume.relay(self, request, response, replica, upstream, first, resume.pick)
                await response.write_eof()
                return response
            await to_client(response, first)
            try:
                async for chunk in upstream.content.iter_any():
                    await to_client(response, chunk)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as exc:
                # too late to retry: the client has part of the answer. Its stream just ends.
                self.counts["num_broken_streams"] += 1
                self.metrics.broken_streams.labels(replica.name).inc()
                self.replicas.mark_down(replica, f"stream: {type(exc).__name__}: {exc}")
            await response.write_eof()
        except (ClientGone, ConnectionError) as exc:
            # the client left: the replica is fine; closing its connection makes it abort the request
            upstream.close()
            self.counts["num_client_disconnects"] += 1
            log.info("client closed its stream", replica=replica.name, cause=str(exc))
        return response

    async def stored_response(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{id}``: the one replica that stored it answers; the others say 404."""
        headers = {h: request.headers[h] for h in _PASSED_HEADERS if h in request.headers}
        last = None
        for replica in self.replicas.live():
            try:
                async with self.session.get(replica.name + request.path, headers=headers) as upstream:
                    last = (upstream.status, upstream.headers.get("Content-Type", ""), await upstream.read())
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
            if last[0] != 404:
                break
        if last is None:
            return error_response(503, "no replica is up", "service_unavailable")
        return web.Response(status=last[0], body=last[2], headers={"Content-Type": last[1]})

    async def models(self, request: web.Request) -> web.Response:
        headers = {h: request.headers[h] for h in _PASSED_HEADERS if h in request.headers}
        answers = await asyncio.gather(*(self._models_of(r, headers) for r in self.replicas.live()))
        data, seen, refusal = [], set(), None
        for replica, answer in answers:
            if answer is None:
                continue
            status, content_type, payload = answer
            try:
                models = read_models(json.loads(payload)) if status == 200 else None
            except ValueError:
                models = None
            if models is None:
                refusal = refusal or answer  # a 401 (the replicas want a key) is the client's to see
                continue
            self.replicas.set_models(replica, models)
            for item in json.loads(payload)["data"]:
                if isinstance(item, dict) and item.get("id") not in seen:
                    seen.add(item.get("id"))
                    data.append(item)
        if data or (refusal is None and any(answer is not None for _, answer in answers)):
            return web.json_response({"object": "list", "data": data})
        if refusal is not None:
            status, content_type, payload = refusal
            return web.Response(status=status, body=payload, headers={"Content-Type": content_type})
        return error_response(503, "no replica is up", "service_unavailable")

    async def _models_of(self, replica: Replica, headers: dict) -> tuple[Replica, tuple[int, str, bytes] | None]:
        try:
            async with self.session.get(replica.name + "/v1/models", headers=headers) as upstream:
                return replica, (upstream.status, upstream.headers.get("Content-Type", ""), await upstream.read())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.replicas.mark_down(replica, f"models: {type(exc).__name__}: {exc}")
            return replica, None

    async def health(self, request: web.Request) -> web.Response:
        num_up = len(self.replicas.live())
        return web.json_response({"status": "ok" if num_up else "no replica up", "num_replicas_up": num_up,
                                  "num_replicas": len(self.replicas.replicas)}, status=200 if num_up else 503)

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # ------------------------------------------------------------------ admin
    def admin_stats(self, args: dict) -> dict:
        return {"policy": self.config.policy, "num_replicas": len(self.replicas.replicas),
                "num_replicas_up": len(self.replicas.live()), **self.counts,
                **(self.disagg.counts if self.disagg is not None else {})}

    def admin_replicas(self, args: dict) -> dict:
        rows = []
        for replica in sorted(self.replicas.replicas.values(), key=lambda r: r.name):
            view = self.index.view(replica.name)
            rows.append({"replica": replica.name, "up": replica.up, "inflight": replica.num_inflight,
                         "running": replica.num_running, "waiting": replica.num_waiting,
                         "routed": replica.num_routed, "failures": replica.num_failures,
                         "models": ",".join(sorted(replica.models)) if replica.models is not None else "?",
                         "indexed_blocks": len(view.block_hashes), "in_sync": view.next_event_seq is not None,
                         "resyncs": view.num_resyncs})
        return {"replicas": rows}
