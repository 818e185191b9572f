"""Resuming a stream on another replica when the one serving it dies mid-stream.

More in docs/modules.md (services/router/resume.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp
import structlog

log = structlog.get_logger()

BROKEN = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


class ClientGone(Exception):
    """The client closed its connection mid-stream: nothing is wrong with the replica."""


async def to_client(response, data: bytes) -> None:
    """``response.write``, with the client's own disconnect told apart from a broken upstream (a
    write to a closed client raises aiohttp's ClientConnectionResetError, which is also one of
    ``BROKEN``'s ClientConnectionErrors)."""
    try:
        await response.write(data)
    except ConnectionError as exc:
        raise ClientGone(str(exc) or type(exc).__name__) from exc


class ResumableStream:
    """One streamed request's state in the router: what its client has."""

    def __init__(self, body: dict):
        self.body = body
        self.client_wants_ids = body.get("return_token_ids") is True
        self.token_ids: dict[int, list[int]] = {}
        self.finished: set[int] = set()
        self.done = False
        self.id = self.created = None
        self._buffer = b""
        self.num_resumes = 0

    @staticmethod
    def for_body(body: dict) -> "ResumableStream | None":
        if body.get("stream") is not True or body.get("tools") or body.get("use_beam_search"):
            return None
        return ResumableStream(body)

    def first_body(self) -> bytes:
        return json.dumps({**self.body, "return_token_ids": True}).encode()

    def continuation_body(self) -> bytes:
        indices = sorted(set(self.token_ids) | self.finished)
        return json.dumps({**self.body, "return_token_ids": True, "continue_choices": [
            {"index": i, "token_ids": self.token_ids.get(i, []), "finished": i in self.finished}
            for i in indices]}).encode()

    def feed(self, data: bytes) -> bytes:
        """New bytes from the replica -> the whole events to forward (an event cut by a break is
        never forwarded: its choice's tokens are not counted as the client's)."""
        self._buffer += data
        out = []
        while True:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                break
            event, self._buffer = self._buffer[:end], self._buffer[end + 2:]
            out.append(self._event(event))
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        line = event.strip()
        if not line.startswith(b"data: "):
            return event + b"\n\n"
        payload = line[6:]
        if payload == b"[DONE]":
            self.done = True
            return event + b"\n\n"
        try:
            chunk = json.loads(payload)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
            return event + b"\n\n"  # an error event, or something else: passed on as it is
        if self.id is None:
            self.id, self.created = chunk.get("id"), chunk.get("created")
        else:
            chunk["id"], chunk["created"] = self.id, self.created
        for choice in chunk["choices"]:
            index = choice.get("index", 0)
            ids = choice.get("token_ids") if self.client_wants_ids else choice.pop("token_ids", None)
            if ids:
                self.token_ids.setdefault(index, []).extend(ids)
            if choice.get("finish_reason") is not None:
                self.finished.add(index)
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    async def relay(self, service, request, response, replica, upstream, first: bytes,
                    pick: Callable[[], object]) -> None:
        """Forward ``upstream`` to ``response``; on a break, go on from another replica (``pick``
        gives the next, or None), until ``[DONE]`` or no replica takes it."""
        while True:
            try:
                await to_client(response, self.feed(first))
                async for data in upstream.content.iter_any():
                    await to_client(response, self.feed(data))
                if self.done:
                    return
                raise aiohttp.ServerDisconnectedError("the stream ended before [DONE]")
            except BROKEN as exc:
                service.counts["num_broken_streams"] += 1
                service.metrics.broken_streams.labels(replica.name).inc()
                service.replicas.mark_down(replica, f"stream: {type(exc).__name__}: {exc}")
            finally:
                upstream.release()
            self._buffer = b""  # the cut event: its choice goes on from what was forwarded
            opened = await self._reopen(service, request, pick)
            if opened is None:
                return
            replica, upstream, first = opened

    async def _reopen(self, service, request, pick):
        """The continuation on the next replica that starts streaming it; None when none does."""
        raw = self.continuation_body()
        while (decision := pick()) is not None:
            replica = decision.replica
            try:
                upstream, first = await service._open(request, replica, raw)
            except BROKEN as exc:
                service.replicas.mark_down(replica, f"resume: {type(exc).__name__}: {exc}")
                continue
            except Exception as exc:  # its _Retry: it cannot take it now
                log.info("resuming: replica refused", replica=replica.name, cause=str(exc))
                continue
            if upstream.content_type != "text/event-stream":
                log.warning("resuming: replica answered without a stream", replica=replica.name,
                            status=upstream.status, body=first[:200])
                upstream.release()
                return None
            self.num_resumes += 1
            service.counts["num_resumed_streams"] = service.counts.get("num_resumed_streams", 0) + 1
            log.info("stream resumed on another replica", replica=replica.name,
                     num_tokens={i: len(t) for i, t in self.token_ids.items()})
            return replica, upstream, first
        return None
