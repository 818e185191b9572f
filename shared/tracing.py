"""OpenTelemetry traces of requests across the services: off unless ``--otlp-traces-endpoint URL``.

``folio serve`` forwards the flag to every service that records spans; each one that has it makes a
``Tracing`` (``setup``): an SDK ``TracerProvider`` for ``service.name`` ``folio-<service>`` whose
batch processor posts the spans as OTLP/HTTP protobuf to ``URL/v1/traces`` (the OTLP HTTP
exporter's path) from a thread of its own, so a slow collector never holds a request up.

More in docs/modules.md (shared/tracing.py).
"""

from __future__ import annotations

import re
import time

TRACEPARENT = "traceparent"  # the W3C header
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
SCHEDULE_DELAY_MS = 500  # how long a finished span may wait before its batch is posted


def parse_traceparent(value: str | None):
    """A W3C ``traceparent`` as a remote ``SpanContext``; None when absent or malformed (a bad header
    starts a new trace rather than failing the request)."""
    if not value or not isinstance(value, str):
        return None
    m = _TRACEPARENT.match(value.strip().lower())
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    from opentelemetry.trace import SpanContext, TraceFlags

    return SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16)))


def traceparent_of(span) -> str | None:
    """The W3C ``traceparent`` naming ``span`` (None for a span that has no valid context)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def now_ns() -> int:
    """Wall-clock nanoseconds: what span times are in (comparable across the services' processes)."""
    return time.time_ns()


class Tracing:
    """One service's tracer. ``start`` opens a span (end it with ``span.end()``); ``record`` makes a
    finished span from times measured elsewhere."""

    def __init__(self, provider, service: str):
        self.provider = provider
        self.service = service
        self.tracer = provider.get_tracer(f"folio.{service}")

    def _context(self, parent):
        from opentelemetry import trace

        if parent is None:
            return None
        if isinstance(parent, str):
            parent = parse_traceparent(parent)
            if parent is None:
                return None
            return trace.set_span_in_context(trace.NonRecordingSpan(parent))
        return trace.set_span_in_context(parent)  # a span of ours

    def start(self, name: str, parent=None, start_ns: int | None = None, attributes: dict | None = None,
              kind: str = "internal"):
        """A span named ``name`` (it should start with this service's name), the child of ``parent``
        (a traceparent string, a span, or None for a root), open until ``span.end()``."""
        from opentelemetry.trace import SpanKind

        return self.tracer.start_span(name, context=self._context(parent), kind=getattr(SpanKind, kind.upper()),
                                      attributes=_clean(attributes), start_time=start_ns)

    def record(self, name: str, parent, start_ns: int, end_ns: int, attributes: dict | None = None) -> None:
        """A finished span over ``[start_ns, end_ns]``."""
        span = self.start(name, parent, start_ns, attributes)
        span.end(end_time=max(start_ns, end_ns))

    def flush(self, timeout_ms: int = 5000) -> bool:
        return self.provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        self.provider.shutdown()


def _clean(attributes: dict | None) -> dict | None:
    """OpenTelemetry takes no None values: those attributes are left out."""
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None}


def setup(endpoint: str | None, service: str) -> Tracing | None:
    """The service's ``Tracing`` exporting to ``endpoint`` (an OTLP/HTTP collector's base URL), or
    None when tracing is off (no endpoint). Raises ``RuntimeError`` for an endpoint that is not an
    http(s) URL, or when the OpenTelemetry SDK or its OTLP exporter is not installed."""
    if not endpoint:
        return None
    if not endpoint.startswith(("http://", "https://")):
        raise RuntimeError(f"--otlp-traces-endpoint takes an OTLP/HTTP collector's http:// or https:// URL, "
                           f"not {endpoint!r}")
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError("--otlp-traces-endpoint needs opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http "
                           "(pip install 'folio[tracing]')") from exc
    provider = TracerProvider(resource=Resource.create({"service.name": f"folio-{service}",
                                                        "service.namespace": "folio"}))
    exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=SCHEDULE_DELAY_MS))
    return Tracing(provider, service)


def traces_url(endpoint: str) -> str:
    """Where spans are posted: ``endpoint`` + ``/v1/traces`` (unless it names that path already)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"
