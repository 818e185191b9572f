"""``folio bench serve`` (the CLI, as a process) against a running ``folio serve``: every figure of
vLLM's layout is printed, and the token counts are exactly what was asked. (llama.cpp's server is
measured by ``folio bench cpu-vs-llamacpp``, which builds it: minutes, too long for the suite.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the server runs the packaged SmolLM2

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
