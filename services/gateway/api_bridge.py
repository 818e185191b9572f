"""What the Responses and Messages APIs (``responses_api.py``, ``messages_api.py``) share: they
turn their body into a chat request and run it through chat's own path (the same validation rules,
the same ``GenerateRequest``, the same mailbox), then write the result in their shape, whole or as
a stream of named SSE events (``event: <type>`` then ``data: <json>``, no ``[DONE]``).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import structlog
from aiohttp import web

from folio.services.gateway import convert, media
from folio.services.gateway.chat_output import OutputReader, output_reader, request_reasoning_parser
from folio.services.gateway.protocol import ApiError, ChatCompletionRequest, parse
from folio.services.gateway.responses import ResponseMeta, UsageCounter
from folio.services.gateway.routes import SERVICE, _respond
from folio.services.gateway.streaming import raise_if_error
from folio.shared.messages import TextDelta

log = structlog.get_logger()
_json = msgspec.json.Encoder()


def chat_request(body: dict, renames: dict[str, str]) -> ChatCompletionRequest:
    """``body`` (a chat body built from another API's) through chat's validation; a refusal names
    the other API's field (``renames``: chat's field -> its own)."""
    try:
        return parse(_json.encode(body), ChatCompletionRequest)
    except ApiError as exc:
        param = exc.param or ""
        head = param.split(".", 1)[0]
        if head in renames:
            exc.param = renames[head] + param[len(head):]
            exc.message = exc.message.replace(head, renames[head])
        raise


def reader_for(request: web.Request, req: ChatCompletionRequest) -> OutputReader:
    """A reader for one choice; it passes the text through as content when nothing is to be split."""
    reader = output_reader(req, request.app[SERVICE].config)
    return reader if reader is not None else OutputReader(None, None)


def read_delta(reader: OutputReader, delta: TextDelta) -> list[dict]:
    """Chat-chunk deltas (reasoning_content, content, tool_calls) of one new delta."""
    if reader.reasoning is None and reader.tools is None:
        return [{"content": delta.text}] if delta.text else []
    return reader.stream_delta(delta.text, delta.finish_reason is not None)


async def run_chat(request: web.Request, req: ChatCompletionRequest, meta: ResponseMeta, stream_fn, response_fn):
    """Submit ``req`` as chat does and answer with ``response_fn(meta, deltas, usage)`` (a dict),
    or, streamed, ``stream_fn(request, mailbox, meta, req)``."""
    service = request.app[SERVICE]
    params = req.sampling_params()
    _, lora_name = await service.resolve_model(req.model)
    reasoning = request_reasoning_parser(req, service.config) is not None
    images = await media.chat_images(req.messages, service.config)  # the other APIs' images, as image_url parts
    gen = convert.chat_generate_requests(req, meta.id, params, lora_name=lora_name, reasoning=reasoning,
                                         images=images)
    mailbox = service.submit(gen, None)
    return await _respond(request, mailbox, meta, req, stream_fn, response_fn)


# one choice's events: start(first delta or None) -> events; feed(delta) -> events; finish(usage)
# -> events; an event is (its type, its JSON body)
Event = tuple[str, dict]


async def stream_events(request: web.Request, mailbox, translator) -> web.StreamResponse:
    """Write a one-choice request's events (``translator``) as SSE until it finished. An error before
    the first event is a plain HTTP error; after it, ``translator.error`` says it in-band."""
    outputs = {} if mailbox.done else await mailbox.get()
    raise_if_error(outputs)
    response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await response.prepare(request)
    usage = UsageCounter(1)
    pending = _encode(translator.start(next(iter(outputs.values()), None)))
    try:
        while True:
            for index, delta in outputs.items():
                usage.add(index, delta)
                pending += _encode(translator.error(delta.error) if delta.error is not None
                                   else translator.feed(delta))
            if mailbox.done:
                break
            if pending:
                await response.write(b"".join(pending))
                pending = []
            outputs = await mailbox.get()
        pending += _encode(translator.finish(usage.usage()))
        await response.write_eof(b"".join(pending))
    except ConnectionError:
        log.info("client went away mid-stream", req_id=next(iter(mailbox.index), None))
    return response


def _encode(events: list[Event]) -> list[bytes]:
    return [b"event: %s\ndata: %s\n\n" % (name.encode(), _json.encode(body)) for name, body in events]


def error_shaped(handler: Callable, shape: Callable[[ApiError], dict]):
    """``handler`` with its errors (and those of its body's parsing) in another API's shape."""
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return web.json_response(shape(exc), status=exc.status)
    return wrapped
