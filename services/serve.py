"""``folio serve``: start the five services as processes on ``ipc://`` sockets and supervise them.

The model is resolved (prepared if needed) once, here, and every service gets its folder. Each
child runs ``folio run NAME`` with the flags that concern it; the sockets live in one run folder
(``--run-dir``, default ``$FOLIO_RUN_DIR`` or /tmp/folio). Ctrl-C or SIGTERM stops them all; when
one dies, we say which and why (exit code or signal) and stop the others. Children are in their own
process group (a Ctrl-C reaches only us, and we stop them in order) and get SIGTERM if we vanish.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from shared.config import DEFAULT_MODEL_NAME, Endpoints, run_dir_from_env

SERVICES = ("kvmanager", "executor", "scheduler", "tokenizer", "gateway")  # start order
STOP_TIMEOUT_S = 10.0
_PR_SET_PDEATHSIG = 1

# which serve flag goes to which service (dest name -> services); the model goes to all that load it
_FLAG_TARGETS = {
    "served_model_name": ("gateway",),
    "host": ("gateway",),
    "port": ("gateway",),
    "dtype": ("executor",),
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
}


class _Stop(Exception):
    """Raised from the SIGTERM/SIGINT handler to leave the wait for children."""


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
    parser.add_argument("--run-dir", default=None, help="folder for the ipc:// sockets (default $FOLIO_RUN_DIR or /tmp/folio)")
    parser.add_argument("--kv-events-port", type=int, default=None,
                        help="publish the KV events over tcp on --host:PORT (for a router; default: ipc only)")
    parser.add_argument("--kv-snapshot-port", type=int, default=None,
                        help="the KV snapshot socket routers resync from (default: --kv-events-port + 1)")
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


def describe_exit(status: int) -> str:
    if status < 0:
        return f"was killed by {signal.Signals(-status).name}"
    return f"exited with code {status}"


def serve(args: argparse.Namespace) -> int:
    from services.executor.prepare import resolve_model

    try:
        model_path = str(resolve_model(args.model))
    except FileNotFoundError as exc:
        print(f"folio: {exc}", file=sys.stderr)
        return 1
    run_dir = Path(args.run_dir) if args.run_dir else run_dir_from_env()
    run_dir.mkdir(parents=True, exist_ok=True)
    if _someone_answers(Endpoints.ipc(run_dir)):
        print(f"folio: another folio is serving in {run_dir}; stop it or pass --run-dir", file=sys.stderr)
        return 1
    for stale in run_dir.glob("*.sock"):
        stale.unlink()
    env = {**os.environ, "FOLIO_ENDPOINTS": "ipc", "FOLIO_RUN_DIR": str(run_dir), **kv_events_env(args)}
    if args.api_key:
        env["FOLIO_API_KEY"] = args.api_key  # not on the command line, where `ps` shows it

    def on_signal(signum, frame):
        raise _Stop(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    procs: dict[str, subprocess.Popen] = {}
    code = 0
    try:
        for name in SERVICES:
            cmd = [sys.executable, "-m", "services.cli", "run", name, *service_argv(name, args, model_path)]
            procs[name] = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        print(f"folio: starting {model_path} (sockets in {run_dir}); Ctrl-C stops", file=sys.stderr, flush=True)
        threading.Thread(target=_say_when_ready, args=(Endpoints.ipc(run_dir), args), daemon=True).start()
        code = _wait_for_a_death(procs)
    except _Stop as stop:
        print(f"folio: {stop} received, stopping the services", file=sys.stderr, flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        _stop_all(procs)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


def _someone_answers(endpoints: Endpoints) -> bool:
    from services.cli import admin_call

    return Path(endpoints.admin_kvmanager.removeprefix("ipc://")).exists() and \
        admin_call(endpoints, "kvmanager", "ping", {}, 0.3) is not None


def _say_when_ready(endpoints: Endpoints, args: argparse.Namespace) -> None:
    """Startup only (a side thread): print one line once every service answers and the pool is up."""
    from services.cli import admin_call

    waiting = list(SERVICES)
    while waiting:
        reply = admin_call(endpoints, waiting[0], "stats" if waiting[0] == "scheduler" else "ping", {}, 1.0)
        if reply is not None and reply.data.get("pool_ready", True):
            waiting.pop(0)
        else:
            time.sleep(0.2)
    host = "localhost" if args.host in ("0.0.0.0", "::") else args.host
    print(f"folio: ready at http://{host}:{args.port}/v1", file=sys.stderr, flush=True)


def _wait_for_a_death(procs: dict[str, subprocess.Popen]) -> int:
    """Block until a child exits (no polling: os.wait), say which and why; 1 for the caller."""
    by_pid = {p.pid: name for name, p in procs.items()}
    while True:
        pid, status = os.wait()
        name = by_pid.get(pid)
        if name is None:
            continue
        procs[name].returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        print(f"folio: the {name} service {describe_exit(procs[name].returncode)}; stopping the others",
              file=sys.stderr, flush=True)
        return 1


def _stop_all(procs: dict[str, subprocess.Popen]) -> None:
    """SIGTERM every live child, newest first; SIGKILL what is still there after the timeout."""
    alive = [(n, p) for n, p in reversed(procs.items()) if p.returncode is None]
    for _, proc in alive:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for name, proc in alive:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"folio: the {name} service did not stop in {STOP_TIMEOUT_S:.0f}s; killing it", file=sys.stderr)
            proc.kill()
            proc.wait()
        if proc.returncode not in (0, -signal.SIGTERM):
            print(f"folio: the {name} service {describe_exit(proc.returncode)} while stopping", file=sys.stderr)
