"""The router service: OpenAI-compatible HTTP in front of many replicas, each request proxied to
the replica ``routing.Router`` picks, streams passed through as they come.

Who talks to it: clients over HTTP (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``, ``/metrics``); ``folio router stats|replicas`` on its admin ROUTER
(``Endpoints.admin_router``). It talks to the replicas' gateways over HTTP and to their kvmanagers
over ZeroMQ (``replicas.py``).

Failures: a replica that refuses the connection, drops it, or answers 502/503/504 before the
answer began is left for another (up to ``max_attempts`` replicas); one whose connection failed is
marked down, so new work goes elsewhere. A stream is only forwarded once its first bytes arrived,
so a replica that dies before its first token costs the client nothing but time. A stream cut
after it began ends there (the client holds part of an answer; retrying would repeat it).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import structlog
import zmq
import zmq.asyncio
from aiohttp import web

from folio.services.router.index import KVIndex
from folio.services.router.metrics import RouterMetrics
from folio.services.router.prompt import PromptEncoder
from folio.services.router.replicas import Replica, ReplicaSet
from folio.services.router.routing import Decision, Router
from folio.shared.config import RouterConfig
from folio.shared.loops import close_sockets, serve_admin
from folio.shared.transport import make_socket

log = structlog.get_logger()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_PASSED_HEADERS = ("Authorization", "Content-Type", "Accept")
_RETRY_STATUSES = (502, 503, 504)  # the replica cannot take it now (draining, overloaded, gone)
REPLICA_HEADER = "X-Folio-Replica"  # which replica answered: for clients' logs, and tests


class _Retry(Exception):
    """This replica did not start answering: try another."""


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": None}},
                             status=status)


class RouterService:
    def __init__(self, config: RouterConfig, encoder: PromptEncoder | None, ctx: zmq.asyncio.Context):
        self.config = config
        self.encoder = encoder
        self.metrics = RouterMetrics()
        self.index = KVIndex()
        self.replicas = ReplicaSet(config, self.index, self.metrics, ctx)
        self.router = Router(self.index, config.policy, config.load_cost_tokens, config.block_size)
        self.recv_from_admin = make_socket(ctx, zmq.ROUTER, config.endpoints.admin_router)
        self.session: aiohttp.ClientSession | None = None
        self.counts = {"num_requests": 0, "num_routed": 0, "num_cache_aware_hits": 0, "num_retries": 0,
                       "num_failed": 0, "num_broken_streams": 0}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_route)
        return app

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
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return error_response(400, "the body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object")
        self.counts["num_requests"] += 1
        token_ids = None
        if self.encoder is not None and self.config.policy == "cache_aware":
            token_ids = await asyncio.to_thread(self.encoder.token_ids, body, request.path.endswith("/chat/completions"))
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        tried: set[str] = set()
        for _ in range(self.config.max_attempts):
            decision = self.router.choose(list(self.replicas.replicas.values()), token_ids, salt, tried)
            if decision is None:
                break
            tried.add(decision.replica.name)
            self._count(decision, token_ids)
            decision.replica.num_inflight += 1
            try:
                return await self._forward(request, decision.replica, raw)
            except _Retry as retry:
                self.counts["num_retries"] += 1
                self.metrics.retries.labels(decision.replica.name, str(retry)).inc()
                log.info("retrying on another replica", replica=decision.replica.name, cause=str(retry))
            finally:
                decision.replica.num_inflight -= 1
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

    async def _forward(self, request: web.Request, replica: Replica, raw: bytes) -> web.StreamResponse:
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
            return await self._pass_stream(request, replica, upstream, payload)
        finally:
            upstream.release()

    async def _open(self, request: web.Request, replica: Replica, raw: bytes) -> tuple[aiohttp.ClientResponse, bytes]:
        """Send the request: (the response, its whole body or, for a stream, its first bytes)."""
        headers = {h: request.headers[h] for h in _PASSED_HEADERS if h in request.headers}
        upstream = await self.session.post(replica.name + request.path, data=raw, headers=headers)
        try:
            if upstream.status in _RETRY_STATUSES:
                raise _Retry(f"http_{upstream.status}")
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
                           first: bytes) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, headers={
            "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"), "Cache-Control": "no-cache",
            REPLICA_HEADER: replica.name})
        await response.prepare(request)
        await response.write(first)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as exc:
            # too late to retry: the client has part of the answer. Its stream just ends.
            self.counts["num_broken_streams"] += 1
            self.metrics.broken_streams.labels(replica.name).inc()
            self.replicas.mark_down(replica, f"stream: {type(exc).__name__}: {exc}")
        await response.write_eof()
        return response

    async def models(self, request: web.Request) -> web.Response:
        for replica in self.replicas.live():
            try:
                async with self.session.get(replica.name + "/v1/models", headers={
                        h: request.headers[h] for h in _PASSED_HEADERS if h in request.headers}) as upstream:
                    return web.Response(status=upstream.status, body=await upstream.read(),
                                        headers={"Content-Type": upstream.headers.get("Content-Type", "")})
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self.replicas.mark_down(replica, f"models: {type(exc).__name__}: {exc}")
        return error_response(503, "no replica is up", "service_unavailable")

    async def health(self, request: web.Request) -> web.Response:
        num_up = len(self.replicas.live())
        return web.json_response({"status": "ok" if num_up else "no replica up", "num_replicas_up": num_up,
                                  "num_replicas": len(self.replicas.replicas)}, status=200 if num_up else 503)

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # ------------------------------------------------------------------ admin
    def admin_stats(self, args: dict) -> dict:
        return {"policy": self.config.policy, "num_replicas": len(self.replicas.replicas),
                "num_replicas_up": len(self.replicas.live()), **self.counts}

    def admin_replicas(self, args: dict) -> dict:
        rows = []
        for replica in sorted(self.replicas.replicas.values(), key=lambda r: r.name):
            view = self.index.view(replica.name)
            rows.append({"replica": replica.name, "up": replica.up, "inflight": replica.num_inflight,
                         "running": replica.num_running, "waiting": replica.num_waiting,
                         "routed": replica.num_routed, "failures": replica.num_failures,
                         "indexed_blocks": len(view.block_hashes), "in_sync": view.next_event_seq is not None,
                         "resyncs": view.num_resyncs})
        return {"replicas": rows}
