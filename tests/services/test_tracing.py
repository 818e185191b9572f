"""OpenTelemetry tracing across the services: ``folio serve --otlp-traces-endpoint`` (and a router in
front of it) posting OTLP/HTTP protobuf to a receiver in this test; one request is one trace with a
span per stage and the right parent links; a client's ``traceparent`` is honoured. ``folio serve``
logs its start-up breakdown once ``/health`` is healthy."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (opentelemetry-sdk) is not installed")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from folio.shared.tracing import parse_traceparent, traces_url  # noqa: E402
from folio.testing.models import write_tiny_chat_model  # noqa: E402
from folio.testing.routerstack import ReplicaProcess, start_router  # noqa: E402
from folio.testing.server import free_port  # noqa: E402

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
MODEL = "m"  # the served name, read from /v1/models by the fixture
STAGES = ("gateway.request", "tokenizer.encode", "scheduler.queue", "executor.prefill_chunk", "executor.decode",
          "tokenizer.detokenize", "gateway.stream")


class Receiver:
    """An OTLP/HTTP collector: POST /v1/traces with a protobuf ``ExportTraceServiceRequest``."""

    def __init__(self):
        self.port = free_port()
        self.spans: list[dict] = []
        self.content_types: set[str] = set()
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        from aiohttp import web

        async def traces(request: web.Request) -> web.Response:
            body = ExportTraceServiceRequest()
            body.ParseFromString(await request.read())
            with self.lock:
                self.content_types.add(request.content_type)
                for rs in body.resource_spans:
                    service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            self.spans.append({
                                "name": s.name, "service": service, "trace_id": s.trace_id.hex(),
                                "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex() or None,
                                "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                                "attributes": {a.key: _value(a.value) for a in s.attributes}})
            return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                                content_type="application/x-protobuf")

        async def start() -> None:
            app = web.Application()
            app.router.add_post("/v1/traces", traces)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self.ready.set()

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def wait_for(self, trace_id: str, names: tuple[str, ...], timeout_s: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = self.trace(trace_id)
            if set(names) <= {s["name"] for s in spans}:
                time.sleep(0.6)  # a batch still on its way (the processors post every 0.5 s)
                return self.trace(trace_id)
            time.sleep(0.1)
        raise AssertionError(f"trace {trace_id}: only {sorted({s['name'] for s in self.trace(trace_id)})}")

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, bytes, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return resp.status, resp.read(), dict(resp.headers)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm_tokenizer_dir):
    receiver = Receiver()
    model = write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-traced"), smollm_tokenizer_dir)
    # prefills of at most 8 tokens a step: a prompt of ~30 tokens runs as several chunks
    replica = ReplicaProcess(model, ("--num-kv-blocks", "64", "--block-size", "8", "--max-num-seqs", "8",
                              "--long-prefill-token-threshold", "8", "--otlp-traces-endpoint", receiver.url))
    log = tempfile.TemporaryFile("a+")
    replica.proc = subprocess.Popen(
        [sys.executable, "-m", "folio.cli.main", "serve", "--model", model, "--host", "127.0.0.1", "--port",
         str(replica.port), "--run-dir", replica.run_dir, "--log-level", "warning", *replica.flags], stderr=log)
    router = None
    try:
        try:
            replica.wait_ready()
        except RuntimeError as exc:
            log.seek(0)
            raise RuntimeError(f"{exc}; its log:\n{log.read()[-4000:]}") from None
        router = start_router(model, [replica], "--policy", "round_robin", "--otlp-traces-endpoint", receiver.url)
        with urllib.request.urlopen(replica.url + "/v1/models", timeout=30) as resp:
            global MODEL
            MODEL = json.loads(resp.read())["data"][0]["id"]
        yield receiver, replica, router, log
    finally:
        if router is not None:
            router.stop()
        replica.cleanup()
        receiver.stop()


def _by_name(spans: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for s in spans:
        out.setdefault(s["name"], []).append(s)
    return out


PROMPT = "The quick brown fox jumps over the lazy dog, and then the dog chases the fox around the old barn " \
         "until the sun goes down behind the hills."


def test_one_request_is_one_trace_with_a_span_per_stage_under_the_clients_span(stack):
    receiver, replica, _, _ = stack
    client = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    status, body, _ = post(replica.url + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 5,
                                                             "temperature": 0, "ignore_eos": True, "stream": True},
                           {"traceparent": client})
    assert status == 200 and b"[DONE]" in body
    spans = receiver.wait_for(CLIENT_TRACE, STAGES)
    assert receiver.content_types == {"application/x-protobuf"}
    named = _by_name(spans)
    (root,) = named["gateway.request"]
    assert root["parent"] == CLIENT_SPAN  # the client's span is its parent: the client's trace goes on
    assert root["attributes"]["http.response.status_code"] == 200
    for name in STAGES[1:]:
        for span in named[name]:
            assert span["parent"] == root["span_id"], name
            assert root["start"] <= span["start"] <= span["end"] <= root["end"], name
            assert name.split(".")[0] in span["service"] or name.startswith("executor.")
    (encode,) = named["tokenizer.encode"]
    prompt_tokens = encode["attributes"]["gen_ai.usage.input_tokens"]
    assert prompt_tokens > 16
    chunks = sorted(named["executor.prefill_chunk"], key=lambda s: s["attributes"]["folio.chunk_start"])
    assert len(chunks) == -(-prompt_tokens // 8)  # one span per prefill chunk, 8 tokens each at most
    assert [c["attributes"]["folio.chunk_start"] for c in chunks] == list(range(0, prompt_tokens, 8))
    assert sum(c["attributes"]["folio.chunk_tokens"] for c in chunks) == prompt_tokens
    assert all(a["end"] <= b["start"] for a, b in zip(chunks, chunks[1:]))  # steps one after another
    (decode,) = named["executor.decode"]
    assert decode["attributes"]["gen_ai.usage.output_tokens"] == 5
    assert decode["attributes"]["folio.decode_steps"] == 4  # the first token came from the last chunk
    assert decode["attributes"]["folio.preemptions"] == 0
    assert chunks[-1]["end"] <= decode["start"]
    (queue,) = named["scheduler.queue"]
    assert queue["attributes"]["gen_ai.usage.input_tokens"] == prompt_tokens
    assert queue["end"] <= chunks[0]["end"]
    (detok,) = named["tokenizer.detokenize"]
    assert detok["attributes"]["gen_ai.usage.output_tokens"] == 5
    (stream,) = named["gateway.stream"]
    assert stream["attributes"]["folio.output_tokens"] == 5 and stream["attributes"]["folio.stream"] is True
    assert {s["service"] for s in spans} == {"folio-gateway", "folio-tokenizer", "folio-scheduler"}
    # the same prompt again: its full blocks come from the prefix cache, and the spans say so
    again = "1" * 32
    post(replica.url + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0},
         {"traceparent": f"00-{again}-{CLIENT_SPAN}-01"})
    named = _by_name(receiver.wait_for(again, STAGES))
    cached = named["scheduler.queue"][0]["attributes"]["folio.cached_tokens"]
    assert cached == (prompt_tokens - 1) // 8 * 8 > 0  # whole blocks, the last token computed again
    assert min(c["attributes"]["folio.chunk_start"] for c in named["executor.prefill_chunk"]) == cached


def test_a_request_without_traceparent_starts_its_own_trace(stack):
    receiver, replica, _, _ = stack
    before = {s["trace_id"] for s in receiver.spans}
    status, body, _ = post(replica.url + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
        "ignore_eos": True}, {"traceparent": "not-a-traceparent"})  # malformed: ignored, not an error
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        roots = [s for s in receiver.spans if s["name"] == "gateway.request" and s["trace_id"] not in before]
        if roots:
            break
        time.sleep(0.1)
    (root,) = roots
    assert root["parent"] is None
    spans = receiver.wait_for(root["trace_id"], STAGES)
    assert all(s["parent"] == root["span_id"] for s in spans if s is not root)
    assert _by_name(spans)["gateway.stream"][0]["attributes"]["folio.stream"] is False


def test_the_router_adds_its_spans_and_passes_the_trace_to_the_replica(stack):
    receiver, replica, router, _ = stack
    trace_id, client_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    status, _, headers = post(router.url + "/v1/completions", {"model": MODEL, "prompt": "hello there",
                                                                "max_tokens": 2, "temperature": 0},
                              {"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert status == 200
    spans = receiver.wait_for(trace_id, ("router.request", "router.forward", *STAGES))
    named = _by_name(spans)
    (request,), (forward,), (gateway,) = named["router.request"], named["router.forward"], named["gateway.request"]
    assert request["parent"] == client_span and request["service"] == "folio-router"
    assert forward["parent"] == request["span_id"]
    assert forward["attributes"]["folio.replica"] == replica.url == headers["X-Folio-Replica"]
    assert gateway["parent"] == forward["span_id"]  # the replica's trace hangs under the forward


def test_serve_logs_its_startup_breakdown_once_healthy(stack):
    _, _, _, log = stack
    log.seek(0)
    lines = [line for line in log.read().splitlines() if "start-up" in line]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "to a healthy /health" in line
    for part in ("kvmanager", "executor", "scheduler", "tokenizer", "gateway", "imports", "weights", "pool",
                 "kernels", "graphs", "other"):
        assert part in line, part


def test_traceparent_parsing():
    ctx = parse_traceparent(f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
    assert (ctx.trace_id, ctx.span_id, int(ctx.trace_flags)) == (int(CLIENT_TRACE, 16), int(CLIENT_SPAN, 16), 1)
    for bad in ("", "00-xyz", f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01", f"00-{'0' * 32}-{CLIENT_SPAN}-01",
                f"00-{CLIENT_TRACE}-{'0' * 16}-01", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01-extra"):
        assert parse_traceparent(bad) is None, bad
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces" == traces_url("http://c:4318/v1/traces")


def test_serve_refuses_an_endpoint_that_is_not_a_url(capsys):
    from folio.cli.main import main as folio

    assert folio(["serve", "--otlp-traces-endpoint", "collector:4318"]) == 2
    assert "--otlp-traces-endpoint takes an OTLP/HTTP collector's http:// or https:// URL" in capsys.readouterr().err
