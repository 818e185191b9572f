"""``python -m folio.services.gateway.main`` as a process: flags reach the config, HTTP on a real port,
and SIGTERM stops it cleanly (exit 0)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from folio.services.gateway.main import parse_config
from tests.services.frontend import short_run_dir

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_flags_reach_the_config():
    config = parse_config(["--model", "/models/Qwen2.5-0.5B/", "--port", "9001", "--host", "127.0.0.1",
                           "--api-key", "k", "--log-json"])
    assert (config.port, config.host, config.api_key, config.log_json) == (9001, "127.0.0.1", "k", True)
    assert config.model_name == "Qwen2.5-0.5B"
    assert parse_config([]).model_name == "SmolLM2-135M-Instruct" and parse_config([]).port == 8000
    assert parse_config(["--served-model-name", "m"]).model_name == "m"


@pytest.mark.asyncio
async def test_main_serves_http_and_stops_on_sigterm():
    run_dir, port = short_run_dir(), free_port()
    env = {**os.environ, "FOLIO_RUN_DIR": run_dir, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "folio.services.gateway.main", "--host", "127.0.0.1", "--port",
                             str(port), "--api-key", "k", "--served-model-name", "m"],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(300):
                try:
                    async with http.get(f"{base}/live") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            async with http.get(f"{base}/v1/models", headers={"Authorization": "Bearer k"}) as r:
                assert (await r.json())["data"][0]["id"] == "m"
            async with http.get(f"{base}/v1/models") as r:
                assert r.status == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, proc.stderr.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
