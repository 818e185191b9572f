"""Sockets and the codec: one factory decides bind/connect, high-water marks and linger.

Every service builds its sockets here (``make_socket``) on a ``zmq.asyncio.Context`` and sends
and receives messages of ``folio.shared.messages`` with ``encode``/``Decoder``. Who binds what is fixed
by the pattern: a PULL that many push into binds; a ROUTER binds; a PUB binds; the rest connect.

Every ``tcp://`` socket speaks CURVE (``shared/curve.py``): a bound one serves with its service's
server key and lets in only the stack's client keys, a connecting one presents the client key and
checks the key of the service it names (``service=``, the owner of the endpoint it dials); without
a key folder a tcp socket is refused here (``MissingKeys``), never opened in the clear.
``ipc://`` sockets rely on their files' permissions (a 0700 run folder, ``folio serve``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec
import structlog
import zmq
import zmq.asyncio

from folio.shared.messages import AdminReply, AdminRequest
from folio.shared.curve import MissingKeys, secure  # noqa: F401  (MissingKeys: for callers)

# How many messages a socket queues per peer before PUSH blocks (back-pressure) or PUB drops.
DEFAULT_HWM = 100_000
# On close, give queued messages this long (ms) to leave; a dead peer must not hang shutdown.
LINGER_MS = 500
# A tcp peer that sends a larger message is disconnected by libzmq before it is buffered whole (a
# step plan of 128k prompt tokens is under 1 MiB; KV blocks travel on their own sockets).
MAX_TCP_MESSAGE_BYTES = 64 * 1024 * 1024

_BINDS = {zmq.PULL, zmq.ROUTER, zmq.PUB}

# for callers whose output is the reply alone (the CLI): failures there are a None, not a log line
QUIET = structlog.wrap_logger(structlog.ReturnLogger(), processors=[])

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode


class Decoder:
    """Decode bytes into one of ``types``; raises ``msgspec.DecodeError``/``ValidationError``
    (both ``msgspec.MsgspecError``) on a malformed message, which callers log and drop."""

    def __init__(self, *types):
        union = types[0]
        for t in types[1:]:
            union = union | t
        self._decoder = msgspec.msgpack.Decoder(union)

    def decode(self, data: bytes):
        return self._decoder.decode(data)


MalformedMessage = msgspec.MsgspecError
_admin_reply_decoder = Decoder(AdminReply)


def make_socket(
    ctx: zmq.asyncio.Context | zmq.Context,
    kind: int,
    address: str,
    *,
    bind: bool | None = None,
    hwm: int = DEFAULT_HWM,
    identity: bytes | None = None,
    service: str | None = None,
) -> zmq.Socket:
    """A socket of ``kind`` bound or connected to ``address`` (``ipc://...`` or ``tcp://...``).
    ``service``: the one that binds ``address`` (``config.ENDPOINT_OWNERS``): needed to connect over
    tcp; a bound socket defaults to this process's own."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if address.startswith("tcp://"):
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_TCP_MESSAGE_BYTES)
    if kind == zmq.ROUTER:
        # a reply to a peer that went away raises instead of vanishing silently
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if bind is None:
        bind = kind in _BINDS
    try:
        secure(ctx, sock, address, bind, service=service)
    except BaseException:
        sock.close(0)
        raise
    if bind:
        sock.bind(_bind_address(address))
    else:
        sock.connect(address)
    return sock


def _bind_address(address: str) -> str:
    """``tcp://name:port`` binds on all interfaces (containers are reached by service name)."""
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://") :].rpartition(":")
        if host not in ("127.0.0.1", "localhost", "0.0.0.0", "*"):
            return f"tcp://*:{port}"
    return address



# A message already waiting still costs zmq.asyncio's plain recv a future, its callbacks and a
# poller update (measured here: 15-23 us a recv, 40 us more for a poll first), and a step's path
# crosses several. Its non-blocking form (DONTWAIT) short-circuits to the socket: about 3 us.
# These helpers try that first and wait the usual way only when nothing is there. Sends need no
# helper: zmq.asyncio already tries them at once. (A read behind zmq.asyncio's back, on a second
# handle to the socket, would be cheaper still, but could swallow the edge-triggered wake-up of a
# future waiting on the same socket.)


async def recv_ready(sock: zmq.asyncio.Socket) -> bytes | None:
    """A single-frame message waiting on ``sock``, taken at once; None when none is."""
    try:
        return await sock.recv(zmq.DONTWAIT)
    except zmq.Again:
        return None


async def recv(sock: zmq.asyncio.Socket) -> bytes:
    """``await sock.recv()``, short-circuited when a message is waiting."""
    data = await recv_ready(sock)
    return data if data is not None else await sock.recv()


async def recv_multipart(sock: zmq.asyncio.Socket) -> list[bytes]:
    """``await sock.recv_multipart()``, short-circuited when a message is waiting."""
    try:
        return await sock.recv_multipart(zmq.DONTWAIT)
    except zmq.Again:
        return await sock.recv_multipart()


async def receive_reply(sock: zmq.asyncio.Socket, decoder: Decoder, log, timeout_s: float | None = None,
                        accept: Callable[[object], bool] | None = None, socket_name: str = ""):
    """The next well-formed reply on a DEALER that ``accept`` takes (malformed or stale ones are
    logged and skipped); None when none came within ``timeout_s`` (None: wait for ever)."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    while True:
        data = await recv_ready(sock)  # (a reply that came while the caller worked: no poll)
        if data is None:
            if deadline is not None:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await sock.poll(max(1, int(remaining * 1000)), zmq.POLLIN):
                    return None
            data = await sock.recv()
        try:
            message = decoder.decode(data)
        except MalformedMessage as exc:
            log.warning("malformed reply dropped", socket=socket_name, error=str(exc))
            continue
        if accept is not None and not accept(message):
            log.warning("unexpected reply dropped", socket=socket_name, got=type(message).__name__)
            continue
        return message


async def request(sock: zmq.asyncio.Socket, message, decoder: Decoder, log, timeout_s: float | None = None,
                  accept: Callable[[object], bool] | None = None, socket_name: str = ""):
    """Send ``message`` on a DEALER and wait for its reply (``receive_reply``)."""
    await sock.send(encode(message))
    return await receive_reply(sock, decoder, log, timeout_s, accept, socket_name)


async def ask_admin(ctx: zmq.asyncio.Context, address: str, command: str, args: dict | None, timeout_s: float,
                    log, service: str | None = None) -> AdminReply | None:
    """One ``AdminRequest`` to the admin socket at ``address`` (``service``'s: needed over tcp) on a
    socket of its own; None when nobody answers in time."""
    sock = make_socket(ctx, zmq.DEALER, address, service=service)
    try:
        return await request(sock, AdminRequest(command=command, args=args or {}), _admin_reply_decoder, log,
                             timeout_s, socket_name="admin")
    except zmq.ZMQError as exc:
        log.debug("admin query failed", address=address, error=str(exc))
        return None
    finally:
        sock.close(linger=0)


def admin_call(address: str, command: str, args: dict | None, timeout_s: float, log=QUIET,
               service: str | None = None) -> AdminReply | None:
    """``ask_admin`` for code without an event loop (the CLI, the launcher's side thread)."""

    async def ask() -> AdminReply | None:
        ctx = zmq.asyncio.Context()
        try:
            return await ask_admin(ctx, address, command, args, timeout_s, log, service)
        finally:
            ctx.term()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(ask())
    with ThreadPoolExecutor(1) as worker:  # called from a coroutine: its loop is busy running it
        return worker.submit(asyncio.run, ask()).result()


def close_sockets(*socks: zmq.Socket) -> None:
    for sock in socks:
        sock.close()


def ask_service(endpoints, service: str, command: str, args: dict | None, timeout_s: float) -> AdminReply | None:
    """``admin_call`` to ``service``'s admin socket in ``endpoints`` (a ``config.Endpoints``)."""
    return admin_call(getattr(endpoints, f"admin_{service}"), command, args, timeout_s, service=service)
