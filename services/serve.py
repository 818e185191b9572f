"""``folio serve``: start the five services as processes on ``ipc://`` sockets and supervise them.

The model is resolved (prepared if needed) once, here, and every service gets its folder. Each
child runs ``folio run NAME`` with the flags that concern it; the sockets live in one run folder
(``--run-dir``; default ``$FOLIO_RUN_DIR``, else one folder per port, /tmp/folio-PORT), claimed
with a lock held for the server's life, so two servers can never share sockets.

``supervise.Supervisor`` restarts a child that dies (with backoff, at most ``--max-restarts`` a
minute per service; past that everything stops with a message); ``--no-restart`` stops everything
at the first death instead. Ctrl-C or SIGTERM stops them all: the gateway first, which drains its
streams, then the rest. Children are in their own process group (a Ctrl-C reaches only us) and get
SIGTERM if we vanish.
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

from shared.config import DEFAULT_MODEL_NAME, Endpoints, default_run_dir
from shared.loops import admin_call

SERVICES = ("kvmanager", "executor", "scheduler", "tokenizer", "gateway")  # start order
LOCK_NAME = "serve.lock"
_PR_SET_PDEATHSIG = 1

# which serve flag goes to which service (dest name -> services); the model goes to all that load it
_FLAG_TARGETS = {
    "served_model_name": ("gateway",),
    "host": ("gateway",),
    "port": ("gateway",),
    "dtype": ("executor",),
    "quantization": ("executor",),
    "device": ("executor",),
    "block_size": ("executor",),
    "num_kv_blocks": ("executor",),
    "kv_cache_memory_bytes": ("executor",),
    "gpu_memory_utilization": ("executor",),
    "attention_backend": ("executor",),
    "max_num_seqs": ("executor", "scheduler"),
    "max_num_batched_tokens": ("executor", "scheduler"),
    "max_model_len": ("scheduler", "tokenizer"),
    "log_level": SERVICES,
    "enable_prefix_caching": ("kvmanager",),
    "num_host_blocks": ("executor",),
    "speculative_model": ("executor",),
    "num_speculative_tokens": ("executor",),
    "ngram_prompt_lookup_max": ("executor",),
    "ngram_prompt_lookup_min": ("executor",),
    "speculative_disable_by_batch_size": ("executor",),
    "enable_chunked_prefill": ("scheduler",),
    "long_prefill_token_threshold": ("scheduler",),
    "preemption_mode": ("scheduler",),
    "scheduling_policy": ("scheduler",),
    "request_timeout": ("gateway",),
    "max_queue_len": ("gateway",),
    "max_concurrent_requests": ("gateway",),
    "max_body_bytes": ("gateway",),
}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from services.executor.main import add_runtime_args
    from services.scheduler.main import add_scheduling_args

    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="the default model's name, a model folder or a .gguf")
    parser.add_argument("--served-model-name", default=None, help="the model name clients use")
    parser.add_argument("--host", default="0.0.0.0", help="HTTP address of the gateway")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of the gateway")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request")
    add_runtime_args(parser, include_model=False)
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse cached KV blocks of shared prompt prefixes (default: on)")
    add_scheduling_args(parser, defaults_none=True)
    parser.add_argument("--run-dir", default=None,
                        help="folder for the ipc:// sockets (default $FOLIO_RUN_DIR, else /tmp/folio-PORT)")
    parser.add_argument("--kv-events-port", type=int, default=None,
                        help="publish the KV events over tcp on --host:PORT (for a router; default: ipc only)")
    parser.add_argument("--kv-snapshot-port", type=int, default=None,
                        help="the KV snapshot socket routers resync from (default: --kv-events-port + 1)")
    parser.add_argument("--no-restart", action="store_true",
                        help="stop everything when a service dies instead of restarting it")
    parser.add_argument("--max-restarts", type=int, default=5,
                        help="restarts of one service within a minute before everything stops")
    from services.gateway.main import add_limit_args

    add_limit_args(parser, defaults_none=True)
    parser.add_argument("--log-json", action="store_true", help="every service logs JSON lines")
    parser.add_argument("--log-level", default="info")


def service_argv(name: str, args: argparse.Namespace, model_path: str) -> list[str]:
    """The flags ``folio run NAME`` gets: those that concern it, only when they were given."""
    argv = ["--model", model_path] if name in ("executor", "tokenizer", "gateway") else []
    for dest, targets in _FLAG_TARGETS.items():
        value = getattr(args, dest)
        if name in targets and value is not None:
            flag = f"--{dest.replace('_', '-')}"
            if isinstance(value, bool):  # an on/off flag: --x or --no-x
                argv.append(flag if value else f"--no-{flag[2:]}")
            else:
                argv += [flag, str(value)]
    if args.log_json:
        argv.append("--log-json")
    return argv


def kv_events_env(args: argparse.Namespace) -> dict[str, str]:
    """Where the kvmanager publishes KV events and answers snapshots, when a router must reach them."""
    if args.kv_events_port is None:
        return {}
    snapshot_port = args.kv_snapshot_port or args.kv_events_port + 1
    host = args.host if args.host not in ("0.0.0.0", "::", "") else "*"
    return {"FOLIO_KV_EVENTS_ENDPOINT": f"tcp://{host}:{args.kv_events_port}",
            "FOLIO_KV_SNAPSHOT_ENDPOINT": f"tcp://{host}:{snapshot_port}"}


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when ``folio serve`` goes away, even by SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the parent's own shutdown still stops them


def serve(args: argparse.Namespace) -> int:
    from shared.models import resolve_model
    from services.supervise import Supervisor

    try:
        model_path = str(resolve_model(args.model))
    except FileNotFoundError as exc:
        print(f"folio: {exc}", file=sys.stderr)
        return 1
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
        env = {**os.environ, "FOLIO_ENDPOINTS": "ipc", "FOLIO_RUN_DIR": str(run_dir), **kv_events_env(args)}
        if args.api_key:
            env["FOLIO_API_KEY"] = args.api_key  # not on the command line, where `ps` shows it
        commands = {name: [sys.executable, "-m", "services.cli", "run", name, *service_argv(name, args, model_path)]
                    for name in SERVICES}
        supervisor = Supervisor(commands, env, restart=not args.no_restart, max_restarts=args.max_restarts,
                                preexec_fn=_die_with_parent)
        print(f"folio: starting {model_path} (sockets in {run_dir}); Ctrl-C stops", file=sys.stderr, flush=True)
        threading.Thread(target=_say_when_ready, args=(Endpoints.ipc(run_dir), args), daemon=True).start()
        return supervisor.run()
    finally:
        os.close(lock)


def claim_run_dir(run_dir: Path) -> int | None:
    """Lock ``run_dir`` for this server's life (the kernel drops the lock when we die, however we
    die); None, with a message, when another server holds it. Atomic: of two servers started at
    the same instant on one folder exactly one gets it."""
    run_dir.mkdir(parents=True, exist_ok=True)
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


def _say_when_ready(endpoints: Endpoints, args: argparse.Namespace) -> None:
    """Startup only (a side thread): print one line once every service answers and the pool is up."""
    waiting = list(SERVICES)
    while waiting:
        reply = admin_call(getattr(endpoints, f"admin_{waiting[0]}"),
                           "stats" if waiting[0] == "scheduler" else "ping", {}, 1.0)
        if reply is not None and reply.data.get("pool_ready", True):
            waiting.pop(0)
        else:
            time.sleep(0.2)
    host = "localhost" if args.host in ("0.0.0.0", "::") else args.host
    print(f"folio: ready at http://{host}:{args.port}/v1", file=sys.stderr, flush=True)
