"""Real processes for the router's tests and ``scripts/bench_router.py``: ``folio serve`` replicas
publishing KV events over tcp, and ``folio run router`` in front of them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

import psutil

from folio.shared.transport import ask_service
from folio.shared.config import Endpoints
from folio.testing.server import free_port


@dataclass
class ReplicaProcess:
    model: str
    flags: tuple[str, ...]
    port: int = field(default_factory=free_port)
    kv_events_port: int = field(default_factory=free_port)
    kv_snapshot_port: int = field(default_factory=free_port)
    run_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="folio-r-", dir="/tmp"))
    proc: subprocess.Popen | None = None
    peer_key: str | None = None  # a key pair of its own (``folio keys init --peer``), named in its spec

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def spec(self) -> str:
        """How the router is told about it."""
        key = f",key={self.peer_key}" if self.peer_key else ""
        return f"{self.url},kv_events_port={self.kv_events_port},kv_snapshot_port={self.kv_snapshot_port}{key}"

    def start(self) -> "ReplicaProcess":
        cmd = [sys.executable, "-m", "folio.cli.main", "serve", "--model", self.model, "--host", "127.0.0.1",
               "--port", str(self.port), "--run-dir", self.run_dir, "--log-level", "warning",
               "--kv-events-port", str(self.kv_events_port), "--kv-snapshot-port", str(self.kv_snapshot_port),
               *self.flags]
        env = None
        if self.peer_key:
            from folio.shared.keys import PEER_ENV

            env = {**os.environ, PEER_ENV: self.peer_key}
        self.proc = subprocess.Popen(cmd, env=env)
        return self

    def wait_ready(self, timeout_s: float = 180.0) -> "ReplicaProcess":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"folio serve exited with {self.proc.returncode} before it was ready")
            if http_ok(self.url + "/health") and self.admin("scheduler", "stats", must=False).get("pool_ready"):
                return self
            time.sleep(0.25)
        raise RuntimeError("folio serve did not become ready")

    def admin(self, service: str, command: str, must: bool = True, **args) -> dict:
        reply = ask_service(Endpoints.ipc(self.run_dir), service, command, args, 5.0)
        if reply is None or not reply.ok:
            assert not must, f"{service} {command}: {reply}"
            return {}
        return reply.data

    def kill(self) -> None:
        """SIGKILL the whole replica at once, as a crashed node would go."""
        procs = psutil.Process(self.proc.pid).children(recursive=True) + [psutil.Process(self.proc.pid)]
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)


@dataclass
class RouterProc:
    proc: subprocess.Popen
    port: int
    run_dir: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def admin(self, command: str) -> dict:
        reply = ask_service(Endpoints.ipc(self.run_dir), "router", command, {}, 5.0)
        assert reply is not None and reply.ok, f"router {command}: {reply}"
        return reply.data

    def replicas(self) -> dict[str, dict]:
        return {row["replica"]: row for row in self.admin("replicas")["replicas"]}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def start_router(model: str, replicas: list[ReplicaProcess], *flags: str, num_up: int | None = None,
                 timeout_s: float = 60.0) -> RouterProc:
    run_dir = tempfile.mkdtemp(prefix="folio-rt-", dir="/tmp")
    port = free_port()
    cmd = [sys.executable, "-m", "folio.cli.main", "run", "router", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--poll-interval", "0.2", "--log-level", "warning", *flags]
    for replica in replicas:
        cmd += ["--replica", replica.spec]
    proc = subprocess.Popen(cmd, env={**os.environ, "FOLIO_ENDPOINTS": "ipc", "FOLIO_RUN_DIR": run_dir})
    router = RouterProc(proc, port, run_dir)
    wanted = len(replicas) if num_up is None else num_up
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with {proc.returncode}")
        health = http_json(router.url + "/health")
        if health and health.get("num_replicas_up", 0) >= wanted:
            return router
        time.sleep(0.2)
    router.stop()
    raise RuntimeError("the router did not see its replicas up")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def http_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def post(url: str, body: dict, timeout_s: float = 120.0) -> tuple[int, dict, str]:
    """(status, JSON body or {}, the replica that answered) of one non-streamed request."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read()), resp.headers.get("X-Folio-Replica", "")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}"), err.headers.get("X-Folio-Replica", "")
