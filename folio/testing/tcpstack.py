"""The five services as separate processes on tcp endpoints, the way compose and Kubernetes run
them (``FOLIO_ENDPOINTS=tcp``, every socket CURVE; each process reads its own share of the stack's
key folder, ``folio keys split``, holding its own server secret alone), on 127.0.0.1 and free ports.

For tests that attack the internal plane (``tests/security/``): ``TcpStack.ports()`` names every
tcp port the stack opens (the thirteen of ``Endpoints.tcp`` and the prefill executor's KV transfer
port), ``alive()`` says whether every process still runs, ``log_text()`` is what they logged. For
``folio bench plane``: ``kv_role=False`` (a plain executor, no KV transfer port), ``flags`` per
service, ``env`` added to every service's (``FOLIO_UNSAFE_NO_CURVE``: the stack without CURVE).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, fields
from pathlib import Path

from folio.shared.config import Endpoints
from folio.shared.keys import split_keys
from folio.shared.transport import admin_call

SERVICES = ("kvmanager", "executor", "scheduler", "tokenizer", "gateway")


def free_port_run(count: int) -> int:
    """A base port with ``count`` free ports from it (checked by binding each)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65000:
            continue
        try:
            held = []
            for p in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no run of free ports")


@dataclass
class TcpStack:
    model: str
    keys_dir: str
    executor_flags: tuple[str, ...] = ()
    kv_role: bool = True  # the executor a prefill instance with a KV transfer port
    dtype: str | None = "float32"
    flags: dict = field(default_factory=dict)  # service -> more of its flags
    extra_env: dict = field(default_factory=dict)
    base_port: int = 0
    http_port: int = 0
    kv_transfer_port: int = 0
    run_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="folio-tcp-"))
    procs: dict = field(default_factory=dict)

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints.tcp(self.base_port, "127.0.0.1")

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def env(self) -> dict:
        return {**os.environ, "FOLIO_ENDPOINTS": "tcp", "FOLIO_TCP_HOST": "127.0.0.1",
                "FOLIO_BASE_PORT": str(self.base_port), "FOLIO_KEYS_DIR": self.keys_dir, **self.extra_env}

    def service_env(self, name: str) -> dict:
        """``env()`` with ``name``'s own reduced key folder (``split_keys``), as its container gets."""
        return {**self.env(), "FOLIO_KEYS_DIR": str(Path(self.run_dir) / "keys" / name)}

    def ports(self) -> dict[str, int]:
        """Every tcp port the stack opens, by the socket's name."""
        out = {f.name: int(getattr(self.endpoints, f.name).rsplit(":", 1)[1]) for f in fields(Endpoints)}
        out.pop("admin_router")  # the router is not part of a replica
        if self.kv_role:
            out["kv_transfer"] = self.kv_transfer_port
        return out

    def start(self, timeout_s: float = 120.0) -> "TcpStack":
        self.base_port = free_port_run(16)
        self.http_port, self.kv_transfer_port = self.base_port + 14, self.base_port + 15
        kv_role = ["--kv-role", "prefill", "--kv-transfer-port", str(self.kv_transfer_port)] if self.kv_role else []
        dtype = ["--dtype", self.dtype] if self.dtype else []
        argv = {"kvmanager": [], "scheduler": [], "tokenizer": ["--model", self.model],
                "executor": ["--model", self.model, "--device", "cpu", *dtype, "--num-kv-blocks", "256",
                             *kv_role, *self.executor_flags],
                "gateway": ["--model", self.model, "--host", "127.0.0.1", "--port", str(self.http_port)]}
        for name in SERVICES:
            split_keys(self.keys_dir, Path(self.run_dir) / "keys" / name, [name])
            log = open(Path(self.run_dir) / f"{name}.log", "w")
            cmd = [sys.executable, "-m", "folio.cli.main", "run", name, *argv[name], *self.flags.get(name, ())]
            self.procs[name] = subprocess.Popen(cmd, env=self.service_env(name), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        pending = set(SERVICES)
        try:
            while pending:
                assert self.alive(), self.log_text()
                assert time.monotonic() < deadline, f"not up: {pending}\n{self.log_text()}"
                pending = {s for s in pending if self.admin(s, "ping", timeout_s=0.5) is None}
            # every service answers its own ping; the gateway serves once its own probes say so too
            while not self.healthy():
                assert self.alive(), self.log_text()
                assert time.monotonic() < deadline, f"/health not 200\n{self.log_text()}"
                time.sleep(0.2)
        except BaseException as exc:  # a stack that did not come up leaves no process behind
            logs = self.log_text()
            self.stop()
            raise AssertionError(f"the stack did not start ({exc!r}):\n{logs}") from None
        return self

    def healthy(self) -> bool:
        """The gateway's ``/health`` is 200 (every service answered its probes)."""
        try:
            with urllib.request.urlopen(self.http + "/health", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def admin(self, service: str, command: str, args: dict | None = None, timeout_s: float = 1.0):
        """``admin_call`` to ``service`` with this stack's keys (and, for a stack started with
        ``FOLIO_UNSAFE_NO_CURVE``, in the clear as it is): the reply, None without one."""
        from folio.shared import curve

        saved = os.environ.get(curve.UNSAFE_ENV)
        os.environ[curve.UNSAFE_ENV] = self.extra_env.get(curve.UNSAFE_ENV, "0")
        try:
            if curve.stack_keys() is None or curve.stack_keys().folder != self.keys_dir:
                curve.use_keys(self.keys_dir)
            return admin_call(getattr(self.endpoints, f"admin_{service}"), command, args or {}, timeout_s,
                              service=service)
        finally:
            if saved is None:
                os.environ.pop(curve.UNSAFE_ENV)
            else:
                os.environ[curve.UNSAFE_ENV] = saved

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def log_text(self, name: str | None = None) -> str:
        names = [name] if name else list(self.procs)
        return "\n".join(f"--- {n}\n" + (Path(self.run_dir) / f"{n}.log").read_text(errors="replace")
                         for n in names)

    def stop(self) -> dict[str, int | None]:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {}
        for n, p in self.procs.items():
            try:
                codes[n] = p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[n] = None
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return codes
