"""The KV tiers: the disk tier's index (LRU order, checksums, the size cap), the allocator's host and
disk tiers (exact block ids, pairs and saves; the replica's digest equals the owner's), and the
real back half on a tiny model: a restart on the same folder loads its prefix from disk, a
truncated file is recomputed, two replicas share one folder."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from folio.core.kv.tensors.pool import KVPool, PoolShape
from folio.core.kv.tensors.disk import pool_layout_id
from folio.core.executor.runtime.runner import ModelRunner
from folio.core.kv.allocator import BlockAllocator
from folio.core.kv.block_hash import chain_block_hashes
from folio.core.kv.steplog import StepLog
from folio.core.kv.tiers import HEADER_BYTES, DiskTier, TierCostModel
from folio.shared.config import RuntimeConfig
from folio.shared.messages import KVAllocate, KVConfirm, KVFree
from folio.shared.sampling import SamplingParams
from folio.services.in_process import back_half

LAYOUT = "ab" * 16
H = [bytes([i]) * 16 for i in range(8)]


# ---------------------------------------------------------------------- the disk tier's index
def test_disk_tier_round_trip_checksum_and_lru_order(tmp_path):
    disk = DiskTier(tmp_path, LAYOUT, capacity_bytes=0, block_bytes=100)
    for i in range(3):
        assert disk.save(H[i], bytes([i]) * 100)
    assert not disk.save(H[0], b"\0" * 100)  # content-addressed: the file exists, only touched
    assert list(disk.index) == [H[1], H[2], H[0]]
    assert disk.read(H[1]) == bytes([1]) * 100
    assert list(disk.index) == [H[2], H[0], H[1]]
    f = disk.path(H[2])
    assert f.stat().st_size == HEADER_BYTES + 100
    data = f.read_bytes()
    assert zlib.crc32(data[HEADER_BYTES:]) == int.from_bytes(data[HEADER_BYTES - 4:HEADER_BYTES], "little")
    # a flipped byte and a truncated file: detected, deleted, never served
    f.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert disk.read(H[2]) is None and not f.exists() and disk.counters["num_disk_corrupt"] == 1
    g = disk.path(H[0])
    g.write_bytes(g.read_bytes()[:HEADER_BYTES + 50])
    assert disk.find_run([H[0], H[1]], 4) == [] and not g.exists()
    assert disk.counters["num_disk_corrupt"] == 2 and list(disk.index) == [H[1]]
    # a new process on the folder finds what is left, in recency order
    assert list(DiskTier(tmp_path, LAYOUT, block_bytes=100).index) == [H[1]]
    # another layout's folder is another tier
    assert DiskTier(tmp_path, "cd" * 16).find_run([H[1]], 4) == []
    # a file another process deleted since it was verified here: a miss, and forgotten
    disk.path(H[1]).unlink()
    assert disk.find_run([H[1]], 4) == [] and list(disk.index) == [] and disk.total_bytes == 0


def test_disk_tier_evicts_least_recently_used_beyond_its_cap(tmp_path):
    size = HEADER_BYTES + 100
    disk = DiskTier(tmp_path, LAYOUT, capacity_bytes=3 * size, block_bytes=100)
    for i in range(3):
        disk.save(H[i], bytes(100))
    disk.read(H[0])  # H[1] is now the least recently used
    disk.save(H[3], bytes(100))
    assert list(disk.index) == [H[2], H[0], H[3]] and disk.total_bytes == 3 * size
    assert not disk.path(H[1]).exists() and disk.counters["num_disk_evictions"] == 1
    disk.save(H[4], bytes(100), protect=[H[2]])  # a file the step loads is kept
    assert list(disk.index) == [H[2], H[3], H[4]]
    assert sorted(p.name for p in tmp_path.rglob("*.kv")) == sorted(f"{h.hex()}.kv" for h in (H[2], H[3], H[4]))


def test_find_run_stops_at_the_first_missing_file_and_asks_the_cost_model(tmp_path):
    disk = DiskTier(tmp_path, LAYOUT, block_bytes=1000)
    for h in (H[0], H[1], H[3]):
        disk.save(h, bytes(1000))
    assert disk.find_run([H[0], H[1], H[2], H[3]], 16) == [H[0], H[1]]
    slow_disk = TierCostModel(load_bytes_per_s=1e3, prefill_tokens_per_s=1e4)  # 1 s to load, 3 ms to compute
    assert disk.find_run([H[0], H[1]], 16, slow_disk) == []
    fast_disk = TierCostModel(load_bytes_per_s=1e9, prefill_tokens_per_s=1e3)
    disk = DiskTier(tmp_path, LAYOUT, block_bytes=1000)  # nothing verified yet in this process
    assert disk.find_run([H[0], H[1]], 16, fast_disk) == [H[0], H[1]]
    assert fast_disk.load_bytes_per_s != 1e9  # the verified reads were measured


def test_the_layout_id_names_the_model_the_pool_layout_and_the_fp8_scales(tiny_model_dir, tmp_path):
    cpu = torch.device("cpu")
    pool = KVPool(PoolShape(2, 4, 2, 16, torch.float32), 4, cpu)
    base = pool_layout_id(pool, tiny_model_dir, "auto", "float32")
    assert base == pool_layout_id(KVPool(PoolShape(2, 4, 2, 16, torch.float32), 8, cpu), tiny_model_dir, "auto",
                                  "float32")  # the pool's size is not part of it
    other_model = tmp_path / "copy"
    other_model.mkdir()
    (other_model / "config.json").write_text("{}")
    ids = {base,
           pool_layout_id(KVPool(PoolShape(2, 8, 2, 16, torch.float32), 4, cpu), tiny_model_dir, "auto", "float32"),
           pool_layout_id(KVPool(PoolShape(2, 4, 2, 16, torch.bfloat16), 4, cpu), tiny_model_dir, "auto", "float32"),
           pool_layout_id(pool, tiny_model_dir, "auto", "float32", kv_scales=[(1.0, 2.0), (1.0, 2.0)]),
           pool_layout_id(pool, tiny_model_dir, "auto", "float32", kv_scales=[(1.0, 2.0), (1.0, 2.5)]),
           pool_layout_id(pool, tiny_model_dir, "auto", "float32", rank=1, world=2),
           pool_layout_id(pool, str(other_model), "auto", "float32")}
    assert len(ids) == 7


# ---------------------------------------------------------------------- the allocator's tiers
def _prompt(n, start=0):
    return list(range(start, start + n))


def test_evicted_prefix_blocks_go_to_the_host_tier_and_come_back():
    a = BlockAllocator(num_blocks=4, block_size=2, num_host_blocks=4)
    a.allocate("a", 5, _prompt(5))  # blocks 0 1 2, two full blocks to index
    a.confirm_computed()
    a.free("a")
    a.take_copies()
    a.allocate("b", 7, _prompt(7, 100))  # 4 blocks: evicts the cached 1 and 0 (free 3 first)
    assert a.block_table("b") == [3, 2, 1, 0]
    blocks, swap_out, swap_in = a.take_copies()
    assert swap_out == [(1, 0), (0, 1)] and swap_in == []
    assert a.counters["num_host_spilled_blocks"] == 2 and len(a.host.cached) == 2
    a.confirm_computed()
    a.free("b")
    # "a"'s prefix: both blocks on the host tier, loaded into fresh device blocks
    assert a.num_cached_blocks(_prompt(5), None, 2) == 2
    a.allocate("c", 5, _prompt(5))
    assert a.seqs["c"].num_cached_tokens == 4 and a.counters["num_host_hit_blocks"] == 2
    table = a.block_table("c")
    _, swap_out, swap_in = a.take_copies()
    assert swap_in == [(1, table[0]), (0, table[1])]
    # "b"'s evicted blocks went to the host tier on the way (its free blocks were all cached)
    assert all(a.device.ref_counts[b] == 1 for b in table)
    assert a.host.ref_counts == [0, 0, 0, 0]  # the pins went with the step's copies


def test_disk_tier_writes_through_and_loads_the_planned_hashes():
    a = BlockAllocator(num_blocks=8, block_size=2, disk_tier=True)
    a.allocate("a", 5, _prompt(5))
    a.confirm_computed()
    saves, loads = a.take_tier_ops()
    hashes = chain_block_hashes(_prompt(5), 2)
    assert saves == [(0, 0, hashes[0]), (0, 1, hashes[1])] and loads == []
    b = BlockAllocator(num_blocks=8, block_size=2, disk_tier=True)  # a restarted server
    b.allocate("a", 5, _prompt(5), load_hashes=[hashes[0], hashes[1]])
    assert b.take_tier_ops() == ([], [(0, hashes[0]), (1, hashes[1])])  # loaded, not saved again
    assert b.seqs["a"].num_cached_tokens == 4 and b.counters["num_disk_hit_blocks"] == 2
    assert b.num_cached_blocks(_prompt(5), None, 2) == 2  # indexed at once
    c = BlockAllocator(num_blocks=8, block_size=2, disk_tier=True)
    c.allocate("x", 5, _prompt(5), load_hashes=[hashes[1]])  # not the chain's start: ignored
    assert c.take_tier_ops()[1] == [] and c.seqs["x"].num_cached_tokens == 0


def test_the_replica_and_the_owner_take_the_same_tier_decisions():
    logs = [StepLog(BlockAllocator(4, 2, num_host_blocks=2, disk_tier=True, record_events=r)) for r in (False, True)]
    replica, owner = logs
    ops_by_step = [
        [KVAllocate("a", 0, 5, _prompt(5))], [KVConfirm(), KVFree(["a"])],
        [KVAllocate("b", 0, 7, _prompt(7, 50))], [KVConfirm(), KVFree(["b"])],
        [KVAllocate("c", 0, 7, _prompt(7, 90))], [KVConfirm(), KVFree(["c"])],
        [KVAllocate("d", 0, 5, _prompt(5), [])],
    ]
    saw = []
    for ops in ops_by_step:
        for op in ops:
            assert replica.try_apply(op) is not None
        r_ops, r_copies, r_digest = replica.seal()
        assert owner.apply_all(r_ops) == []
        _, o_copies, o_digest = owner.seal()
        assert (r_copies, r_digest, replica.tier_ops) == (o_copies, o_digest, owner.tier_ops)
        saw.append(replica.tier_ops)
    # the host tier (2 blocks) overflowed: host blocks went to disk, some from their device source
    assert replica.alloc.counters["num_host_spilled_blocks"] == 7
    step_c_saves = [(m, b) for m, b, _ in saw[4][0]]
    assert step_c_saves == [(1, 0), (1, 1), (0, 1)]  # host 0 and 1 from the host, host 0 again from device 1


# ---------------------------------------------------------------------- served, on a tiny model
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BS = 4


def _runner(model_dir, disk_dir, **kw):
    return ModelRunner(RuntimeConfig(model=model_dir, dtype="float32", device="cpu", block_size=BS,
                                     num_kv_blocks=96, max_num_batched_tokens=256, kv_disk_dir=str(disk_dir),
                                     kv_disk_gb=1.0, **kw), model_dir)


async def _serve(model_dir, runner, prompt, req_id):
    async with back_half(model_dir, runner=runner, num_kv_blocks=96, block_size=BS,
                         max_num_batched_tokens=256) as bh:
        await bh.submit(req_id, prompt, GREEDY)
        out = (await bh.collect([req_id]))[req_id][0]
        kv = (await bh.admin("kvmanager", "stats")).data
    return out, kv


@pytest.mark.asyncio
async def test_a_restart_on_the_same_folder_loads_its_prefix_and_a_bad_file_is_recomputed(tiny_model_dir, tmp_path):
    prompt = [(7 * i + 3) % 120 + 1 for i in range(101)]  # 25 full blocks, then the last token
    out_cold, kv = await _serve(tiny_model_dir, _runner(tiny_model_dir, tmp_path), prompt, "cold")
    assert kv["tiers"]["disk"]["hit_blocks"] == 0 and kv["tiers"]["disk"]["blocks_cached"] >= 25
    files = sorted(tmp_path.rglob("*.kv"))
    # a restart: a new pool, a new kvmanager, the same folder
    out_warm, kv = await _serve(tiny_model_dir, _runner(tiny_model_dir, tmp_path), prompt, "warm")
    assert out_warm == out_cold and kv["tiers"]["disk"]["hit_blocks"] == 25
    assert kv["num_prefix_cache_hits"] == 100
    # the 11th block's file, truncated: blocks 0-9 are loaded, the rest recomputed, the file deleted
    runner = _runner(tiny_model_dir, tmp_path)
    bad = runner.tiers.disk.path(chain_block_hashes(prompt, BS)[10])
    assert bad in files
    bad.write_bytes(bad.read_bytes()[:1000])
    out_bad, kv = await _serve(tiny_model_dir, runner, prompt, "bad")
    assert out_bad == out_cold and kv["tiers"]["disk"]["hit_blocks"] == 10
    assert kv["num_prefix_cache_hits"] == 40
    # deleted, then written through again from the recomputed block: whole and valid
    assert bad.stat().st_size == HEADER_BYTES + runner.pool_shape.bytes_per_block
    assert runner.tiers.disk.read(chain_block_hashes(prompt, BS)[10]) is not None


@pytest.mark.asyncio
async def test_two_replicas_share_one_folder(tiny_model_dir, tmp_path):
    prompt = [(5 * i + 1) % 120 + 1 for i in range(41)]
    a, b = _runner(tiny_model_dir, tmp_path), _runner(tiny_model_dir, tmp_path)
    assert a.tiers.disk.layout == b.tiers.disk.layout
    async with back_half(tiny_model_dir, runner=a, num_kv_blocks=96, block_size=BS, max_num_batched_tokens=256) as ra, \
            back_half(tiny_model_dir, runner=b, num_kv_blocks=96, block_size=BS, max_num_batched_tokens=256) as rb:
        await ra.submit("on-a", prompt, GREEDY)
        out_a = (await ra.collect(["on-a"]))["on-a"][0]
        await rb.submit("on-b", prompt, GREEDY)
        out_b = (await rb.collect(["on-b"]))["on-b"][0]
        kv_b = (await rb.admin("kvmanager", "stats")).data
        kv_a = (await ra.admin("kvmanager", "stats")).data
    assert out_a == out_b
    assert kv_a["tiers"]["disk"]["hit_blocks"] == 0 and kv_b["tiers"]["disk"]["hit_blocks"] == 10
    assert os.path.isdir(tmp_path / a.tiers.disk.layout)
