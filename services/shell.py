"""What every service shell runs, written once: ``run_service`` (flags into the config, logging,
keys, its run folder made if missing, the service run until SIGTERM/SIGINT), the ``ServiceSpec``
each ``main.py`` declares, and the receive loops (``serve_router``, ``serve_pull``, ``serve_admin``)
that decode, dispatch by type and log and drop a malformed message. Client calls (``request``,
``admin_call``) are in ``folio.shared.transport``; docs/architecture.md (Service shells) says how a
service is put together.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import signal
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from folio.shared import curve
from folio.shared.config import DEFAULT_PORT, Endpoints, ipc_folders, keys_dir_from_env, make_run_dir
from folio.shared.keys import KeysError
from folio.shared.flags import config_values, service_parser
from folio.shared.logs import setup_logging
from folio.shared.messages import AdminReply, AdminRequest
from folio.shared.transport import Decoder, MalformedMessage, encode, recv, recv_multipart

# A ROUTER handler gets the decoded message and the sender's envelope (routing frames); it returns
# the reply to send, or None when there is none (yet: a deferred reply keeps the envelope).
Handler = Callable[[object, list[bytes]], Awaitable[object | None] | object | None]
# A single-frame socket's handler gets the message alone; nothing goes back on that socket.
StreamHandler = Callable[[object], Awaitable[None] | None]

_admin_decoder = Decoder(AdminRequest)
# this process's name for itself: a ``ping`` answers it, so that a prober tells a restarted service
# (a new instance, its state gone) from one that was only slow (in a container the pid is always 1)
INSTANCE = uuid.uuid4().hex


def freeze_heap() -> None:
    """Collect, then move every object alive out of the cyclic collector's sight (``gc.freeze``).
    For a service once its imports and setup are done: what they made (hundreds of thousands of
    objects with transformers) lives as long as the process, and each full collection that walked
    it would stall every request the loop serves for tens to hundreds of ms."""
    global _num_frozen
    gc.collect()
    gc.freeze()
    # counted once: gc.get_freeze_count() walks the frozen list (35 ms for an executor's 200,000
    # objects), and the gateway pings every service twice a second; that walk was 7% of an idle core
    _num_frozen = gc.get_freeze_count()


_num_frozen = 0  # objects freeze_heap put out of the collector's sight


def sniff_req_ids(data: bytes) -> dict:
    """Log fields naming the request(s) of a message that failed validation: ``req_id`` of a
    message about one request, ``req_ids`` of a batch of deltas; empty when unreadable."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.MsgspecError:
        return {}
    if not isinstance(raw, dict):
        return {}
    if isinstance(raw.get("req_id"), str):
        return {"req_id": raw["req_id"]}
    deltas = raw.get("deltas")
    if isinstance(deltas, list):
        return {"req_ids": [d["req_id"] for d in deltas if isinstance(d, dict) and isinstance(d.get("req_id"), str)]}
    return {}


async def _call(handler, *args):
    result = handler(*args)
    if asyncio.iscoroutine(result):
        result = await result
    return result


def _decode(decoder: Decoder, data: bytes, log, socket_name: str, on_malformed: Callable[[], None] | None):
    """The message in ``data``, or None (logged, counted) when it is malformed."""
    try:
        return decoder.decode(data)
    except MalformedMessage as exc:
        if on_malformed is not None:
            on_malformed()
        log.warning("malformed message dropped", socket=socket_name, error=str(exc), num_bytes=len(data),
                    **sniff_req_ids(data))
        return None


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
        frames = await recv_multipart(sock)
        envelope, payload = frames[:-1], frames[-1]
        message = _decode(decoder, payload, log, socket_name, None)
        if message is None:
            continue
        handler = handlers.get(type(message))
        if handler is None:
            log.warning("unexpected message dropped", socket=socket_name, type=type(message).__name__)
            continue
        try:
            result = await _call(handler, message, envelope)
        except Exception:
            log.exception("handler failed; message dropped", socket=socket_name, type=type(message).__name__,
                          req_id=getattr(message, "req_id", None))
            continue
        if result is not None:
            await reply(sock, envelope, result)


async def serve_pull(sock: zmq.asyncio.Socket, decoder: Decoder, handlers: dict[type, StreamHandler], log,
                     socket_name: str, on_malformed: Callable[[], None] | None = None,
                     on_error: Callable[[object], None] | None = None) -> None:
    """Receive forever on a single-frame socket (a PULL, or a DEALER's unsolicited messages) and
    dispatch each message by its type. ``on_malformed`` counts a dropped message; ``on_error``
    gets a message whose handler raised (after the log line), to tell its request."""
    while True:
        data = await recv(sock)
        message = _decode(decoder, data, log, socket_name, on_malformed)
        if message is None:
            continue
        try:
            await _call(handlers[type(message)], message)
        except Exception:
            log.exception("handler failed; message dropped", socket=socket_name, type=type(message).__name__,
                          req_id=getattr(message, "req_id", None))
            if on_error is not None:
                on_error(message)


async def serve_admin(sock: zmq.asyncio.Socket, commands: dict[str, Callable[[dict], dict]], log) -> None:
    """Answer ``AdminRequest``s: ``commands[name](args) -> data`` (or a coroutine giving it);
    ``ping`` always works; it also says how many objects ``freeze_heap`` put out of the
    collector's sight (0 until the service has frozen its heap)."""
    commands = {"ping": lambda args: {"pong": True, "instance": INSTANCE, "gc_frozen": _num_frozen},
                **commands}

    async def dispatch(request: AdminRequest, envelope):
        command = commands.get(request.command)
        if command is None:
            return AdminReply(ok=False, error=f"unknown command {request.command!r}; try {sorted(commands)}")
        try:
            return AdminReply(ok=True, data=await _call(command, dict(request.args)))
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


class StartError(Exception):
    """A service cannot start: ``message`` is logged with ``fields`` and the process exits 1."""

    def __init__(self, message: str, **fields):
        super().__init__(message)
        self.message, self.fields = message, fields


@dataclass(frozen=True)
class ServiceSpec:
    name: str  # the service, as ``folio run NAME`` and the flag declarations name it
    config_type: type
    description: str  # the --help line
    open: Callable[[Any, zmq.asyncio.Context, Any], Any]  # (config, ctx, log) -> service or coroutine
    check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None  # parser.error on bad flags
    fields: Callable[[argparse.Namespace], dict] | None = None  # config fields that are not flags
    starting: Callable[[Any], dict] | None = None  # the "starting" log line's fields; None: no such line
    drop_unsent: bool = False  # at the end, drop what the sockets still hold (else wait for their linger)

    def parse(self, argv: list[str] | None) -> tuple[Any, argparse.Namespace]:
        """(the config, the parsed flags)."""
        parser = service_parser(self.name, self.description)
        args = parser.parse_args(argv)
        if self.check is not None:
            self.check(parser, args)
        more = self.fields(args) if self.fields is not None else {}
        # a gateway or router alone on --port P: the run folder of P, where `folio ... --port P` looks
        endpoints = Endpoints.from_env(getattr(args, "port", DEFAULT_PORT))
        config = self.config_type(endpoints=endpoints, **more,
                                  **config_values(self.config_type, args, self.name))
        return config, args

    def config(self, argv: list[str] | None = None):
        """The config alone (each ``main.py``'s ``parse_config``)."""
        return self.parse(argv)[0]

    def main(self, argv: list[str] | None = None) -> int:
        return run_service(self, argv)


def run_service(spec: ServiceSpec, argv: list[str] | None = None) -> int:
    """Parse ``argv`` into the service's config, set up logging, run the service until SIGTERM/SIGINT
    (or until it ends); the process's exit status."""
    config, args = spec.parse(argv)
    log = setup_logging(spec.name, json=config.log_json, level=args.log_level)
    try:
        curve.use_keys(args.keys_dir or keys_dir_from_env(), spec.name)
    except KeysError as exc:
        log.error("cannot read the key folder", error=str(exc))
        return 1
    curve.warn_if_unsafe(log)
    try:  # a service started alone makes its own run folder, as `folio serve` does
        for folder in ipc_folders(config.endpoints):
            make_run_dir(folder)
    except OSError as exc:
        log.error("cannot make the run folder for the ipc sockets (set FOLIO_RUN_DIR)", error=str(exc))
        return 1
    if spec.starting is not None:
        log.info("starting", **spec.starting(config))

    async def serve() -> int:
        ctx = zmq.asyncio.Context()
        service = None
        try:
            # before the signal handlers: a SIGTERM while the service starts (a model loading) ends
            # the process at once, as the default action does, instead of after the start
            service = spec.open(config, ctx, log)
            # what the imports and the start left (torch and the model: ~180,000 objects, a 100 ms
            # walk for every full collection, each a stalled step): out of the cyclic collector's way
            freeze_heap()
            return await run_until_signal(service if inspect.isawaitable(service) else service.run(), log)
        finally:
            close = getattr(service, "close", None)
            if close is not None and not inspect.isawaitable(service):
                close()
            curve.release(ctx)
            if spec.drop_unsent or service is None:  # (a failed start: its sockets were never closed)
                ctx.destroy(linger=0)
            else:
                ctx.term()

    try:
        return asyncio.run(serve())
    except StartError as exc:
        log.error(exc.message, **exc.fields)
        return 1
    except (curve.MissingKeys, KeysError) as exc:
        log.error("no keys for a tcp endpoint", error=str(exc))
        return 1
    except KeyboardInterrupt:  # SIGINT while starting (Ctrl-C reaches every process of the group)
        return 130
