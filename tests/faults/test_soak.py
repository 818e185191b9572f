"""CI's minute of ``folio bench soak``: Poisson arrivals above capacity (the queue limit
refuses some with 429) while a service is killed every 15 s; no request may be lost and no KV
block may leak (the script's ``--check``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a minute of load, and the bench prepares the packaged model
def test_a_minute_of_soak_loses_nothing_and_leaks_nothing(smollm_dir):
    run = subprocess.run([sys.executable, "-m", "folio.bench.soak", "--duration", "60",
                          "--kill-every", "15", "--rate", "20", "--check"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    out = run.stdout
    counts = re.search(r"requests: (\d+)  completed (\d+)  errored (\d+) .*lost (\d+)", out)
    assert counts, out
    total, completed, errored, lost = map(int, counts.groups())
    assert lost == 0 and completed > 0 and total == completed + errored, out
    assert "429" in out.split("by status:")[1].split(")")[0], f"the queue limit was never reached:\n{out}"
    assert len(re.findall(r"killed the", out)) >= 3, out
    assert "KV blocks in use after the load: 0" in out
