"""A clean stop prints only folio's own lines: ``folio serve`` on a tiny model answers one request,
then gets SIGTERM (what Ctrl-C sends through the launcher); every line the launcher and its
services wrote, stdout and stderr, is the launcher's (``folio: ...``) or a service's log line.

The executor's model used to be built with torch's random init on the meta device, whose first call
imports ``torch._dynamo`` and with it triton (when installed); triton's bindings then printed
hundreds of "nanobind: leaked ..." lines when the process exited."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from folio.testing.models import write_tiny_chat_model

SERVICES = ("gateway", "tokenizer", "scheduler", "kvmanager", "executor")
OWN_LINE = re.compile(r"folio: .*|\d{4}-\d\d-\d\dT\S+Z \[(debug|info|warning|error|critical) *\] .*"
                      rf"\bservice=({'|'.join(SERVICES)})\b.*")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "folio serve exited while starting"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise AssertionError("folio serve did not become healthy")


def test_a_sigterm_stop_prints_only_folios_own_lines(smollm_tokenizer_dir, tmp_path):
    model = write_tiny_chat_model(tmp_path / "tiny", smollm_tokenizer_dir)
    port, run_dir = free_port(), tempfile.mkdtemp(prefix="folio-t-", dir="/tmp")
    out = tmp_path / "output.txt"
    env = {k: v for k, v in os.environ.items() if k != "FOLIO_RUN_DIR"}
    cmd = [sys.executable, "-m", "folio.cli.main", "serve", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--run-dir", run_dir, "--num-kv-blocks", "64", "--dtype", "float32"]
    with open(out, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(port, proc)
        body = json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(run_dir, ignore_errors=True)
    lines = [line for line in out.read_text().splitlines() if line.strip()]
    foreign = [line for line in lines if not OWN_LINE.fullmatch(line)]
    assert foreign == [], "\n".join(foreign[:20])
    assert "folio: SIGTERM received, stopping the services" in lines
    stopped = {name for name in SERVICES for line in lines if "stopping " in line and f"service={name}" in line}
    assert stopped == set(SERVICES), lines[-20:]
