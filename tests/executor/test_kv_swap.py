"""The executor's side of the kvmanager's copies (torch backend): copy-on-write inside the device
pool, and swapping blocks to the host tier and back, in the order a StepPlan asks for."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from folio.core.executor.kernels.attention import TorchAttentionBackend
from folio.core.executor.runtime.input_batch import InputBatch
from folio.core.executor.runtime.plan_check import InvalidPlan, PlanLimits, check_plan
from folio.core.kv.tensors.pool import KVPool, PoolShape
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.messages import StepPlan

SHAPE = PoolShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def filled_pool(num_blocks=8, num_host_blocks=4) -> KVPool:
    pool = KVPool(SHAPE, num_blocks, torch.device("cpu"), num_host_blocks=num_host_blocks)
    gen = torch.Generator().manual_seed(0)
    for k, v in pool.kv_caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return pool


def block(caches, block_id):
    return [torch.stack([k[block_id], v[block_id]]) for k, v in caches]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_host_pool_has_the_device_block_shape():
    pool = filled_pool()
    assert len(pool.host_caches) == SHAPE.num_layers
    assert pool.host_caches[0][0].shape == (4, 4, 2, 8) and pool.host_caches[0][0].device.type == "cpu"
    assert KVPool(SHAPE, 2, torch.device("cpu")).host_caches == []


def test_copy_blocks_copies_every_layer():
    pool, backend = filled_pool(), TorchAttentionBackend()
    before = block(pool.kv_caches, 1)
    backend.copy_blocks(pool.kv_caches, [(1, 5)])
    assert same(block(pool.kv_caches, 5), before) and same(block(pool.kv_caches, 1), before)


def test_swap_round_trip_restores_the_blocks_elsewhere():
    pool, backend = filled_pool(), TorchAttentionBackend()
    originals = [block(pool.kv_caches, b) for b in (2, 3)]
    backend.swap_out(pool.kv_caches, pool.host_caches, [(2, 0), (3, 1)])
    for k, v in pool.kv_caches:  # the device blocks are reused meanwhile
        k[2:4].zero_()
        v[2:4].zero_()
    backend.swap_in(pool.host_caches, pool.kv_caches, [(0, 6), (1, 7)])
    assert same(block(pool.kv_caches, 6), originals[0]) and same(block(pool.kv_caches, 7), originals[1])


def test_a_plan_swaps_out_before_it_swaps_in_and_copies():
    pool, backend = filled_pool(), TorchAttentionBackend()
    leaving, host_resident, cow_src = block(pool.kv_caches, 2), None, block(pool.kv_caches, 4)
    for k, v in pool.host_caches:
        k[1].fill_(7.0)
        v[1].fill_(7.0)
    host_resident = block(pool.host_caches, 1)
    runner = SimpleNamespace(pool=pool, backend=backend)
    # device block 2 leaves for host 0 and is refilled from host 1 in the same step; then 4 -> 2's old
    plan = StepPlan(step_id=0, swap_out=[(2, 0)], swap_in=[(1, 2)], block_copies=[(4, 5)])
    ModelRunner._copy_blocks(runner, plan)
    assert same(block(pool.host_caches, 0), leaving)
    assert same(block(pool.kv_caches, 2), host_resident)
    assert same(block(pool.kv_caches, 5), cow_src)


def test_a_host_block_swapped_in_and_rewritten_by_a_swap_out_of_the_same_step_is_read_first():
    """The allocator gave host block 1 back and took it again in one step: its resident prefix goes
    to device block 5 while device block 2 leaves for it. The swap-in must read the old contents
    (de024f8: two seeded streams got the block that was leaving), and host block 0 beside it too."""
    pool, backend = filled_pool(), TorchAttentionBackend()
    for value, host_id in ((7.0, 1), (3.0, 0)):
        for k, v in pool.host_caches:
            k[host_id].fill_(value)
            v[host_id].fill_(-value)
    resident, other, leaving = block(pool.host_caches, 1), block(pool.host_caches, 0), block(pool.kv_caches, 2)
    runner = SimpleNamespace(pool=pool, backend=backend)
    plan = StepPlan(step_id=0, swap_out=[(2, 1)], swap_in=[(0, 4), (1, 5)])
    ModelRunner._copy_blocks(runner, plan)
    assert same(block(pool.kv_caches, 5), resident), "the swap-in read the block the swap-out wrote"
    assert same(block(pool.kv_caches, 4), other)
    assert same(block(pool.host_caches, 1), leaving)


def test_swaps_without_a_host_tier_or_outside_it_are_refused():
    batch = InputBatch(max_num_reqs=1, vocab_size=16, block_size=SHAPE.block_size, device=torch.device("cpu"))
    limits = PlanLimits(num_blocks=2, num_host_blocks=0, block_size=SHAPE.block_size, max_positions=64, vocab_size=16)
    with pytest.raises(InvalidPlan, match="no host tier"):
        check_plan(StepPlan(step_id=0, swap_out=[(0, 0)]), limits, batch)
    limits = dataclasses.replace(limits, num_host_blocks=4)
    with pytest.raises(InvalidPlan, match=r"swap_in\[1\] = \(4, 1\): block 4 is outside the host tier"):
        check_plan(StepPlan(step_id=0, swap_in=[(3, 0), (4, 1)]), limits, batch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_plan_on_the_gpu_pool_with_a_pinned_host_tier_matches_the_torch_backend():
    pytest.importorskip("cupy")
    from folio.core.executor.kernels.cuda_backend import CudaAttentionBackend

    plan = StepPlan(step_id=0, swap_out=[(2, 0), (3, 1)], swap_in=[(1, 2)], block_copies=[(4, 5)])
    cpu_pool = filled_pool()
    gpu_pool = KVPool(SHAPE, 8, torch.device("cuda"), num_host_blocks=4)
    assert gpu_pool.host_caches[0][0].is_pinned()
    for (k, v), (gk, gv) in zip(cpu_pool.kv_caches, gpu_pool.kv_caches):
        gk.copy_(k)
        gv.copy_(v)
    ModelRunner._copy_blocks(SimpleNamespace(pool=cpu_pool, backend=TorchAttentionBackend()), plan)
    ModelRunner._copy_blocks(SimpleNamespace(pool=gpu_pool, backend=CudaAttentionBackend(torch.float32)), plan)
    torch.cuda.synchronize()
    for (k, v), (gk, gv) in zip(cpu_pool.kv_caches + cpu_pool.host_caches, gpu_pool.kv_caches + gpu_pool.host_caches):
        assert torch.equal(k, gk.cpu()) and torch.equal(v, gv.cpu())
