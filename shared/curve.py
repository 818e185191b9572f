"""The internal plane's CURVE: every tcp socket authenticated, and the log of who was refused.

More in docs/modules.md (shared/curve.py).
"""

from __future__ import annotations

import threading
import time

import structlog
import zmq
import zmq.utils.monitor
from zmq.auth.thread import ThreadAuthenticator

from folio.shared.config import curve_disabled_from_env, default_keys_dir, keys_dir_from_env
from folio.shared.keys import KeysError, StackKeys, load_keys

ZAP_DOMAIN = "folio"
UNSAFE_ENV = "FOLIO_UNSAFE_NO_CURVE"
LOG_EVERY_S = 60.0  # one line per (address, reason) per this long
_FAILED_HANDSHAKE = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_MONITOR_STOPPED)


class MissingKeys(RuntimeError):
    """A tcp socket without a key folder: the message says how to make one."""


_state: dict = {"keys": None, "set": False, "service": None}
_lock = threading.Lock()
_gates: dict[int, "_Gate"] = {}  # per underlying context


def use_keys(folder: str | None, service: str | None = None) -> StackKeys | None:
    """This process's key folder (None: found when first needed, as ``stack_keys`` says), and the
    service it is (its bound tcp sockets serve with that service's key; None: it binds none)."""
    keys = load_keys(folder, service=service) if folder else None
    with _lock:
        _state["keys"], _state["set"], _state["service"] = keys, keys is not None, service
    return keys


def stack_keys() -> StackKeys | None:
    """The process's keys: ``use_keys``'s, else ``$FOLIO_KEYS_DIR``'s, else the folder ``folio serve``
    makes on this host when it exists (so a router or the CLI beside it needs no flag)."""
    with _lock:
        if not _state["set"]:
            folder = keys_dir_from_env()
            if folder is None and (default_keys_dir() / "client.key_secret").exists():
                folder = str(default_keys_dir())
            _state["keys"] = load_keys(folder, service=_state["service"]) if folder else None
            _state["set"] = True
        return _state["keys"]


def curve_disabled() -> bool:
    """``FOLIO_UNSAFE_NO_CURVE=1``: tcp in the clear, to measure CURVE's cost only."""
    return curve_disabled_from_env()


_warned = threading.Event()


def warn_if_unsafe(log=None) -> bool:
    """Log the loud warning (once per process) when CURVE is off; whether it is."""
    if not curve_disabled():
        return False
    if not _warned.is_set():
        _warned.set()
        (log or structlog.get_logger()).warning(
            f"!!! {UNSAFE_ENV} is set: tcp sockets speak NO CURVE - anyone who reaches a port is served, "
            "unauthenticated and unencrypted; for measuring CURVE's cost only, never a deployment !!!")
    return True


def secure(ctx: zmq.Context, sock: zmq.Socket, address: str, bind: bool, keys: StackKeys | None = None,
           service: str | None = None) -> None:
    """CURVE on ``sock`` when ``address`` is tcp (before it binds or connects). ``service``: the one
    that binds ``address`` (bound: default this process's; connecting: required, its public key is
    checked). ``keys``: other than the process's (``stack_keys``), e.g. a peer key pair of the same folder."""
    if not address.startswith("tcp://"):
        return
    if warn_if_unsafe():
        return
    keys = keys or stack_keys()
    if keys is None:
        raise MissingKeys(f"{address} is a tcp endpoint and no key folder is given: make one with "
                          "`folio keys init DIR` and pass --keys-dir DIR (or set FOLIO_KEYS_DIR)")
    if bind:
        service = service or keys.service or _state["service"]
        if service is None:
            raise KeysError(f"binding {address}: this process is no service of the stack, so it has no server key "
                            "(a service names itself with use_keys(folder, service))")
        secret = keys.server_secret(service)
        gate = _gate(ctx, keys)
        sock.curve_secretkey = secret
        sock.curve_publickey = keys.server_public(service)
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()
        gate.watch(sock)
    else:
        if service is None:
            raise ValueError(f"connecting to {address} over tcp needs the service that binds it (its public key is "
                             "checked); the caller names it")
        sock.curve_secretkey = keys.client_secret
        sock.curve_publickey = keys.client_public
        sock.curve_serverkey = keys.server_public(service)


class _RefusalLog:
    """``peer refused`` once per (address, reason) per ``LOG_EVERY_S``, with how many were not logged."""

    def __init__(self):
        self.log = structlog.get_logger()
        self._last: dict[tuple[str, str], float] = {}
        self._quiet: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self.num_refused = 0

    def refused(self, address: str, reason: str) -> None:
        key, now = (address, reason), time.monotonic()
        with self._lock:
            self.num_refused += 1
            if now - self._last.get(key, -LOG_EVERY_S) < LOG_EVERY_S:
                self._quiet[key] = self._quiet.get(key, 0) + 1
                return
            self._last[key] = now
            not_logged = self._quiet.pop(key, 0)
        self.log.warning("peer refused", address=address, reason=reason, not_logged_since=not_logged)


REFUSALS = _RefusalLog()


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler, with each refusal logged with the peer's address."""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._peer = msg[3].decode("utf8", "replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def _send_zap_reply(self, request_id, status_code, status_text, user_id="anonymous") -> None:
        if status_code != b"200":
            REFUSALS.refused(getattr(self, "_peer", "?"), status_text.decode("utf8", "replace").lower())
        super()._send_zap_reply(request_id, status_code, status_text, user_id)


class _Allowed:
    def __init__(self, keys: StackKeys):
        self.allowed = keys.allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


class _Gate:
    """One context's ZAP handler, and a thread reading its bound sockets' handshake failures."""

    def __init__(self, ctx: zmq.Context, keys: StackKeys):
        self.ctx = zmq.Context.shadow(ctx.underlying)
        self.auth = _Authenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_Allowed(keys))
        self._monitors: list[tuple[zmq.Socket, str]] = []
        self._new: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.auth.stop()

    def watch(self, sock: zmq.Socket) -> None:
        """Report ``sock``'s failed handshakes (keyless peers: libzmq never asks ZAP about them)."""
        inproc = f"inproc://folio-monitor-{id(sock):x}-{time.monotonic_ns()}"
        sock.monitor(inproc, _FAILED_HANDSHAKE)
        with self._lock:
            self._new.append((inproc, f"socket {id(sock):x}"))
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="folio-plane-monitor", daemon=True)
                self._thread.start()

    def _watch(self) -> None:
        poller = zmq.Poller()
        names: dict[zmq.Socket, str] = {}
        while not self._stop.is_set():
            with self._lock:
                new, self._new = self._new, []
            for inproc, name in new:
                pair = self.ctx.socket(zmq.PAIR)
                pair.linger = 0
                pair.connect(inproc)
                poller.register(pair, zmq.POLLIN)
                names[pair] = name
            if not poller.sockets:  # nothing to watch: zmq_poll over no sockets returns at once
                self._stop.wait(0.2)
                continue
            try:
                ready = dict(poller.poll(200))
            except zmq.ContextTerminated:
                break
            num_read = 0
            for pair in ready:
                try:
                    event = zmq.utils.monitor.recv_monitor_message(pair, zmq.NOBLOCK)
                except zmq.Again:
                    continue
                except zmq.ZMQError:  # the context is going, or the monitored socket is gone
                    poller.unregister(pair)
                    continue
                num_read += 1
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    poller.unregister(pair)
                    pair.close(0)
                    continue
                REFUSALS.refused(event["endpoint"].decode("utf8", "replace"),
                                 "handshake failed (no key, or not this stack's)")
            if ready and not num_read:  # readable yet nothing to read: never spin holding the GIL
                self._stop.wait(0.05)
        for pair in names:
            pair.close(0)


def _gate(ctx: zmq.Context, keys: StackKeys) -> _Gate:
    with _lock:
        gate = _gates.get(ctx.underlying)
        if gate is None:
            gate = _gates[ctx.underlying] = _Gate(ctx, keys)
        return gate


def release(ctx: zmq.Context) -> None:
    """Stop ``ctx``'s ZAP handler and monitor thread (before ``ctx.term()``, which waits for them)."""
    with _lock:
        gate = _gates.pop(ctx.underlying, None)
    if gate is not None:
        gate.close()
