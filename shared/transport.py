"""Sockets and the codec: one factory decides bind/connect, high-water marks and linger.

Every service builds its sockets here (``make_socket``) on a ``zmq.asyncio.Context`` and sends
and receives messages of ``folio.shared.messages`` with ``encode``/``Decoder``. Who binds what is fixed
by the pattern: a PULL that many push into binds; a ROUTER binds; a PUB binds; the rest connect.

Every ``tcp://`` socket speaks CURVE (``shared/plane.py``): a bound one serves with its service's
server key and lets in only the stack's client keys, a connecting one presents the client key and
checks the key of the service it names (``service=``, the owner of the endpoint it dials); without
a key folder a tcp socket is refused here (``MissingKeys``), never opened in the clear.
``ipc://`` sockets rely on their files' permissions (a 0700 run folder, ``folio serve``).
"""

from __future__ import annotations

import msgspec
import zmq
import zmq.asyncio

from folio.shared.plane import MissingKeys, secure  # noqa: F401  (MissingKeys: for callers)

# How many messages a socket queues per peer before PUSH blocks (back-pressure) or PUB drops.
DEFAULT_HWM = 100_000
# On close, give queued messages this long (ms) to leave; a dead peer must not hang shutdown.
LINGER_MS = 500
# A tcp peer that sends a larger message is disconnected by libzmq before it is buffered whole (a
# step plan of 128k prompt tokens is under 1 MiB; KV blocks travel on their own sockets).
MAX_TCP_MESSAGE_BYTES = 64 * 1024 * 1024

_BINDS = {zmq.PULL, zmq.ROUTER, zmq.PUB}

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
