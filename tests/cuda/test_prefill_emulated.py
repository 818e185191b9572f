"""The tensor-core chunk kernel (cuda/prefill_attention.cu) on the CPU emulation against the
torch backend, and the emulated ldmatrix / mma.sync against the PTX ISA's fragment tables,
written out here independently of the emulation (a wrong table in either fails)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend
from tests.cuda.emu_runtime import run_probe
from tests.cuda.kv_cases import TOLERANCE, fresh_meta, make_step, reference_attention

F16, BF16 = torch.float16, torch.bfloat16


def test_ldmatrix_fragments_follow_the_ptx_isa(emu_lib):
    rng = np.random.default_rng(0)
    mats = rng.integers(0, 2**16, size=(4, 8, 8), dtype=np.uint16)  # 4 matrices, row-major
    out = np.zeros((32, 8), dtype=np.uint32)
    run_probe(emu_lib, "folio_probe::ldmatrix_probe", [out, mats], threads=32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            plain = int(mats[i, g, 2 * t]) | int(mats[i, g, 2 * t + 1]) << 16
            trans = int(mats[i, 2 * t, g]) | int(mats[i, 2 * t + 1, g]) << 16
            assert out[lane, i] == plain, (lane, i)
            assert out[lane, 4 + i] == trans, (lane, i)


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)


@pytest.mark.parametrize("dtype,name", [(BF16, "folio::bf16"), (F16, "folio::f16")])
def test_mma_m16n8k16_fragments_follow_the_ptx_isa(emu_lib, dtype, name):
    gen = torch.Generator().manual_seed(1)
    A = torch.randn(16, 16, generator=gen).to(dtype)
    B = torch.randn(16, 8, generator=gen).to(dtype)
    C = torch.randn(16, 8, generator=gen)
    a_bits, b_bits = _bits(A), _bits(B)
    a = np.zeros((32, 4), dtype=np.uint32)
    b = np.zeros((32, 2), dtype=np.uint32)
    c = np.zeros((32, 4), dtype=np.float32)
    rows_cols = lambda g, t: [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]  # noqa: E731
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for reg, (r, k) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            a[lane, reg] = a_bits[r, k] | a_bits[r, k + 1] << 16  # A[r][k], A[r][k+1]
        for reg, k in enumerate([2 * t, 2 * t + 8]):
            b[lane, reg] = b_bits[k, g] | b_bits[k + 1, g] << 16  # B[k][n], B[k+1][n]
        for e, (r, n) in enumerate(rows_cols(g, t)):
            c[lane, e] = C[r, n]
    d = np.zeros((32, 4), dtype=np.float32)
    run_probe(emu_lib, f"folio_probe::mma_probe<{name}>", [d, a, b, c], threads=32)
    expected = (A.double() @ B.double() + C.double()).float()
    got = torch.zeros(16, 8)
    for lane in range(32):
        for e, (r, n) in enumerate(rows_cols(lane // 4, lane % 4)):
            got[r, n] = float(d[lane, e])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _attend(launcher, step, split, partition_size=40):
    backend = KernelAttentionBackend(launcher, step.query.dtype, split=split, partition_size=partition_size)
    scale = step.query.shape[-1] ** -0.5
    out = backend.attend(step.query, step.k_cache, step.v_cache, fresh_meta(step), scale)
    num_real = sum(step.meta.query_lens_list)
    expected = reference_attention(replace(step, query=step.query[:num_real]), scale)
    tol = TOLERANCE[step.query.dtype]
    torch.testing.assert_close(out[:num_real].float(), expected, atol=tol, rtol=tol)
    return {name.split("<")[0].removeprefix("folio::") for name, _, _ in launcher.launches}


# (id, dtype, head, block, heads, kv heads, query lens, seq lens, split): chunks after cached
# context, chunks alone, several 64-row CTAs per sequence, speculative-verification-sized chunks
# beside decode, groups packed into M (7: rows of a token straddle CTAs; 20: above the decode
# kernel's 16, decode tokens too)
CASES = [
    ("bf16-h128-after-context", BF16, 128, 16, 8, 2, [40, 1], [100, 33], False),
    ("f16-h64-split", F16, 64, 8, 4, 4, [37], [90], True),
    ("bf16-h96-gqa7-two-ctas", BF16, 96, 32, 14, 2, [12, 3], [12, 50], False),
    ("f16-h128-verify-and-decode", F16, 128, 32, 16, 4, [4, 1, 5], [60, 20, 77], True),
    ("bf16-h64-gqa20", BF16, 64, 16, 20, 1, [1, 3], [45, 70], None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_prefill_kernel_matches_torch_backend(emu_launcher, case):
    _, dtype, head, block, heads, kv_heads, q_lens, s_lens, split = case
    step = make_step(q_lens, s_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=head, block_size=block,
                     dtype=dtype, seed=head + heads)
    launched = _attend(emu_launcher, step, split)
    assert "paged_prefill" in launched and "paged_attention" not in launched
    if split:
        assert "paged_attention_reduce" in launched


def test_fp32_chunks_keep_the_cuda_core_kernel(emu_launcher):
    step = make_step([9], [30], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=torch.float32)
    assert _attend(emu_launcher, step, False) == {"paged_attention"}
