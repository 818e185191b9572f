"""``folio bench serve`` (the CLI, as a process) against a running ``folio serve`` and llama.cpp's
server (``folio.testing.llamacpp``: skipped, saying how to build it, when it is not built) on the
same packaged GGUF, with the same ``--seed``: every figure of vLLM's layout is printed, and the
token counts are exactly what was asked."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.slow  # both servers run the packaged SmolLM2

METRICS = ["Successful requests:", "Failed requests:", "Maximum request concurrency:", "Benchmark duration (s):",
           "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):",
           "Request goodput (req/s):", "Output token throughput (tok/s):", "Peak output token throughput (tok/s):",
           "Peak concurrent requests:", "Total Token throughput (tok/s):"]
METRICS += [f"{s} {m} (ms):" for m in ("TTFT", "TPOT", "ITL", "E2EL") for s in ("Mean", "Median", "P99")]
BENCH = ["--num-prompts", "6", "--input-len", "24", "--output-len", "8", "--max-concurrency", "3", "--seed", "7",
         "--goodput", "ttft:3600000", "tpot:600000", "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm"]


def bench(base_url: str, tmp_path, *extra: str) -> tuple[str, dict]:
    result = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "folio.cli.main", "bench", "serve", "--base-url", base_url,
                           *BENCH, "--save-result", str(result), *extra],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(result.read_text())


def figure(out: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\s+(\S+)\s*$", out, re.M)
    assert m, f"'{name}' not printed:\n{out}"
    return float(m.group(1))


def test_bench_serve_against_folio(server, tmp_path):
    out, saved = bench(server.base_url, tmp_path)
    for name in METRICS:
        figure(out, name)
    assert "Tokenizer: the endpoint's /tokenize" in out, out
    assert figure(out, "Successful requests:") == 6 and figure(out, "Failed requests:") == 0, out
    # token-accurate prompts (the served tokenizer) and ignore_eos: exactly the lengths asked
    assert figure(out, "Total input tokens:") == 6 * 24 and figure(out, "Total generated tokens:") == 6 * 8, out
    assert saved["input_lens"] == [24] * 6 and saved["output_lens"] == [8] * 6 and saved["model_id"], out
    # SLOs no run misses (a loaded 2-core machine saw 10 s per token): every request is good
    assert figure(out, "Request goodput (req/s):") == figure(out, "Request throughput (req/s):") > 0, out
    assert 0 < saved["mean_ttft_ms"] <= saved["mean_e2el_ms"] and saved["mean_tpot_ms"] > 0, out
    assert 1 <= saved["max_concurrent_requests"] <= 6  # 1-second buckets, as vLLM counts it


# ---------------------------------------------------------------- llama.cpp's server


def test_bench_serve_against_llama_cpp_server(tmp_path):
    from folio.core.models import packaged_gguf
    from folio.testing.llamacpp import build_llama_server, find_llama_server, server_command

    binary = find_llama_server()
    if binary is None and os.environ.get("FOLIO_BUILD_LLAMA_SERVER") == "1":
        binary = build_llama_server()
    if binary is None:
        pytest.skip("llama.cpp's server is not built: `python -m folio.testing.llamacpp` builds llama-server from "
                    "the llama-cpp-python source on the package index (minutes), or set FOLIO_LLAMA_SERVER, or "
                    "put llama-server on the PATH, or run with FOLIO_BUILD_LLAMA_SERVER=1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(server_command(binary, str(packaged_gguf()), port, parallel=3),
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "llama.log", "w"))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "llama.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, "llama.cpp's server did not come up in 120 s"
                time.sleep(0.5)
        out, saved = bench(f"http://127.0.0.1:{port}", tmp_path)
    finally:
        proc.terminate()
        proc.wait(30)
    for name in METRICS:
        figure(out, name)
    assert figure(out, "Successful requests:") == 6 and figure(out, "Failed requests:") == 0
    assert figure(out, "Total generated tokens:") > 0
