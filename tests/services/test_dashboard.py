"""The live KV page's data: the kvmanager's aggregated block map, the gateway's samples of the
engine's figures, and its routes (the key, bad parameters, the static files)."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from folio.core.kv.allocator import BlockAllocator
from folio.services.gateway.app import build_app
from folio.services.gateway.dashboard import sample
from folio.services.gateway.service import GatewayService
from folio.services.kvmanager.blockmap import MAX_CELLS_LIMIT, block_map
from folio.shared.config import Endpoints, GatewayConfig


def test_a_small_pool_maps_one_cell_per_block_with_exact_states():
    alloc = BlockAllocator(num_blocks=12, block_size=4, num_host_blocks=4)
    alloc.allocate("a", 10, list(range(10)))  # blocks 0, 1, 2 (two full)
    alloc.confirm_computed()
    alloc.fork("a", "a.1")  # 0, 1, 2 now held twice
    alloc.allocate("b", 5, list(range(100, 105)))  # blocks 3, 4
    alloc.confirm_computed()
    alloc.free("b")  # 3 cached (full, indexed), 4 free
    alloc.allocate("c", 4, list(range(200, 204)))  # a fresh block: 5
    alloc.swap_out("c")  # on the host: host block 0; device 5 back to the free queue
    m = block_map(alloc)
    d = m["device"]
    assert (d["num_blocks"], d["blocks_per_cell"], d["num_cells"]) == (12, 1, 12)
    assert d["shared"][:3] == [1, 1, 1] and d["max_refs"][:3] == [2, 2, 2]
    assert d["cached"] == [0, 0, 0, 1] + [0] * 8
    assert sum(d["owned"]) == 0 and sum(d["shared"]) == 3
    assert m["host"]["used"] == [1, 0, 0, 0]
    seqs = {s["req_id"]: s for s in m["seqs"]}
    assert seqs["a.1"]["num_shared_blocks"] == 3 and seqs["c"]["swapped_out"] and m["num_seqs"] == 3


def test_a_pool_of_half_a_million_blocks_is_a_few_thousand_cells_in_a_small_json():
    alloc = BlockAllocator(num_blocks=500_000, block_size=16)
    alloc.allocate("big", 16 * 1000, list(range(16 * 1000)))  # blocks 0..999
    alloc.confirm_computed()
    alloc.fork("big", "big.1")
    alloc.allocate("solo", 16 * 300)  # 1000..1299, owned once
    m = block_map(alloc, 2048)
    d = m["device"]
    assert d["num_cells"] <= 2048 and d["blocks_per_cell"] == 245
    assert sum(d["shared"]) == 1000 and sum(d["owned"]) == 300 and sum(d["cached"]) == 0
    assert d["shared"][0] == 245 and d["max_refs"][0] == 2
    assert len(json.dumps(m)) < 40_000
    assert block_map(alloc, 10**9)["device"]["num_cells"] <= MAX_CELLS_LIMIT


def test_samples_turn_running_totals_into_rates():
    sched = {"num_running": 3, "num_waiting": 1, "num_swapped": 0, "num_steps": 10, "step_seconds_total": 0.1,
             "num_scheduled_seqs_total": 20, "num_scheduled_tokens_total": 500, "num_preemptions": 1,
             "max_num_batched_tokens": 100}
    kv = {"usage": 0.5, "num_prefix_cache_hits": 10, "num_prefix_cache_queries": 100}
    first = sample(100.0, sched, kv, None)
    assert first["step_ms"] is None and first["running"] == 3
    later = dict(sched, num_steps=30, step_seconds_total=0.5, num_scheduled_seqs_total=80,
                 num_scheduled_tokens_total=1500, num_preemptions=3)
    point = sample(101.0, later, dict(kv, num_prefix_cache_hits=40, num_prefix_cache_queries=140), first)
    assert point["step_ms"] == pytest.approx(20.0)  # 0.4 s over 20 steps
    assert point["batch_size"] == pytest.approx(3.0) and point["budget_use"] == pytest.approx(0.5)
    assert point["hit_rate"] == pytest.approx(0.75) and point["preemptions"] == 2 and point["dt"] == 1.0
    restarted = sample(102.0, dict(sched, num_steps=1), kv, point)  # totals went down: no rates
    assert restarted["step_ms"] is None and restarted["preemptions"] is None
    # images in: the executor's tower, its placeholder tokens and its share of the interval
    tower = {"num_image_tokens_encoded": 50, "encoder_seconds_total": 0.5}
    first = sample(200.0, sched, kv, None, tower)
    point = sample(202.0, sched, kv, first, dict(tower, num_image_tokens_encoded=125, encoder_seconds_total=1.0))
    assert point["image_tokens"] == 75 and point["encoder_use"] == pytest.approx(0.25)


@pytest_asyncio.fixture
async def client(tmp_path):
    ep = Endpoints.ipc(str(tmp_path))  # nothing listens: the services are "down"
    config = GatewayConfig(endpoints=ep, api_key="sekret", admin_timeout_s=0.05)
    client = TestClient(TestServer(build_app(GatewayService(config))))
    await client.start_server()
    yield client
    await client.close()


@pytest.mark.asyncio
async def test_the_page_is_served_without_a_key_and_its_data_only_with_it(client):
    page = await client.get("/dashboard")
    assert page.status == 200 and "dashboard.js" in await page.text()
    for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        r = await client.get(f"/dashboard/static/{name}")
        assert r.status == 200 and r.content_type == kind
    assert (await client.get("/dashboard/static/secrets.txt")).status == 404
    r = await client.get("/dashboard/api/state")
    assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
    auth = {"Authorization": "Bearer sekret"}
    r = await client.get("/dashboard/api/state", headers=auth)
    body = await r.json()
    assert r.status == 200 and body["map"] is None and len(body["samples"]) == 1  # asked, nobody answered
    for bad in ("cells=0", "cells=x", "since=soon"):
        r = await client.get(f"/dashboard/api/state?{bad}", headers=auth)
        assert r.status == 400, bad


def test_the_wheel_ships_the_page(tmp_path):
    """``pip install .`` must carry the page's files (package data), not only the Python modules;
    and the CPU kernels' C sources and headers, which the executor compiles on first use."""
    import shutil
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    src = tmp_path / "src"  # a copy: a build/ folder left in the checkout could hold the files already
    shutil.copytree(root, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".whl", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for name in ("dashboard.html", "dashboard.js", "dashboard.css"):
        assert any(n.endswith(f"gateway/static/{name}") for n in names), (name, [n for n in names if "gateway" in n])
    sources = sorted(p.name for p in (root / "folio" / "core" / "executor" / "kernels" / "csrc").iterdir())
    assert "common.h" in sources
    for name in sources:
        assert any(n.endswith(f"executor/kernels/csrc/{name}") for n in names), (name, [n for n in names if "csrc" in n])
