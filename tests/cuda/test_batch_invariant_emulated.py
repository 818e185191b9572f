"""Batch invariance of the CUDA kernels, bitwise, on the CPU emulation (small shapes).

Attention: one query row over the same paged K/V (a context spanning several fixed partitions)
gives the same bits decoded beside another sequence, inside a whole-prompt prefill chunk, and
inside a chunk after a prefix hit in another batch: f16/bf16 (tensor-core kernel), fp32 and an
fp8 pool (CUDA-core kernel), with and without a sliding window. The same steps with the per-step
plans of ``--no-batch-invariant`` (decode kernel, splits by occupancy) give other bits, so the
test can fail. GEMMs: row r of ``dense_matmul`` and of the W4A16 ``awq_matmul`` in
batch-invariant mode is the same for a [1, K] input and inside [M, K] inputs, M = 1, 3, 17, 64
(and 129 for the AWQ kernel's 32-row tiles).
"""

from __future__ import annotations

import pytest
import torch

from folio.core.executor.kernels.attention import AttentionMetadata
from folio.core.executor.kernels.gemm_kernels import dense_matmul
from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend
from folio.core.executor.quant.gpu import awq_matmul
from folio.core.executor.kernels.kv_quant import FP8_DTYPE, quantize
from folio.core.executor.quant.formats import int4_to_awq
from tests.cuda.quant_cases import random_awq

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
BLOCK, HEAD, HEADS, KV_HEADS = 8, 64, 8, 2  # GQA group 4, as the 1B shape
PARTITION = 24  # keys per partition here (3 blocks); the contexts below span 2-4 of them
LEN_X, LEN_Y = 75, 45  # sequence X (the row under test: its last token) and a neighbour Y


def _pool(dtype, seed=0):
    """K/V of X and Y in a shuffled paged pool; the tables of both."""
    gen = torch.Generator().manual_seed(seed)
    n_x, n_y = -(-LEN_X // BLOCK), -(-(LEN_Y + 30) // BLOCK)
    order = torch.randperm(n_x + n_y + 2, generator=gen).tolist()
    tables = {"x": order[:n_x], "y": order[n_x : n_x + n_y]}
    shape = (n_x + n_y + 2, BLOCK, KV_HEADS, HEAD)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    if dtype == FP8_DTYPE:
        return quantize(k * 3.0, 0.02), quantize(v, 0.011), tables
    return k.to(dtype), v.to(dtype), tables


def _steps():
    """(query lens, seq lens, sequences) of the steps that compute X's last token: decoded beside
    Y, prefilled whole, and in a chunk after a 43-token prefix hit behind a chunk of Y."""
    return [([1, 1], [LEN_Y, LEN_X], ["y", "x"]),
            ([LEN_X], [LEN_X], ["x"]),
            ([20, LEN_X - 43], [LEN_Y + 20, LEN_X], ["y", "x"])]


def _outputs(launcher, dtype, invariant: bool, window: int = 0):
    act = BF16 if dtype == FP8_DTYPE else dtype
    k_cache, v_cache, tables = _pool(dtype)
    gen = torch.Generator().manual_seed(1)
    q_row = torch.randn(HEADS, HEAD, generator=gen).to(act)
    backend = KernelAttentionBackend(launcher, act, partition_size=PARTITION, batch_invariant=invariant,
                                     kv_dtype=FP8_DTYPE if dtype == FP8_DTYPE else None)
    scales = (0.02, 0.011) if dtype == FP8_DTYPE else (1.0, 1.0)
    rows = []
    for q_lens, s_lens, seqs in _steps():
        meta = AttentionMetadata.build(q_lens, s_lens, [tables[s] for s in seqs], None, BLOCK)
        query = torch.randn(sum(q_lens), HEADS, HEAD, generator=gen).to(act)
        query[-1] = q_row  # X is last in every step: its last token is the last row
        out = backend.attend(query, k_cache, v_cache, meta, HEAD ** -0.5, kv_scales=scales, window=window)
        rows.append(out[-1].clone())
    return rows, {name.split("<")[0].removeprefix("folio::") for name, _, _ in launcher.launches}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype != F32 \
        else torch.equal(a.view(torch.int32), b.view(torch.int32))


CASES = [("bf16", BF16, 0), ("f16-window40", F16, 40), ("f32", F32, 0), ("fp8-pool", FP8_DTYPE, 0)]


@pytest.mark.parametrize("name,dtype,window", CASES, ids=[c[0] for c in CASES])
def test_attention_row_is_bitwise_the_same_decoded_prefilled_and_after_a_prefix_hit(emu_launcher, name, dtype,
                                                                                   window):
    rows, kernels = _outputs(emu_launcher, dtype, invariant=True, window=window)
    assert "paged_decode" not in kernels and "paged_attention_reduce" in kernels
    assert ("paged_prefill" in kernels) == (dtype in (F16, BF16))
    decoded, prefilled, after_hit = rows
    assert torch.isfinite(decoded.float()).all() and decoded.float().abs().sum() > 0
    assert _same_bits(decoded, prefilled), (decoded.float() - prefilled.float()).abs().max()
    assert _same_bits(decoded, after_hit), (decoded.float() - after_hit.float()).abs().max()


@pytest.mark.slow  # over 8 s: the full suite's
def test_the_per_step_plans_are_not_invariant(emu_launcher):
    """The check above can fail: without invariance the decoded row takes the decode kernel and
    differs from the prefilled one in some bits."""
    (decoded, prefilled, _), kernels = _outputs(emu_launcher, BF16, invariant=False)
    assert "paged_decode" in kernels
    assert not _same_bits(decoded, prefilled)


def test_invariant_partitions_are_fixed(emu_launcher):
    """The partition size is the backend's, whatever the context or the batch: one partition for a
    short context (written without the reduce), several for a long one."""
    backend = KernelAttentionBackend(emu_launcher, BF16, partition_size=PARTITION, batch_invariant=True)
    short = AttentionMetadata.build([1], [PARTITION], [[0, 1, 2]], None, BLOCK)
    long = AttentionMetadata.build([1, 5], [PARTITION, 10 * PARTITION + 1], [[0, 1, 2], list(range(31))],
                                   None, BLOCK)
    p_short, p_long = backend.plan(short, 4, 2), backend.plan(long, 4, 2)
    assert p_short.decode is None and p_long.decode is None
    assert (p_short.chunk.split_size, p_short.chunk.num_splits) == (PARTITION, 1)
    assert (p_long.chunk.split_size, p_long.chunk.num_splits) == (PARTITION, 11)


# ---------------------------------------------------------------- GEMMs
M_SIZES = (1, 3, 17, 64)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_dense_gemm_rows_do_not_depend_on_the_batch(emu_launcher, dtype):
    gen = torch.Generator().manual_seed(2)
    k, n = 80, 72  # K not a multiple of the 32-wide k-tile, N not of the 64-wide n-tile
    x = torch.randn(max(M_SIZES), k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / 8).to(dtype)
    rows = (0, 2, 16, 63)  # first, last and middle rows of the 16-row warp slices and the 64-row tile
    solo = {r: dense_matmul(emu_launcher, x[r : r + 1], w) for r in rows}
    for m in M_SIZES:
        y = dense_matmul(emu_launcher, x[:m], w)
        assert y.shape == (m, n) and y.dtype == dtype
        for r in rows:
            if r < m:
                assert torch.equal(y[r].view(torch.int16), solo[r][0].view(torch.int16)), (m, r)
    torch.testing.assert_close(y.float(), x.float() @ w.float().t(), atol=3e-2, rtol=1.6e-2)


def test_awq_rows_do_not_depend_on_the_batch_in_invariant_mode(emu_launcher):
    packed = int4_to_awq(random_awq(64, 1024, 128, seed=3))  # K = 1024: two fixed K splits
    case = (packed["qweight"], packed["qzeros"], packed["scales"], 128)
    x = torch.randn(129, 1024, generator=torch.Generator().manual_seed(4)).to(BF16)
    solo = [awq_matmul(emu_launcher, x[r : r + 1], *case, invariant=True) for r in (0, 2, 16, 63, 128)]
    for m in (*M_SIZES, 129):
        y = awq_matmul(emu_launcher, x[:m], *case, invariant=True)
        for i, r in enumerate((0, 2, 16, 63, 128)):
            if r < m:
                assert torch.equal(y[r].view(torch.int16), solo[i][0].view(torch.int16)), (m, r)
    # what it replaces (awq_gemv up to 8 rows, split-K by occupancy above) changes a row's fp32 bits
    per_step = [awq_matmul(emu_launcher, x[:m].float(), *case)[0] for m in (1, 64)]
    assert not torch.equal(per_step[0], per_step[1])
    invariant = [awq_matmul(emu_launcher, x[:m].float(), *case, invariant=True)[0] for m in (1, 64)]
    assert torch.equal(invariant[0], invariant[1])
