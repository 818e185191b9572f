"""An idle ``folio serve`` takes no CPU: after answering requests (which start the quantized GEMMs'
thread pool), its five services together use under 3% of one core over five idle seconds.

The executor and the tokenizer used to take 7% and 6% of a core doing nothing: each admin ping
(the gateway sends one to every service twice a second) counted the objects the service had frozen
out of the collector's sight, and ``gc.get_freeze_count()`` walks that whole list (35 ms for an
executor's 200,000 objects)."""

from __future__ import annotations

import json
import os
import time
import urllib.request

import psutil
import pytest

from folio.testing.models import write_tiny_chat_model
from folio.testing.server import start_server, stop_server

pytestmark = pytest.mark.slow  # it watches an idle server for 10 s

IDLE_S = 5.0


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def test_an_idle_server_takes_no_cpu(smollm_tokenizer_dir, tmp_path):
    model = write_tiny_chat_model(tmp_path / "tiny", smollm_tokenizer_dir)
    server = start_server(model, "--num-kv-blocks", "64", "--quantization", "int4")
    try:
        body = json.dumps({"prompt": "Hello", "max_tokens": 8, "temperature": 0}).encode()
        for _ in range(3):
            request = urllib.request.Request(server.base_url + "/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as resp:
                assert json.loads(resp.read())["usage"]["completion_tokens"] == 8
        services = psutil.Process(server.proc.pid).children(recursive=True)
        assert len(services) >= 5, services
        time.sleep(1.0)  # the last step's spinning ends 0.2 ms after it
        before, t0 = cpu_seconds(services), time.monotonic()
        time.sleep(IDLE_S)
        share = (cpu_seconds(services) - before) / (time.monotonic() - t0)
        per_service = {p.pid: p.cmdline()[-1] for p in services}
        assert share < 0.03, (share, per_service, os.getloadavg())
    finally:
        stop_server(server)
