"""The fault suite's tools: a real ``folio serve`` (five processes on a tiny random model), a mixed
workload of streams (greedy, seeded sampling, n > 1, beam search, chat), a client that sorts each
stream's outcome, and the service processes to kill or stop.

``scripts/bench_soak.py`` uses the same server and client.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import aiohttp
import psutil

from folio.shared.transport import ask_service
from folio.shared.config import Endpoints
from folio.testing.server import free_port

SERVICES = ("kvmanager", "executor", "scheduler", "tokenizer", "gateway")


@dataclass
class Served:
    """One ``folio serve`` and what the tests ask of it."""

    proc: subprocess.Popen
    port: int
    run_dir: str
    log: object
    model_name: str = ""

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints.ipc(self.run_dir)

    def child(self, name: str) -> psutil.Process:
        for c in psutil.Process(self.proc.pid).children():
            try:
                if c.cmdline()[4] == name:  # python -m folio.cli.main run NAME
                    return c
            except (psutil.NoSuchProcess, IndexError):
                continue
        raise LookupError(f"no {name} process")

    def health(self) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as exc:
            return exc.code, json.load(exc)
        except OSError:
            return 0, {}

    def wait_healthy(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while self.health()[0] != 200:
            assert self.proc.poll() is None, self.stderr()[-3000:]
            assert time.monotonic() < deadline, f"not healthy: {self.health()}\n{self.stderr()[-3000:]}"
            time.sleep(0.2)

    def admin(self, service: str, command: str) -> dict:
        reply = ask_service(self.endpoints, service, command, {}, 5.0)
        assert reply is not None and reply.ok, f"{service} {command}: {reply}"
        return reply.data

    def wait_idle(self, timeout_s: float = 30) -> dict:
        """Poll until nothing runs and no block is in use; the last kvmanager stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            kv, sched = self.admin("kvmanager", "stats"), self.admin("scheduler", "stats")
            busy = sched["num_running"] + sched["num_waiting"] + sched["num_swapped"]
            if kv["num_blocks_used"] == 0 and kv["num_seqs"] == 0 and busy == 0:
                return kv
            assert time.monotonic() < deadline, f"not idle: {kv} {sched}"
            time.sleep(0.1)

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return code


def start_serve(model: str, *flags: str) -> Served:
    run_dir = tempfile.mkdtemp(prefix="folio-x-", dir="/tmp")
    port = free_port()
    cmd = [sys.executable, "-m", "folio.cli.main", "serve", "--model", model, "--run-dir", run_dir,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--block-size", "8",
           "--log-level", "warning", *flags]
    log = tempfile.TemporaryFile("a+")  # children share it: appends only; a pipe could fill and block
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    served = Served(subprocess.Popen(cmd, stderr=log, env=env), port, run_dir, log)
    served.wait_healthy()
    return served


# --------------------------------------------------------------------------- the workload

PROMPTS = ["The river", "Once upon a time", "In the beginning", "A list of colors:", "Dear friend,",
           "The answer is", "Here is a poem", "Numbers: 1, 2,"]


def workload_specs(max_tokens: int) -> list[tuple[str, dict]]:
    """16 distinct requests (route, body): 8 greedy, 3 seeded samples, 2 with n=2 (seeded), 2 beam
    searches of width 2, 1 chat."""
    specs = []
    for p in PROMPTS:
        specs.append(("completions", {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}))
    for i in range(3):
        specs.append(("completions", {"prompt": PROMPTS[i + 3], "max_tokens": max_tokens, "temperature": 0.9,
                                      "top_p": 0.9, "seed": 100 + i, "ignore_eos": True}))
    for i in range(2):
        specs.append(("completions", {"prompt": PROMPTS[i], "max_tokens": max_tokens, "temperature": 1.0,
                                      "n": 2, "seed": 7 + i, "ignore_eos": True}))
    for i in range(2):
        specs.append(("completions", {"prompt": PROMPTS[6 + i], "max_tokens": max_tokens, "n": 2,
                                      "use_beam_search": True, "temperature": 0}))
    specs.append(("chat/completions", {"messages": [{"role": "user", "content": "Name three rivers."}],
                                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}))
    return specs


@dataclass
class Outcome:
    kind: str  # "ok" | "error" (a clear error: HTTP status or error event) | "dropped" | "timeout"
    texts: dict[int, str] = field(default_factory=dict)
    status: int = 0
    error: str = ""
    elapsed_s: float = 0.0
    first_token_at: float | None = None


def choice_text(route: str, choice: dict, streamed: bool) -> str:
    if route == "completions":
        return choice.get("text") or ""
    part = choice.get("delta" if streamed else "message") or {}
    return part.get("content") or ""


async def solo(http: aiohttp.ClientSession, base: str, route: str, body: dict) -> dict[int, str]:
    async with http.post(f"{base}/v1/{route}", json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
    return {c["index"]: choice_text(route, c, False) for c in data["choices"]}


async def stream(http: aiohttp.ClientSession, base: str, route: str, body: dict, deadline_s: float,
                 started: asyncio.Event | None = None) -> Outcome:
    """One streamed request, sorted into an Outcome; never waits past ``deadline_s``."""
    t0 = time.monotonic()
    out = Outcome("dropped")
    try:
        async with asyncio.timeout(deadline_s):
            async with http.post(f"{base}/v1/{route}", json={**body, "stream": True}) as r:
                out.status = r.status
                if r.status != 200:
                    out.kind, out.error = "error", (await r.json())["error"]["message"]
                    return out
                done = False
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        out.error = event["error"]["message"]
                        continue
                    for c in event["choices"]:
                        out.texts[c["index"]] = out.texts.get(c["index"], "") + choice_text(route, c, True)
                        if out.first_token_at is None and out.texts[c["index"]]:
                            out.first_token_at = time.monotonic()
                            if started is not None:
                                started.set()
                out.kind = ("error" if out.error else "ok") if done else "dropped"
    except TimeoutError:
        out.kind = "timeout"
    except (aiohttp.ClientError, ConnectionError) as exc:
        out.kind, out.error = "dropped", repr(exc)
    finally:
        out.elapsed_s = time.monotonic() - t0
    return out
