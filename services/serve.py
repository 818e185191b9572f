"""``folio serve``: start the five services as processes on ``ipc://`` sockets and supervise them.

The model is resolved (prepared if needed) once, here, and every service gets its folder. Each
child runs ``folio run NAME`` with the flags that concern it; the sockets live in one run folder
(``--run-dir``; default ``$FOLIO_RUN_DIR``, else one folder per port, $TMPDIR/folio-PORT), claimed
with a lock held for the server's life, so two servers can never share sockets.

More in docs/modules.md (services/serve.py).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import signal
import sys
import threading
import time
from pathlib import Path

from folio.shared.config import LAUNCHED, Endpoints, default_run_dir, make_run_dir
from folio.shared.flags import add_launcher_flags, forwarded_argv
from folio.shared.transport import admin_call

SERVICES = LAUNCHED  # start order
EXECUTOR_PHASES = ("imports", "weights", "pool", "kernels", "graphs")  # ``folio.core.executor.startup``'s
LOCK_NAME = "serve.lock"
_PR_SET_PDEATHSIG = 1


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of the five services (declared on the config fields), and the launcher's own."""
    add_launcher_flags(parser)
    parser.add_argument("--run-dir", default=None,
                        help="folder for the ipc:// sockets (default $FOLIO_RUN_DIR, else $TMPDIR/folio-PORT)")
    parser.add_argument("--kv-events-port", type=int, default=None,
                        help="publish the KV events over tcp on --host:PORT (for a router; default: ipc only)")
    parser.add_argument("--kv-snapshot-port", type=int, default=None,
                        help="the KV snapshot socket routers resync from (default: --kv-events-port + 1)")
    parser.add_argument("--no-restart", action="store_true",
                        help="stop everything when a service dies instead of restarting it")
    parser.add_argument("--max-restarts", type=int, default=5,
                        help="restarts of one service within a minute before everything stops")


def service_argv(name: str, args: argparse.Namespace, model_path: str) -> list[str]:
    """The flags ``folio run NAME`` gets: those that concern it, only when they were given; the
    model as the folder it resolved to."""
    return forwarded_argv(name, argparse.Namespace(**{**vars(args), "model": model_path}))


def kv_events_env(args: argparse.Namespace) -> dict[str, str]:
    """Where the kvmanager publishes KV events and answers snapshots, when a router must reach them."""
    if args.kv_events_port is None:
        return {}
    snapshot_port = args.kv_snapshot_port or args.kv_events_port + 1
    host = args.host if args.host not in ("0.0.0.0", "::", "") else "*"
    return {"FOLIO_KV_EVENTS_ENDPOINT": f"tcp://{host}:{args.kv_events_port}",
            "FOLIO_KV_SNAPSHOT_ENDPOINT": f"tcp://{host}:{snapshot_port}"}


def own_keys(args: argparse.Namespace) -> str | None:
    """The stack's key folder (``--keys-dir``, ``$FOLIO_KEYS_DIR``, else one of our own in the cache),
    its missing keys made: a server on one host needs no step of its user's for its tcp sockets
    (``--kv-events-port``, a prefill instance's KV transfers); a folder with what its services need
    (each one's server secret: a whole folder, or one ``folio keys split`` made for them) is only
    read. None, with a message, when it cannot."""
    from folio.shared.config import default_keys_dir, keys_dir_from_env
    from folio.shared.keys import KeysError, init_keys, load_keys

    folder = str(args.keys_dir or keys_dir_from_env() or default_keys_dir())
    try:  # complete already (the compose stack's keys, mounted read-only): nothing to write
        for name in SERVICES:
            load_keys(folder, service=name)
        return folder
    except KeysError:
        pass
    try:
        init_keys(folder)
    except (OSError, KeysError) as exc:
        print(f"folio: cannot make the keys in {folder}: {exc}", file=sys.stderr)
        return None
    return folder


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when ``folio serve`` goes away, even by SIGKILL; sockets
    and files it makes are its user's alone (ipc sockets 0600 in the 0700 run folder)."""
    os.umask(0o077)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the parent's own shutdown still stops them


def serve(args: argparse.Namespace) -> int:
    from folio.core.model_files import encoder_only_refusal, resolve_model
    from folio.services.supervise import Supervisor
    from folio.core.executor.runtime.spec_config import speculative_refusal

    if args.lora_modules and not args.enable_lora:
        print("folio: --lora-modules needs --enable-lora", file=sys.stderr)
        return 2
    refusal = speculative_refusal(args)
    if refusal:
        print(f"folio: {refusal}", file=sys.stderr)
        return 2
    if args.otlp_traces_endpoint:
        from folio.shared.tracing import setup

        try:  # said once here, not by five services failing to start
            setup(args.otlp_traces_endpoint, "serve").shutdown()
        except RuntimeError as exc:
            print(f"folio: {exc}", file=sys.stderr)
            return 2
    try:
        model_path = str(resolve_model(args.model))
    except FileNotFoundError as exc:
        print(f"folio: {exc}", file=sys.stderr)
        return 1
    refusal = encoder_only_refusal(model_path, args.task, args.quantization, args.device, args.tensor_parallel_size)
    if refusal:
        print(f"folio: {refusal}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.port)
    lock = claim_run_dir(run_dir)
    if lock is None:
        return 1
    try:
        if _someone_answers(Endpoints.ipc(run_dir)):  # services started by hand, without the lock
            print(f"folio: another folio is serving in {run_dir}; stop it or pass --run-dir", file=sys.stderr)
            return 1
        for stale in run_dir.glob("*.sock"):
            stale.unlink()
        keys_dir = own_keys(args)
        if keys_dir is None:
            return 1
        env = {**os.environ, "FOLIO_ENDPOINTS": "ipc", "FOLIO_RUN_DIR": str(run_dir), "FOLIO_KEYS_DIR": keys_dir,
               **kv_events_env(args)}
        if args.api_key:
            env["FOLIO_API_KEY"] = args.api_key  # not on the command line, where `ps` shows it
        commands = {name: [sys.executable, "-m", "folio.cli.main", "run", name, *service_argv(name, args, model_path)]
                    for name in SERVICES}
        supervisor = Supervisor(commands, env, restart=not args.no_restart, max_restarts=args.max_restarts,
                                preexec_fn=_die_with_parent)
        print(f"folio: starting {model_path} (sockets in {run_dir}); Ctrl-C stops", file=sys.stderr, flush=True)
        threading.Thread(target=_say_when_ready, args=(Endpoints.ipc(run_dir), args, time.monotonic()),
                         daemon=True).start()
        return supervisor.run()
    finally:
        os.close(lock)


def claim_run_dir(run_dir: Path) -> int | None:
    """Lock ``run_dir`` for this server's life (the kernel drops the lock when we die, however we
    die); None, with a message, when another server holds it. Atomic: of two servers started at
    the same instant on one folder exactly one gets it."""
    make_run_dir(run_dir)  # (another user's folder: the lock below says who holds it)
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        print(f"folio: another folio (pid {holder}) is serving in {run_dir}; stop it, or pass another "
              f"--port or --run-dir", file=sys.stderr)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _someone_answers(endpoints: Endpoints) -> bool:
    return Path(endpoints.admin_kvmanager.removeprefix("ipc://")).exists() and \
        admin_call(endpoints.admin_kvmanager, "ping", {}, 0.3) is not None


def _say_when_ready(endpoints: Endpoints, args: argparse.Namespace, t0: float) -> None:
    """Startup only (a side thread): once every service answers, the pool is up and ``/health``
    says 200, print the ready line and where the start-up time went (``startup_breakdown``)."""
    answered: dict[str, float] = {}

    def wait_for(name: str) -> None:
        while True:
            reply = admin_call(getattr(endpoints, f"admin_{name}"), "stats" if name == "scheduler" else "ping", {},
                               1.0)
            if reply is not None and reply.data.get("pool_ready", True):
                answered[name] = time.monotonic() - t0
                return
            time.sleep(0.1)

    waiters = [threading.Thread(target=wait_for, args=(name,), daemon=True) for name in SERVICES]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join()
    host = "localhost" if args.host in ("0.0.0.0", "::") else args.host
    healthy = _wait_healthy("127.0.0.1" if host == "localhost" else host, args.port)
    total = time.monotonic() - t0
    reply = admin_call(endpoints.admin_executor, "stats", {}, 5.0)
    executor = (reply.data.get("startup") if reply is not None else None) or {}
    print(f"folio: ready at http://{host}:{args.port}/v1", file=sys.stderr, flush=True)
    print(f"folio: {startup_breakdown(total if healthy else None, answered, executor)}", file=sys.stderr, flush=True)


def _wait_healthy(host: str, port: int, timeout_s: float = 30.0) -> bool:
    """Poll the gateway's ``/health`` until it answers 200 (False: not within ``timeout_s``)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/health"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    return False


def startup_breakdown(total_s: float | None, answered: dict[str, float], executor: dict) -> str:
    """One line: the time to a healthy ``/health``, each service's time to answer (from the launch;
    the scheduler's: to a ready pool), and the executor's phases (from its process start; ``other``:
    the rest of its time to ready)."""
    line = f"start-up {total_s:.1f} s to a healthy /health" if total_s is not None else \
        "start-up: /health not healthy in time"
    line += "; services ready: " + ", ".join(f"{n} {answered[n]:.1f} s" for n in SERVICES if n in answered)
    phases, notes, ready = executor.get("phases", {}), executor.get("notes", {}), executor.get("ready_s")
    if ready is None:
        return line
    parts = []
    for name in EXECUTOR_PHASES:
        cache = notes.get(f"{name}_cache")
        parts.append(f"{name} {phases.get(name, 0.0):.2f}" + (f" (cache {cache})" if cache else ""))
    parts.append(f"other {max(0.0, ready - sum(phases.get(n, 0.0) for n in EXECUTOR_PHASES)):.2f}")
    return line + f"; executor {ready:.1f} s: " + ", ".join(parts)
