"""The gateway's spans (``folio.shared.tracing``; only with ``--otlp-traces-endpoint``).

``middleware(service)`` opens ``gateway.request`` around each generation request (the child of the
client's span when it sent a W3C ``traceparent`` header, else a root) and keeps it in a context
variable for the handler's task; ``GatewayService.submit`` reads it (``current()``) to put the
span's ``traceparent`` into the request's ``GenerateRequest``s, so the later stages are its
children. When the response is over it records ``gateway.stream``: from the first output of the
request to the end of the response (SSE events or the JSON body), and ends the request span with
the HTTP status and the token counts.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass

from aiohttp import web

from folio.shared.tracing import TRACEPARENT, Tracing, now_ns, traceparent_of

TRACED_PATHS = frozenset(("/v1/completions", "/v1/chat/completions"))


@dataclass
class HttpRequestSpan:
    span: object
    traceparent: str | None
    mailbox: object = None  # set by ``submit``: its choices' timing says when output began


_current: contextvars.ContextVar[HttpRequestSpan | None] = contextvars.ContextVar("folio_request_trace", default=None)


def current() -> HttpRequestSpan | None:
    """The traced request the running handler serves (None: tracing off, or another route)."""
    return _current.get()


def middleware(tracing: Tracing | None):
    """The aiohttp middleware that traces the generation routes; with tracing off, one that only
    passes requests on."""

    @web.middleware
    async def trace_request(request: web.Request, handler):
        if tracing is None or request.path not in TRACED_PATHS:
            return await handler(request)
        span = tracing.start("gateway.request", request.headers.get(TRACEPARENT), kind="server",
                             attributes={"http.request.method": request.method, "url.path": request.path,
                                         "client.traceparent": request.headers.get(TRACEPARENT)})
        trace = HttpRequestSpan(span, traceparent_of(span))
        token = _current.set(trace)
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            _current.reset(token)
            end = now_ns()
            _record_stream(tracing, trace, end)
            span.set_attribute("http.response.status_code", status)
            span.end(end_time=end)

    return trace_request


def _record_stream(tracing: Tracing, trace: HttpRequestSpan, end_ns: int) -> None:
    mailbox = trace.mailbox
    if mailbox is None:
        return
    firsts = [t.first_token for t in mailbox.timing.values() if t.first_token is not None]
    num_tokens = sum(len(ids) for ids in mailbox.token_ids.values())
    trace.span.set_attribute("gen_ai.usage.output_tokens", num_tokens)
    trace.span.set_attribute("folio.num_choices", len(mailbox.timing))
    if mailbox.lora_name is not None:
        trace.span.set_attribute("folio.lora_name", mailbox.lora_name)
    if not firsts:
        return
    start_ns = end_ns - int((time.monotonic() - min(firsts)) * 1e9)  # its monotonic time on the wall clock
    tracing.record("gateway.stream", trace.span, start_ns, end_ns,
                   {"folio.output_tokens": num_tokens, "folio.stream": bool(mailbox.reqs and mailbox.reqs[0].stream)})
