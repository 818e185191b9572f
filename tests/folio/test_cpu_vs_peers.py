"""``folio bench cpu-vs-llamacpp``'s parts: llama.cpp's log-probability files written and read as
``llama-perplexity`` does and the KL divergence over them, the page-cache share and its eviction, the
memory of a process tree, the private folio cache a cold start empties, and the ratios.

Slow, with the peers built (``FOLIO_BUILD_LLAMA_SERVER=1`` builds them, once, into the folio cache;
otherwise they skip, saying how: building both takes tens of minutes on two cores, more than a CI run of
a fresh machine can spend): ``--quick`` end to end, every measure printed for folio and
each peer configuration and every ratio recomputed from the printed figures; and the KL divergence
computed here against ``llama-perplexity --kl-divergence``'s own on the same files."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from folio.bench import peer_quality as pq
from folio.bench import peer_runs as pr
from folio.bench.cpu_vs_llamacpp import MEASURES, compare


def write_dump(path, log_probs: np.ndarray, n_ctx: int, n_chunk: int = 1, tokens=None) -> None:
    """A llama.cpp log-probability file of ``log_probs`` ``[n_chunk * (n_ctx - 1 - n_ctx // 2), vocab]``."""
    tokens = np.arange(n_ctx * n_chunk, dtype=np.int32) if tokens is None else tokens
    with open(path, "wb") as f:
        f.write(pq.MAGIC + np.array([n_ctx, log_probs.shape[1], n_chunk], dtype=np.int32).tobytes())
        f.write(tokens.astype(np.int32).tobytes())
        f.write(pq.encode_log_probs(log_probs).tobytes())


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = x.max(1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(1, keepdims=True))


def test_log_probs_round_trip_within_llamacpps_16_bit_step(tmp_path):
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(2 * 9, 1001)) * 3).astype(np.float32)  # two chunks of n_ctx 20: 9 scored each
    write_dump(tmp_path / "a.dat", logits, n_ctx=20, n_chunk=2)
    dump = pq.read_dump(tmp_path / "a.dat")
    assert (dump.n_ctx, dump.n_vocab, dump.n_chunk, dump.first) == (20, 1001, 2, 10)
    assert dump.records.shape == (18, 1001 + 1 + 4)  # an odd vocabulary padded to even, and the header
    decoded, exact = dump.log_probs(slice(0, 18)), log_softmax(logits)
    kept = exact > exact.max(1, keepdims=True) - 16  # below, llama.cpp keeps only "at most e^-16"
    step = 16 / 65535
    assert np.abs(decoded - exact)[kept].max() <= step / 2 + 1e-5
    assert (decoded[~kept] <= exact.max(1, keepdims=True).repeat(1001, 1)[~kept] - 16 + 1e-4).all()


def test_the_kld_is_llamacpps_sum_over_the_scored_positions(tmp_path):
    rng = np.random.default_rng(1)
    ref = (rng.normal(size=(9, 500)) * 2).astype(np.float32)
    q = ref + (rng.normal(size=ref.shape) * 0.2).astype(np.float32)
    q[3] = ref[3][::-1]  # one position whose top token moves
    write_dump(tmp_path / "ref.dat", ref, n_ctx=20)
    write_dump(tmp_path / "q.dat", q, n_ctx=20)
    p, lp, lq = np.exp(log_softmax(ref)), log_softmax(ref), log_softmax(q)
    exact = (p * (lp - lq)).sum(1).mean()
    got = pq.kld(pq.read_dump(tmp_path / "ref.dat"), pq.read_dump(tmp_path / "q.dat"))
    assert got["positions"] == 9
    assert got["kld"] == pytest.approx(exact, rel=2e-3, abs=1e-6)
    assert got["top1"] == pytest.approx(((ref.argmax(1) == q.argmax(1)).sum()) / 9)
    assert got["top1"] < 1
    assert pq.kld(pq.read_dump(tmp_path / "ref.dat"), pq.read_dump(tmp_path / "ref.dat"))["kld"] == 0.0


def test_files_over_other_tokens_are_not_compared(tmp_path):
    lp = np.zeros((9, 10), dtype=np.float32)
    write_dump(tmp_path / "a.dat", lp, n_ctx=20)
    write_dump(tmp_path / "b.dat", lp, n_ctx=20, tokens=np.arange(20)[::-1].copy())
    (tmp_path / "c.dat").write_bytes(b"not a log-probability file")
    with pytest.raises(ValueError, match="different tokens"):
        pq.kld(pq.read_dump(tmp_path / "a.dat"), pq.read_dump(tmp_path / "b.dat"))
    with pytest.raises(ValueError, match="not a llama.cpp"):
        pq.read_dump(tmp_path / "c.dat")


def test_the_page_cache_share_follows_reads_and_evictions(tmp_path):
    path = tmp_path / "file.bin"
    path.write_bytes(os.urandom(8 << 20))
    path.read_bytes()
    assert pr.page_cache_share(path) == 1.0
    pr.evict_page_cache(path)
    assert pr.page_cache_share(path) < 0.05
    with open(path, "rb") as f:
        f.read(4 << 20)  # the first half (and what the kernel reads ahead)
    assert 0.45 <= pr.page_cache_share(path) <= 1.0


CHILD = """
import os, subprocess, sys, time
block = bytearray(os.urandom(64 << 20))  # touched: resident
if sys.argv[1] == "parent":
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "child", ""])
    time.sleep(30)
else:
    time.sleep(30)
"""


def test_the_memory_of_a_process_tree_is_summed(tmp_path):
    command = [sys.executable, "-c", CHILD, "parent", CHILD]
    server = pr.MeasuredServer("tree", command, 0, dict(os.environ), tmp_path / "log")
    try:
        deadline = time.monotonic() + 60
        while server.memory.peak_pss < 2 * (64 << 20) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        server.stop()
    assert server.memory.peak_rss >= 2 * (64 << 20)  # both processes' 64 MB blocks
    assert server.memory.peak_pss >= 2 * (64 << 20)
    assert server.proc.poll() is not None


def test_a_cold_start_empties_the_folio_cache_but_kernels_and_models(tmp_path):
    user = tmp_path / "user"
    (user / "cpu-kernels").mkdir(parents=True)
    (user / "cpu-kernels" / "folio-abc.so").write_bytes(b"x")
    cache = pr.FolioCache(tmp_path / "bench", user)
    (cache.folder / "prepared").mkdir()
    (cache.folder / "prepared" / "entry.pt").write_bytes(b"x")
    (cache.folder / "keys").mkdir()
    (cache.folder / "loose").write_text("x")
    cache.empty()
    assert sorted(p.name for p in cache.folder.iterdir()) == ["cpu-kernels", "models"]
    assert (cache.folder / "cpu-kernels" / "folio-abc.so").is_file()  # through the link
    assert (user / "models").is_dir()
    assert cache.env() == {"FOLIO_CACHE_DIR": str(cache.folder)}
    pr.FolioCache(tmp_path / "bench", user)  # made again over the links: no error


def test_ratios_are_above_one_when_folio_is_better():
    assert compare({"folio": 150.0, "llama.cpp": 100.0, "ik_llama.cpp -rtr": 120.0}, True) == (
        "ik_llama.cpp -rtr", 1.25)
    assert compare({"folio": 2.0, "llama.cpp": 3.0, "ik_llama.cpp": 4.0}, False) == ("llama.cpp", 1.5)
    assert compare({"folio": None, "llama.cpp": 3.0}, False) is None
    assert compare({"folio": 1.0, "llama.cpp": None}, True) is None


def test_long_prompts_share_no_first_token_and_have_their_length():
    prompts = pr.long_prompts(6, 2000, seed=3)
    assert [len(p) for p in prompts] == [2000] * 6
    assert len({tuple(p[:4]) for p in prompts}) == 6
    assert all(1000 <= t < 40000 for p in prompts for t in p)


# --------------------------------------------------------------------------- with the peers built


def peer_binaries() -> dict:
    """The peers' binaries, built when ``FOLIO_BUILD_LLAMA_SERVER=1`` says so; else a skip."""
    from folio.testing.llamacpp import IK_LLAMA_CPP, LLAMA_CPP, ensure_peer, find_binary

    build = os.environ.get("FOLIO_BUILD_LLAMA_SERVER") == "1"
    found = {}
    for peer in (LLAMA_CPP, IK_LLAMA_CPP):
        if build:
            found[peer.name] = ensure_peer(peer, jobs=os.cpu_count() or 2)
        elif any(find_binary(peer, name) is None for name in peer.binaries):
            pytest.skip(f"{peer.name} is not built: `python -m folio.testing.llamacpp --peer all` builds both peers "
                        "from their sdists (minutes to tens of minutes, once), or run with FOLIO_BUILD_LLAMA_SERVER=1")
        else:
            found[peer.name] = {name: find_binary(peer, name) for name in peer.binaries}
    return found


@pytest.mark.slow
def test_the_kld_agrees_with_llama_perplexitys_own(tmp_path):
    binaries = peer_binaries()
    from folio.testing.gguf_models import bench_gguf

    perplexity = binaries["llama.cpp"]["llama-perplexity"]
    bf16, q4_0 = bench_gguf("smollm2", "BF16"), bench_gguf("smollm2", "Q4_0")
    text = pq.write_gate_text(tmp_path / "gate.txt", 1024, dict(os.environ))
    ref = pq.perplexity_dump(perplexity, bf16, text, tmp_path / "ref.dat", 256, 2)
    mine = pq.perplexity_dump(perplexity, q4_0, text, tmp_path / "q.dat", 256, 2)
    own = subprocess.run([perplexity, "-m", str(q4_0), "-c", "256", "-t", "2", "--kl-divergence-base", str(ref),
                          "--kl-divergence"], capture_output=True, text=True)
    assert own.returncode == 0, own.stderr[-2000:]
    theirs = float(re.search(r"Mean\s+KLD:\s+(-?[\d.]+)", own.stdout + own.stderr).group(1))
    same_top = float(re.search(r"Same top p:\s+([\d.]+)", own.stdout + own.stderr).group(1))
    got = pq.kld(pq.read_dump(ref), pq.read_dump(mine))
    assert theirs > 1e-4  # Q4_0 is measurably off BF16, so the comparison means something
    assert got["kld"] == pytest.approx(theirs, rel=0.02, abs=2e-6)
    assert 100 * got["top1"] == pytest.approx(same_top, abs=0.5)


def figures(saved: dict, name: str) -> dict:
    prefix = f"{name} "
    return {k[len(prefix):]: v for k, v in saved["figures"].items() if k.startswith(prefix)}


@pytest.mark.slow
def test_quick_runs_every_measure_against_both_peers(tmp_path):
    peer_binaries()
    result = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "folio.cli.main", "bench", "cpu-vs-llamacpp", "--quick",
                           "--save-result", str(result)], capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    got = figures(json.loads(result.read_text()), "smollm2 Q4_0")
    labels = ["folio", "llama.cpp", "ik_llama.cpp", "ik_llama.cpp -rtr"]
    for m in MEASURES:
        suffix = f" ({m.unit})" if m.unit else ""
        values = {label: got.get(f"{m.name} {label}{suffix}") for label in labels}
        if m.name == "BF16 floor KLD":
            assert values.pop("llama.cpp") is None  # its own reference
        assert all(v is not None for v in values.values()), (m.name, values, sorted(got))
        ratio = got.get(f"{m.name} folio vs best peer (x)")
        if not m.compared:
            assert ratio is None
            continue
        assert ratio == pytest.approx(compare(values, m.higher)[1], rel=0.02, abs=0.01), m.name
    for label in labels:
        assert got[f"single stream {label} (tok/s)"] > 0 and got[f"mixed {label} (tok/s)"] > 0
        assert got[f"time to first token {label} (s)"] > 0 and got[f"seconds to healthy warm {label} (s)"] > 0
        assert got[f"peak resident memory {label} (MB)"] > got["file size (MB)"]  # the weights, at least
        assert 0 <= got[f"KLD {label}"] < 1 and got[f"top-1 agreement {label} (%)"] > 50
    assert got["BF16 floor KLD folio"] < 0.01  # folio scored the reference's own positions and tokens
    assert not math.isnan(got["roofline (tok/s)"])
