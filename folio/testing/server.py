"""``folio serve`` started for real (five processes, ipc:// sockets, HTTP), as a subprocess, and stopped."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass

from folio.shared.transport import ask_service
from folio.shared.config import Endpoints


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    base_url: str
    endpoints: Endpoints
    proc: subprocess.Popen

    def admin(self, service: str, command: str, **args) -> dict:
        reply = ask_service(self.endpoints, service, command, args, 5.0)
        assert reply is not None and reply.ok, f"{service} {command}: {reply}"
        return reply.data

    def wait_for(self, predicate, timeout_s: float = 10.0, what: str = "condition"):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")


def start_server(model: str, *flags: str, ready_timeout_s: float = 180.0) -> Server:
    import urllib.request

    run_dir = tempfile.mkdtemp(prefix="folio-e2e-", dir="/tmp")
    port = free_port()
    cmd = [sys.executable, "-m", "folio.cli.main", "serve", "--model", model, "--port", str(port),
           "--host", "127.0.0.1", "--run-dir", run_dir, "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"folio serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    server = Server(base + "/v1", Endpoints.ipc(run_dir), proc)
                    if server.admin("scheduler", "stats").get("pool_ready", True):
                        return server
        except OSError:
            pass
        time.sleep(0.25)
    proc.terminate()
    raise RuntimeError("folio serve did not become ready")


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.proc.kill()


@contextmanager
def served(model: str, *flags: str):
    """A ``folio serve`` for the ``with`` block (a module fixture's body: ``with served(...) as s: yield s``)."""
    server = start_server(model, *flags)
    try:
        yield server
    finally:
        stop_server(server)


def post_json(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    """(status, decoded body) of a JSON POST; an HTTP error's status and error body, not an exception."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def folio_metrics(server: Server) -> dict[str, float]:
    """The server's ``folio:`` samples from /metrics, by name (labels dropped: one sample per name)."""
    import urllib.request

    with urllib.request.urlopen(server.base_url.removesuffix("/v1") + "/metrics", timeout=30) as r:
        return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                if line.startswith("folio:") and " " in line}

