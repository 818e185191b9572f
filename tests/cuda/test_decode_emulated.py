"""The decode kernel (cuda/decode_attention.cu), the split rule, the grid limits and cp.async, on
the CPU emulation against the torch backend. See cuda/LAYOUT.md for what the emulation cannot
catch (speed, coalescing, occupancy: those need a GPU)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.kernels.attention import AttentionMetadata, dense_causal_attention
from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend
from folio.core.executor.kernels.kernel_plan import build_plan, num_splits_heuristic
from tests.cuda.emu_runtime import run_probe
from tests.cuda.kv_cases import TOLERANCE, fresh_meta, make_step, reference_attention

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = {"float32": F32, "float16": F16, "bfloat16": BF16}


def _attend(launcher, step, split, partition_size=48):
    backend = KernelAttentionBackend(launcher, step.query.dtype, split=split, partition_size=partition_size)
    scale = step.query.shape[-1] ** -0.5
    return backend.attend(step.query, step.k_cache, step.v_cache, fresh_meta(step), scale), scale


def _check(step, out, scale):
    tol = TOLERANCE[step.query.dtype]
    num_real = sum(step.meta.query_lens_list)
    expected = reference_attention(replace(step, query=step.query[:num_real]), scale)
    torch.testing.assert_close(out[:num_real].float(), expected, atol=tol, rtol=tol)


def _launched(launcher):
    return [name.split("<")[0].removeprefix("folio::") for name, _, _ in launcher.launches]


# every dtype x head size once, block sizes and split/unsplit taking turns; contexts end in
# partial blocks and are longer than a tile, so the pipeline runs several stages
INSTANCE_CASES = [(d, h, b, split) for (d, h), b, split in zip(
    itertools.product(ck.DTYPES, ck.HEAD_SIZES), itertools.cycle(ck.BLOCK_SIZES), itertools.cycle([False, True]))]


@pytest.mark.parametrize("dtype_name,head_dim,block_size,split", INSTANCE_CASES,
                         ids=[f"{d}-{h}-{b}-{'split' if s else 'unsplit'}" for d, h, b, s in INSTANCE_CASES])
def test_decode_every_dtype_and_head_size(emu_launcher, dtype_name, head_dim, block_size, split):
    step = make_step([1, 1, 1], [1, 37, 130], num_heads=4, num_kv_heads=2, head_dim=head_dim,
                     block_size=block_size, dtype=DTYPES[dtype_name], seed=head_dim + block_size)
    out, scale = _attend(emu_launcher, step, split)
    _check(step, out, scale)
    assert _launched(emu_launcher) == ["paged_decode"] + (["paged_attention_reduce"] if split else [])


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7, 8, 12, 16])
@pytest.mark.parametrize("split", [False, True])
def test_decode_gqa_groups(emu_launcher, group, split):
    """Every group size up to 16 (non-powers of two leave head slots empty), split and not."""
    step = make_step([1, 1], [70, 9], num_heads=2 * group, num_kv_heads=2, head_dim=128, block_size=16,
                     dtype=BF16, seed=group)
    out, scale = _attend(emu_launcher, step, split, partition_size=32)
    _check(step, out, scale)
    assert _launched(emu_launcher)[0] == "paged_decode"


def test_decode_matches_dense_oracle(emu_launcher):
    """An oracle sharing no code with either backend: explicit matmuls per sequence."""
    step = make_step([1, 1, 1], [5, 100, 64], num_heads=8, num_kv_heads=2, head_dim=64, block_size=8, seed=11)
    out, scale = _attend(emu_launcher, step, True, partition_size=40)
    for b, (table, s_len) in enumerate(zip(step.tables, step.meta.seq_lens_list)):
        keys = step.k_cache[table].flatten(0, 1)[:s_len]
        values = step.v_cache[table].flatten(0, 1)[:s_len]
        expected = dense_causal_attention(step.query[b : b + 1], keys, values, scale)
        torch.testing.assert_close(out[b : b + 1], expected, atol=2e-5, rtol=2e-5)


def test_mixed_step_padding_rows_and_large_group(emu_launcher):
    """Decode and chunk sequences in one step (each kernel takes its own, each split path merges
    only its tokens), plus padding rows past the batch, which no kernel touches."""
    step = make_step([1, 6, 1, 3], [90, 20, 1, 50], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype=F16, seed=4)
    step.query = torch.cat([step.query, torch.randn(2, 8, 64).to(F16)])  # a padded (graph) batch
    out, scale = _attend(emu_launcher, step, True, partition_size=32)
    _check(step, out, scale)
    assert sorted(_launched(emu_launcher)) == sorted(["paged_decode", "paged_prefill", "paged_attention_reduce",
                                                      "paged_attention_reduce"])
    # a group above the decode kernel's 16 goes to the chunk kernel, decode tokens included
    step = make_step([1, 1], [40, 3], num_heads=20, num_kv_heads=1, head_dim=64, block_size=8, seed=5)
    emu_launcher.launches.clear()
    out, scale = _attend(emu_launcher, step, False)
    _check(step, out, scale)
    assert _launched(emu_launcher) == ["paged_attention"]


def test_split_rule_follows_flash_attention():
    # 48 CTAs on 108 slots: 2 splits (wave efficiency 0.89) rather than 3 (0.67)
    assert num_splits_heuristic(48, 108, 64, 128) == 2
    assert num_splits_heuristic(90, 108, 64, 128) == 1  # >= 0.8 of the slots: no split
    # one CTA, 500 granules: 106..124 and 126..128 splits need as many granules per split (5, 4) as
    # one fewer split does, so they are not eligible; 125 is the fewest within 85% of the best
    assert num_splits_heuristic(1, 132, 500, 128) == 125
    assert num_splits_heuristic(4, 16, 3, 128) == 3  # never more splits than granules


def test_decode_plan_splits_when_the_grid_is_small(emu_launcher):
    backend = KernelAttentionBackend(emu_launcher, F32)  # num_sms = 4: 16 CTA slots
    one = make_step([1], [1000], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16)
    plan = backend.plan(fresh_meta(one), 4, 1).decode
    assert plan.num_splits > 1 and plan.split_size % 64 == 0 and plan.num_splits * plan.split_size >= 1000
    out = backend.attend(one.query, one.k_cache, one.v_cache, fresh_meta(one), 0.125)
    _check(one, out, 0.125)
    many = make_step([1] * 16, [1000] * 16, num_heads=4, num_kv_heads=1, head_dim=64, block_size=16)
    assert backend.plan(fresh_meta(many), 4, 1).decode.num_splits == 1  # 16 CTAs fill the slots


@pytest.mark.parametrize("dtype,kernel,rows",
                         [(F32, "paged_attention", ck.ATTN_ROWS), (BF16, "paged_prefill", ck.PREFILL_ROWS)])
def test_largest_batch_stays_within_grid_limits(emu_launcher, dtype, kernel, rows):
    """140,000 tokens in one step (the 137,540-token prefill that once broke the grid's y limit),
    as 35 first chunks of 4,000 tokens, GQA 4: 70,000 work items of the CUDA-core kernel, 8,750
    of the tensor-core one. Every launch is checked against CUDA's limits; the far end of the grid
    runs under the emulation and matches a dense oracle."""
    n_seq, q_len, group = 35, 4000, 4
    step = make_step([q_len] * n_seq, [q_len] * n_seq, num_heads=group, num_kv_heads=1, head_dim=64,
                     block_size=32, dtype=dtype, seed=2)
    emu_launcher.last_blocks = 1  # the last work item
    out, scale = _attend(emu_launcher, step, None)
    (name, grid, _), = emu_launcher.launches
    assert kernel in name and grid[0] == n_seq * q_len * group // rows
    last_tokens = rows // group
    last = step.tables[-1]
    keys = step.k_cache[last].flatten(0, 1)[:q_len].float()
    values = step.v_cache[last].flatten(0, 1)[:q_len].float()
    expected = dense_causal_attention(step.query[-q_len:].float(), keys, values, scale)[-last_tokens:]
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out[-last_tokens:].float(), expected, atol=tol, rtol=tol)


def test_plans_of_a_million_tokens_fit_the_grid():
    """2^20 tokens at GQA 16 (256 chunks of 4,096): 262,144 tensor-core work items along x."""
    tables = [list(range(i * 256, (i + 1) * 256)) for i in range(256)]
    meta = AttentionMetadata.build([4096] * 256, [4096] * 256, tables, None, 16)
    plan = build_plan(meta, 16, 8, 132, None, 512, ck.PREFILL_ROWS)
    assert plan.chunk.num_items == 2**20 * 16 // ck.PREFILL_ROWS > 65535
    assert plan.chunk.num_splits <= 65535 and plan.decode is None


def test_cp_async_emulation_semantics(emu_lib):
    """The emulated cp.async is as late as the hardware may be: a kernel that reads its tile
    before waiting, or waits for the wrong group, gets stale data here (and fails its test)."""
    src = np.arange(1, 13, dtype=np.int32)
    out = np.zeros(20, dtype=np.int32)
    run_probe(emu_lib, "folio_probe::cp_async_probe", [out, src], threads=1)
    snapshots = out.reshape(5, 4).tolist()
    assert snapshots[0] == [-1] * 4  # issued, not waited: nothing landed
    assert snapshots[1] == [1, 2, 3, 4]  # wait<1>: the older group landed
    assert snapshots[2] == [-1] * 4  # ... and the newest may still be in flight
    # buf[1] + 100 * buf[2]: 8 bytes read and 8 zero-filled; the uncommitted copy still pending (-1)
    assert snapshots[3] == [5 - 100, 6 - 100, 0 - 100, 0 - 100]
    assert snapshots[4] == [0] * 4  # committed and waited: 0 source bytes = 16 zero bytes
