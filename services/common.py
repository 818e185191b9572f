"""What the kvmanager, scheduler and executor services share: run until SIGTERM/SIGINT, serve a
ROUTER socket (decode, dispatch by type, reply to the sender's envelope), answer admin requests,
and the flags every service takes.

Malformed messages are logged and dropped here, once, so each service only writes handlers.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import uuid
from collections.abc import Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio

from shared.messages import AdminReply, AdminRequest
from shared.transport import Decoder, MalformedMessage, encode

# A handler gets the decoded message and the sender's envelope (routing frames); it returns the
# reply to send, or None when there is none (yet: a deferred reply keeps the envelope).
Handler = Callable[[object, list[bytes]], Awaitable[object | None] | object | None]

_admin_decoder = Decoder(AdminRequest)
# this process's name for itself: a ``ping`` answers it, so that a prober tells a restarted service
# (a new instance, its state gone) from one that was only slow (in a container the pid is always 1)
INSTANCE = uuid.uuid4().hex


def sniff_req_id(data: bytes) -> str | None:
    """The ``req_id`` of a message that failed validation, when it is readable msgpack at all,
    so that even the log line about a malformed message names its request."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.MsgspecError:
        return None
    req_id = raw.get("req_id") if isinstance(raw, dict) else None
    return req_id if isinstance(req_id, str) else None


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of console text")
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")


async def reply(sock: zmq.asyncio.Socket, envelope: list[bytes], message) -> None:
    """Send ``message`` back along ``envelope`` (a DEALER's identity, or REQ's identity + empty)."""
    try:
        await sock.send_multipart([*envelope, encode(message)])
    except zmq.ZMQError:
        pass  # the peer went away (ROUTER_MANDATORY): nobody is left to tell


async def serve_router(sock: zmq.asyncio.Socket, decoder: Decoder, handlers: dict[type, Handler], log,
                       socket_name: str) -> None:
    """Receive forever on a ROUTER; a malformed or unhandled message is logged and dropped."""
    while True:
        frames = await sock.recv_multipart()
        envelope, payload = frames[:-1], frames[-1]
        try:
            message = decoder.decode(payload)
        except MalformedMessage as exc:
            log.warning("malformed message dropped", socket=socket_name, error=str(exc), num_bytes=len(payload),
                        req_id=sniff_req_id(payload))
            continue
        handler = handlers.get(type(message))
        if handler is None:
            log.warning("unexpected message dropped", socket=socket_name, type=type(message).__name__)
            continue
        try:
            result = handler(message, envelope)
            if asyncio.iscoroutine(result):
                result = await result
        except Exception:
            log.exception("handler failed; message dropped", socket=socket_name, type=type(message).__name__,
                          req_id=getattr(message, "req_id", None))
            continue
        if result is not None:
            await reply(sock, envelope, result)


async def serve_admin(sock: zmq.asyncio.Socket, commands: dict[str, Callable[[dict], dict]], log) -> None:
    """Answer ``AdminRequest``s: ``commands[name](args) -> data`` (or a coroutine giving it);
    ``ping`` always works."""
    commands = {"ping": lambda args: {"pong": True, "instance": INSTANCE}, **commands}

    async def dispatch(request: AdminRequest, envelope):
        command = commands.get(request.command)
        if command is None:
            return AdminReply(ok=False, error=f"unknown command {request.command!r}; try {sorted(commands)}")
        try:
            data = command(dict(request.args))
            if asyncio.iscoroutine(data):
                data = await data
            return AdminReply(ok=True, data=data)
        except (KeyError, ValueError, TypeError, TimeoutError) as exc:
            return AdminReply(ok=False, error=f"{request.command}: {exc}")

    await serve_router(sock, _admin_decoder, {AdminRequest: dispatch}, log, "admin")


async def run_until_signal(main: Awaitable, log) -> int:
    """Run ``main`` until it ends or SIGTERM/SIGINT arrives; either way cancel it cleanly."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    task = asyncio.ensure_future(main)
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not task.done():
        log.info("stopping")
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return 0
    task.result()  # re-raise what ended it
    return 0


def close_sockets(*socks: zmq.Socket) -> None:
    for sock in socks:
        sock.close()
