"""The gateway's aiohttp application and its lifetime: sockets up, HTTP up, serve, both down.

``main.py`` runs ``serve(config)``; tests build ``build_app(service)`` and drive it with aiohttp's
test client or a real port.
"""

from __future__ import annotations

import asyncio

import structlog
from aiohttp import web

from folio.services.gateway import messages_api, pooling_api, request_spans, responses_api
from folio.services.gateway.dashboard import add_dashboard_routes
from folio.services.gateway.routes import SERVICE, add_routes, auth_middleware, error_middleware
from folio.services.gateway.service import GatewayService
from folio.shared.config import GatewayConfig

log = structlog.get_logger()  # lazy: takes the config setup_logging makes in main
# connections the kernel queues until the loop accepts them (aiohttp's default is 128): past it a
# new connection's handshake is dropped and the client sends it again a second or more later, so
# hundreds of clients connecting at once would wait seconds; 2048 is uvicorn's default
LISTEN_BACKLOG = 2048


def body_limit(max_bytes: int, timeout_s: float):
    """A request that declares a body over ``max_bytes`` is a 413 before one byte of it is read
    (aiohttp's ``client_max_size`` stops the rest, which declare nothing, at the limit); a body not
    all in within ``timeout_s`` (a client sending a byte a second) is a 408 and the connection
    closes. Nothing reaches the engine before its body is whole, so a slow client holds no slot."""

    def error(status: int, message: str, code: str) -> web.Response:
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
        return web.json_response(body, status=status, headers={"Connection": "close"})

    @web.middleware
    async def check(request: web.Request, handler):
        if request.content_length is not None and request.content_length > max_bytes:
            return error(413, f"the request body is {request.content_length} bytes; the limit is {max_bytes} "
                         "(--max-request-bytes)", "request_too_large")
        if request.can_read_body:
            try:  # aiohttp keeps what it read: the handler's own read() returns it at once
                await asyncio.wait_for(request.read(), timeout_s)
            except asyncio.TimeoutError:
                return error(408, f"the request body did not arrive within {timeout_s:g} s", "request_timeout")
        return await handler(request)

    return check


def build_app(service: GatewayService) -> web.Application:
    traced = getattr(service, "tracing", None)  # --otlp-traces-endpoint: the request spans around the rest
    app = web.Application(middlewares=[*([request_spans.middleware(traced)] if traced else []), error_middleware,
                                       # the key first: a stranger's body is never read
                                       auth_middleware(service.config.api_key),
                                       body_limit(service.config.max_body_bytes, service.config.body_timeout_s),
                                       pooling_api.task_middleware(service.config)],
                          client_max_size=service.config.max_body_bytes)
    app[SERVICE] = service
    add_routes(app)
    responses_api.add_routes(app)
    messages_api.add_routes(app)
    pooling_api.add_routes(app)
    add_dashboard_routes(app, service)

    async def lifetime(app: web.Application):
        await service.start()
        yield
        await service.stop()

    app.cleanup_ctx.append(lifetime)
    return app


def runner_options(config: GatewayConfig) -> dict:
    """The HTTP server's options. Handler cancellation: a client that hangs up mid-request cancels
    its handler, whose ``finally`` aborts the request (and so frees its KV blocks) without waiting
    for a write to fail. ``keepalive_timeout``: aiohttp closes a connection that is waiting for a
    request (none begun, or headers not yet whole) that long after it opened or after its last
    response: a client sending its headers a byte a second is dropped there, before any handler,
    holding no engine slot (the body has ``body_timeout_s``, a 408)."""
    return {"handler_cancellation": True, "access_log": None, "shutdown_timeout": 1.0,
            "keepalive_timeout": config.header_timeout_s}


async def serve(config: GatewayConfig) -> None:
    """Serve HTTP until cancelled (``run_until_signal`` cancels it on SIGTERM/SIGINT). Then stop
    listening, give open requests ``drain_timeout_s`` to finish (new ones on open connections get
    503), cancel what is left (their handlers abort them) and close the sockets."""
    service = GatewayService(config)
    app = build_app(service)
    runner = web.AppRunner(app, **runner_options(config))
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=LISTEN_BACKLOG)
    await site.start()
    log.info("gateway listening", host=config.host, port=config.port, model=config.model_name)
    try:
        await asyncio.Event().wait()
    finally:
        await drain(service, site, config.drain_timeout_s)
        await runner.cleanup()


async def drain(service: GatewayService, site: web.TCPSite, timeout_s: float) -> None:
    """Stop listening and let open requests finish; past ``timeout_s`` the rest end with an error
    (an error event, then the end of the stream) instead of a cut connection."""
    service.draining = True  # requests on connections still open get 503
    log.info("draining", num_open=service.num_open, drain_timeout_s=timeout_s)
    await site.stop()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while service.num_open and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if service.num_open:
        num = service.fail_all("the server is shutting down; retry the request", 503)
        log.warning("drain deadline passed: open requests end with an error", num_requests=num)
        deadline = loop.time() + 1.5  # their handlers write the error event and end the streams
        while service.num_open and loop.time() < deadline:
            await asyncio.sleep(0.05)
