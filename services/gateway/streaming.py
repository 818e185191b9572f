"""Reading a request's ``OutputMailbox`` into an HTTP response: whole, or as an SSE stream.

Called by ``routes.py`` after it submitted the request's choices. Both paths wait for the first
outputs before answering, so an error from the tokenizer (prompt + max_tokens beyond the context,
a bad token id) still gets a plain HTTP 400 even on a stream. A client that goes away shows up as
a failed write (or, with handler cancellation, as ``CancelledError``); the route's ``finally``
then aborts every unfinished choice.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import structlog
from aiohttp import web

from folio.services.gateway.mailbox import OutputMailbox, merge_all
from folio.services.gateway.protocol import ApiError
from folio.services.gateway.responses import UsageCounter
from folio.shared.messages import TextDelta

log = structlog.get_logger()  # lazy: takes the config setup_logging makes in main
_json = msgspec.json.Encoder()


def raise_if_error(outputs: dict[int, TextDelta]) -> None:
    for delta in outputs.values():
        if delta.error is not None:
            status = delta.error_code if 400 <= delta.error_code < 600 else 500
            type_ = "invalid_request_error" if status < 500 else "server_error"
            raise ApiError(delta.error, status=status, param=delta.error_param, type_=type_)


async def collect(mailbox: OutputMailbox) -> dict[int, TextDelta]:
    """Every choice's whole output, one merged delta per choice index."""
    parts: dict[int, list[TextDelta]] = {}
    while True:
        outputs = await mailbox.get()
        raise_if_error(outputs)
        for i, delta in outputs.items():
            parts.setdefault(i, []).append(delta)
        if mailbox.done:
            return {i: merge_all(deltas) for i, deltas in parts.items()}


class SseWriter:
    """``data: {json}`` events over a chunked response, ``data: [DONE]`` at the end.

    Events are gathered with ``add`` and leave in one ``flush``: one write (one chunk, one
    system call) per stream per step, whatever the number of choices and events in it."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._pending: list[bytes] = []

    async def prepare(self) -> None:
        await self.response.prepare(self.request)

    def add(self, chunk: dict | bytes) -> None:
        """One event: a chunk to encode, or one encoded already (``responses.TextChunkTemplate``)."""
        self._pending += (b"data: ", chunk if isinstance(chunk, bytes) else _json.encode(chunk), b"\n\n")

    async def flush(self) -> None:
        if self._pending:
            data, self._pending = b"".join(self._pending), []
            await self.response.write(data)

    async def done(self) -> None:
        """The pending events, ``[DONE]`` and the stream's end, in one write."""
        self._pending.append(b"data: [DONE]\n\n")
        data, self._pending = b"".join(self._pending), []
        await self.response.write_eof(data)


# (choice index, its merged delta) -> the chunks to send for it (dicts, or JSON bytes)
ChunkMaker = Callable[[int, TextDelta], list[dict | bytes]]


async def stream(request: web.Request, mailbox: OutputMailbox, make_chunks: ChunkMaker,
                 usage_chunk: Callable[[dict], dict] | None, n: int) -> web.StreamResponse:
    """Write the request's outputs as SSE events until every choice finished."""
    outputs = {} if mailbox.done else await mailbox.get()  # (a resumed stream may have nothing left)
    raise_if_error(outputs)  # nothing sent yet: a plain HTTP error is still possible
    sse = SseWriter(request)
    await sse.prepare()
    usage = UsageCounter(n)
    try:
        while True:
            for index, delta in sorted(outputs.items()) if len(outputs) > 1 else outputs.items():
                usage.add(index, delta)
                if delta.error is not None:  # failed after the stream began: say so in-band
                    sse.add(ApiError(delta.error, status=delta.error_code, param=delta.error_param).body())
                    continue
                for chunk in make_chunks(index, delta):
                    sse.add(chunk)
            if mailbox.done:
                break
            await sse.flush()
            outputs = await mailbox.get()
        if usage_chunk is not None:
            sse.add(usage_chunk(usage.usage()))
        await sse.done()
    except ConnectionError:
        log.info("client went away mid-stream", req_id=next(iter(mailbox.index), None))
    return sse.response
