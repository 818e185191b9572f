"""The KV transfer's sockets: a ROUTER the prefill side answers pulls on, and the DEALERs the
decode side pulls with, both CURVE over tcp (``folio.shared.curve``). The protocol and the
records are the core's (``folio/core/kv/tensors/transfer.py``); this module only moves
its messages: msgpack headers and raw KV frames, never a pickle."""

from __future__ import annotations

import threading
from typing import Callable

import msgspec
import zmq

from folio.core.kv.tensors.pool import KVPool
from folio.core.kv.tensors.transfer import (DEFAULT_TIMEOUT_S, DEFAULT_TTL_S, KVExporter, KVImporter, KVLayout,
                                            TransferError)
from folio.shared.curve import REFUSALS, secure

_POLL_MS = 50


def _user_id(parts: list[zmq.Frame]) -> str | None:
    """The ZAP handler's User-Id of a received message (the peer's z85 CURVE key); None without CURVE."""
    try:
        user = parts[-1].get("User-Id")
    except (zmq.ZMQError, IndexError):
        return None
    return user or None


class KVSender(KVExporter):
    """A ``KVExporter`` answering pulls on a ROUTER bound to ``endpoint``, in a thread of its own."""

    def __init__(self, pool: KVPool, layout: KVLayout, endpoint: str = "tcp://127.0.0.1:*",
                 on_release: Callable[[str, list[int], bool], None] | None = None, ttl_s: float = DEFAULT_TTL_S,
                 ctx: zmq.Context | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # requests are small headers; a larger one drops its peer
        # CURVE with the executor's server key: only the stack's client keys pull KV
        secure(self.ctx, self.sock, endpoint, bind=True, service="executor")
        self.sock.bind(endpoint)
        super().__init__(pool, layout, self.sock.getsockopt(zmq.LAST_ENDPOINT).decode(), on_release, ttl_s,
                         refused=REFUSALS.refused)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-sender", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close(0)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(_POLL_MS):
                try:
                    parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue
                frames = [p.bytes for p in parts]
                try:
                    header = msgspec.msgpack.decode(frames[2]) if len(frames) > 2 else {}
                    status, reply, out = self.answer(frames[0], frames[1], header, _user_id(parts))
                except Exception as exc:  # a malformed message: answered, logged by the peer, dropped
                    if len(frames) < 2:
                        continue
                    status, reply, out = b"ERR", {"message": f"bad request: {exc}", "kind": "bad_request"}, []
                self.sock.send_multipart([frames[0], status, msgspec.msgpack.encode(reply), *out], copy=False)
            self.expire()


class DealerChannel:
    """A ``KVChannel`` over ZeroMQ: one DEALER per sender, reused; ``keys``: the key pair it pulls
    with (None: the process's, ``FOLIO_PEER_KEY``'s when set)."""

    def __init__(self, ctx: zmq.Context | None = None, keys=None):
        self.ctx = ctx or zmq.Context.instance()
        self.keys = keys
        self._sockets: dict[str, zmq.Socket] = {}

    def request(self, endpoint: str, verb: bytes, header: dict, timeout_s: float) -> tuple[bytes, dict, list]:
        """One request and its answer on this endpoint's socket (kept for the next; dropped after
        a timeout, so that a late answer is never taken for the next request's)."""
        sock = self._sockets.pop(endpoint, None)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            secure(self.ctx, sock, endpoint, bind=False, keys=self.keys, service="executor")
            sock.connect(endpoint)
        try:
            sock.send_multipart([verb, msgspec.msgpack.encode(header)])
            if not sock.poll(int(timeout_s * 1000)):
                raise TransferError(f"no answer from the KV sender at {endpoint} within {timeout_s} s")
            frames = sock.recv_multipart(copy=False)
        except BaseException:
            sock.close(0)
            raise
        self._sockets[endpoint] = sock
        return frames[0].bytes, msgspec.msgpack.decode(frames[1].bytes), [f.buffer for f in frames[2:]]

    def close(self) -> None:
        """Close its sockets (before its context is terminated, which waits for them)."""
        for sock in self._sockets.values():
            sock.close(0)
        self._sockets.clear()


class KVReceiver(KVImporter):
    """A ``KVImporter`` pulling over ``DealerChannel``s."""

    def __init__(self, pool: KVPool, layout: KVLayout, timeout_s: float = DEFAULT_TIMEOUT_S,
                 ctx: zmq.Context | None = None, keys=None):
        super().__init__(pool, layout, DealerChannel(ctx, keys), timeout_s)
