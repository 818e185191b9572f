"""The kernel sources, run on the CPU through cuda/emulation, against the torch backend.

``KernelAttentionBackend`` is the real backend (planning, split choice, argument marshalling);
only its launcher is the emulation instead of CuPy. See cuda/LAYOUT.md for what this cannot catch.
"""

from __future__ import annotations

import pytest
import torch

from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.kernels.attention import TorchAttentionBackend, dense_causal_attention
from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend, block_runs, make_host_pool, work_items
from tests.cuda.kv_cases import TOLERANCE, fresh_meta, make_step, reference_attention

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (id, dtype, head_dim, block_size, num_heads, num_kv_heads, query_lens, seq_lens, split)
ATTEND_CASES = [
    ("decode-mha-uneven", F32, 64, 16, 4, 4, [1, 1, 1], [1, 17, 40], False),
    ("mixed-gqa4", F32, 64, 8, 8, 2, [1, 7, 1, 12], [33, 7, 9, 30], False),
    ("mixed-gqa4-split", F32, 64, 8, 8, 2, [1, 7, 1, 12], [33, 7, 9, 30], True),
    ("f16-h128-b32-split", F16, 128, 32, 4, 1, [3, 1], [70, 65], True),
    ("bf16-h96-auto", BF16, 96, 16, 2, 2, [5, 1], [5, 50], None),
    ("group16-rows-split-per-token", F32, 64, 16, 16, 1, [2, 1], [10, 20], False),
    ("chunk-after-prefix-gqa2", F16, 64, 16, 4, 2, [20], [45], True),
]


def _backend(launcher, dtype, split, partition_size=32):
    # a 32-token partition makes the split path reachable with contexts the emulation runs fast
    return KernelAttentionBackend(launcher, dtype, split=split, partition_size=partition_size)


@pytest.mark.parametrize("case", ATTEND_CASES, ids=[c[0] for c in ATTEND_CASES])
def test_attend_matches_torch_backend(emu_launcher, case):
    _, dtype, head_dim, block_size, num_heads, num_kv_heads, query_lens, seq_lens, split = case
    step = make_step(query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     block_size=block_size, dtype=dtype)
    scale = head_dim**-0.5
    backend = _backend(emu_launcher, dtype, split)
    out = backend.attend(step.query, step.k_cache, step.v_cache, fresh_meta(step), scale)
    expected = reference_attention(step, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    launched = [name for name, _, _ in emu_launcher.launches]
    if split is not None:
        assert any("reduce" in name for name in launched) == split, launched


def test_attend_matches_dense_oracle_per_sequence(emu_launcher):
    """An oracle that shares no code with either backend: explicit matmuls per sequence."""
    step = make_step([1, 9, 4], [21, 9, 26], num_heads=8, num_kv_heads=2, head_dim=64, block_size=8, seed=3)
    out = _backend(emu_launcher, F32, True).attend(step.query, step.k_cache, step.v_cache, fresh_meta(step), 0.125)
    start = 0
    for table, q_len, s_len in zip(step.tables, step.meta.query_lens_list, step.meta.seq_lens_list):
        keys = step.k_cache[table].flatten(0, 1)[:s_len]
        values = step.v_cache[table].flatten(0, 1)[:s_len]
        expected = dense_causal_attention(step.query[start : start + q_len], keys, values, 0.125)
        torch.testing.assert_close(out[start : start + q_len], expected, atol=2e-5, rtol=2e-5)
        start += q_len


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_write_kv_skips_padding_and_takes_strided_views(emu_launcher, dtype):
    step = make_step([3, 1, 4], [3, 10, 12], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=dtype)
    num_tokens = 10  # the 8 real tokens plus 2 padding rows (a CUDA-graph padded batch)
    slots = torch.cat([step.slots, torch.full((2,), -1, dtype=torch.int64)])
    slots[1] = -1  # and one padding slot inside the batch
    meta = fresh_meta(step)
    meta.slot_mapping = slots
    # key/value as views into a fused projection, like the model's qkv split
    qkv = torch.randn(num_tokens, 3 * 2 * 64).to(dtype)
    key = qkv[:, 128:256].view(num_tokens, 2, 64)
    value = qkv[:, 256:].view(num_tokens, 2, 64)
    k_ref, v_ref = step.k_cache.clone(), step.v_cache.clone()
    TorchAttentionBackend().write_kv(key, value, k_ref, v_ref, meta)
    meta.plan = None
    k_out, v_out = step.k_cache.clone(), step.v_cache.clone()
    _backend(emu_launcher, dtype, None).write_kv(key, value, k_out, v_out, meta)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
    assert not torch.equal(k_out, step.k_cache)  # something was written


def _pool(num_layers=2, num_blocks=6, dtype=F16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 8, 2, 64)
    return [(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
            for _ in range(num_layers)]


def test_copy_blocks_matches_torch_backend(emu_launcher):
    pairs = [(0, 3), (5, 1), (2, 4)]
    expected, got = _pool(), _pool()
    TorchAttentionBackend().copy_blocks(expected, pairs)
    _backend(emu_launcher, F16, None).copy_blocks(got, pairs)
    for (ke, ve), (kg, vg) in zip(expected, got):
        assert torch.equal(ke, kg) and torch.equal(ve, vg)


def test_swap_out_and_back_in(emu_launcher):
    backend = _backend(emu_launcher, F16, None)
    device_pool = _pool()
    original = [(k.clone(), v.clone()) for k, v in device_pool]
    host_pool = make_host_pool(device_pool, num_blocks=4, pin=False)
    backend.swap_out(device_pool, host_pool, [(1, 0), (4, 3)])
    for (k, v), (hk, hv) in zip(device_pool, host_pool):
        assert torch.equal(hk[0], k[1]) and torch.equal(hv[3], v[4])
    for k, v in device_pool:  # the device blocks get reused by someone else meanwhile
        k[1].zero_()
        v[4].zero_()
    backend.swap_in(host_pool, device_pool, [(0, 1), (3, 4)])
    for (k, v), (ko, vo) in zip(device_pool, original):
        assert torch.equal(k, ko) and torch.equal(v, vo)


def test_unsupported_shape_names_the_missing_instance(emu_launcher):
    step = make_step([1], [5], num_heads=2, num_kv_heads=2, head_dim=80, block_size=16)
    with pytest.raises(ck.UnsupportedKernelError, match=r"folio::paged_attention<float, 80, 16>.*head size 80"):
        _backend(emu_launcher, F32, None).attend(step.query, step.k_cache, step.v_cache, fresh_meta(step), 0.1)


def test_work_items_cover_every_row_once():
    items = work_items([1, 3, 2], group=4, rows_per_block=8)
    assert items == [(0, 0), (1, 0), (1, 8), (2, 0)]


def test_split_is_chosen_per_step(emu_launcher):
    backend = KernelAttentionBackend(emu_launcher, F32, split=None, partition_size=512)
    long = make_step([2], [600], num_heads=2, num_kv_heads=2, head_dim=64, block_size=32)
    short = make_step([2], [100], num_heads=2, num_kv_heads=2, head_dim=64, block_size=32)
    assert backend.plan(fresh_meta(long), 1, 2).chunk.num_splits == 2  # few blocks, > 1 partition
    assert backend.plan(fresh_meta(short), 1, 2).chunk.num_splits == 1


def test_block_runs_merge_only_consecutive_pairs():
    assert block_runs([(4, 9), (1, 0), (2, 1), (3, 2), (7, 5), (8, 7)]) == [(1, 0, 3), (4, 9, 1), (7, 5, 1), (8, 7, 1)]
    assert block_runs([]) == []


def test_swap_with_runs_equals_torch_backend(emu_launcher):
    """Scattered and consecutive blocks, out of order: the copies per run land where the torch
    backend's per-block copies do, and nothing else of the destination changes."""
    pairs_out = [(5, 2), (0, 6), (1, 7), (2, 8), (3, 0)]
    got_dev, want_dev = _pool(num_blocks=6, seed=1), _pool(num_blocks=6, seed=1)
    got_host = make_host_pool(got_dev, num_blocks=9, pin=False)
    want_host = make_host_pool(want_dev, num_blocks=9, pin=False)
    backend = _backend(emu_launcher, F16, None)
    backend.swap_out(got_dev, got_host, pairs_out)
    TorchAttentionBackend().swap_out(want_dev, want_host, pairs_out)
    for got, want in zip(got_host, want_host):
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    pairs_in = [(6, 3), (7, 4), (2, 0)]
    backend.swap_in(got_host, got_dev, pairs_in)
    TorchAttentionBackend().swap_in(want_host, want_dev, pairs_in)
    for got, want in zip(got_dev, want_dev):
        assert all(torch.equal(g, w) for g, w in zip(got, want))
