"""The multi-LoRA kernels (cuda/lora.cu, Punica's BGMV and SGMV): compiled for sm_80/sm_90 without
spills, and run in the CPU emulation against an fp32 torch reference of the same inputs (ranks 8,
16 and 64 zero-padded to r_max, rows without an adapter, empty slots, one row, many rows, several
segments, f16/bf16/fp32, the delta added into a y that already holds the base output). The ``gpu``
test runs the same cases on a GPU through CuPy.
"""

from __future__ import annotations

import re

import pytest
import torch

from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.kernels import lora_kernels as lk
from tests.cuda.emu_runtime import EmulatedLauncher, build_unit_library, compile_problems


@pytest.fixture(scope="module")
def launcher() -> EmulatedLauncher:
    return EmulatedLauncher(build_unit_library("lora", lk.all_name_expressions(), ("mma.cuh", "common.cuh")))


# ---------------------------------------------------------------------------- cases and the reference
def make_adapters(slots: int, ranks: list[int], r_max: int, k_in: int, out: int, dtype, seed: int):
    """Stacked ``lora_a [slots, r_max, in]``, ``lora_b [slots, out, r_max]``: slot s has rank
    ranks[s] (0: an empty slot, all zeros), the rest of r_max zero-padded; distinct scales."""
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(slots, r_max, k_in)
    b = torch.zeros(slots, out, r_max)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, k_in, generator=g) / k_in**0.5
        b[s, :, :r] = torch.randn(out, r, generator=g) / r**0.5
    scales = torch.tensor([0.5 + 0.75 * s for s in range(slots)], dtype=torch.float32)
    return a.to(dtype), b.to(dtype), scales


def reference(y, x, lora_a, lora_b, slot_of_row: list[int], scales) -> torch.Tensor:
    """fp32 math on the same inputs, row by row (the obvious loop)."""
    want = y.float().clone()
    for t, s in enumerate(slot_of_row):
        if s >= 0:
            want[t] += scales[s] * ((x[t].float() @ lora_a[s].float().t()) @ lora_b[s].float().t())
    return want


def tolerance(dtype) -> float:
    # y + delta rounded once to the dtype (the tensor-core SGMV also rounds the intermediate);
    # measured: 0.03% (f16), 0.22-0.34% (bf16), 4e-7 (fp32) of the largest output, where torch in
    # the dtype itself is off by 0.06% and 0.45%
    return {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 6e-3}[dtype]


def check(got, want, y_before, dtype, slot_of_row):
    scale = want.abs().max().item()
    err = (got.float() - want).abs().max().item()
    assert err <= tolerance(dtype) * scale, (err, scale)
    for t, s in enumerate(slot_of_row):  # rows without an adapter are left bit for bit alone
        if s < 0:
            assert torch.equal(got[t], y_before[t]), t


def base_output(n, out, dtype, seed):
    return torch.randn(n, out, generator=torch.Generator().manual_seed(seed)).to(dtype)


DTYPES = [torch.float16, torch.bfloat16, torch.float32]


# ---------------------------------------------------------------------------- BGMV
@pytest.mark.parametrize("dtype", DTYPES)
def test_bgmv_mixed_ranks_padding_rows_and_an_empty_slot(launcher, dtype):
    # slots: rank 8, 16, 64 (r_max 64), and slot 3 loaded with nothing that any row uses
    n, k_in, out = 11, 96, 200  # out spans two 128-column CTAs, the second partial
    lora_a, lora_b, scales = make_adapters(4, [8, 16, 64, 0], 64, k_in, out, dtype, seed=1)
    x = torch.randn(n, k_in, generator=torch.Generator().manual_seed(2)).to(dtype)
    slot_of_row = [0, -1, 2, 1, 1, -1, 2, 0, 2, -1, 1]
    y = base_output(n, out, dtype, seed=3)
    before = y.clone()
    want = reference(y, x, lora_a, lora_b, slot_of_row, scales)
    got = lk.bgmv(y, x, lora_a, lora_b, torch.tensor(slot_of_row), scales, launcher=launcher)
    assert got is y  # in place
    check(y, want, before, dtype, slot_of_row)


def test_bgmv_one_row(launcher):
    lora_a, lora_b, scales = make_adapters(2, [16, 8], 16, 64, 48, torch.bfloat16, seed=4)
    x = torch.randn(1, 64).to(torch.bfloat16)
    y = base_output(1, 48, torch.bfloat16, seed=5)
    before = y.clone()
    want = reference(y, x, lora_a, lora_b, [1], scales)
    lk.bgmv(y, x, lora_a, lora_b, torch.tensor([1]), scales, launcher=launcher)
    check(y, want, before, torch.bfloat16, [1])
    assert not torch.equal(y, before)


def test_bgmv_all_rows_without_adapter_change_nothing(launcher):
    lora_a, lora_b, scales = make_adapters(2, [8, 8], 8, 32, 40, torch.float16, seed=6)
    x = torch.randn(5, 32).to(torch.float16)
    y = base_output(5, 40, torch.float16, seed=7)
    before = y.clone()
    lk.bgmv(y, x, lora_a, lora_b, torch.full((5,), -1), scales, launcher=launcher)
    assert torch.equal(y, before)


def test_bgmv_strided_views_of_fused_outputs(launcher):
    """x and y as column slices of wider rows (a fused qkv output's k part, say)."""
    dtype = torch.float16
    lora_a, lora_b, scales = make_adapters(3, [8, 16, 16], 16, 64, 40, dtype, seed=8)
    wide_x = torch.randn(6, 64 + 16).to(dtype)
    x = wide_x[:, 16:]  # row stride 80 (a multiple of 8: used as it is)
    wide_y = base_output(6, 120, dtype, seed=9)
    y = wide_y[:, 40:80]
    before = wide_y.clone()
    slot_of_row = [2, 0, -1, 1, 2, 2]
    want = reference(y, x, lora_a, lora_b, slot_of_row, scales)
    lk.bgmv(y, x, lora_a, lora_b, torch.tensor(slot_of_row), scales, launcher=launcher)
    check(wide_y[:, 40:80], want, before[:, 40:80], dtype, slot_of_row)
    assert torch.equal(wide_y[:, :40], before[:, :40]) and torch.equal(wide_y[:, 80:], before[:, 80:])


# ---------------------------------------------------------------------------- SGMV
def segments_to_rows(starts: list[int], slots: list[int], n: int) -> list[int]:
    rows = [-1] * n
    ends = starts[1:] + [n] if len(starts) == len(slots) else starts[1:]
    for b, e, s in zip(starts, ends, slots):
        rows[b:e] = [s] * (e - b)
    return rows


SGMV_PATHS = [(torch.float16, True), (torch.bfloat16, True), (torch.float16, False), (torch.bfloat16, False),
              (torch.float32, False)]


@pytest.mark.parametrize("dtype,tensor_cores", SGMV_PATHS, ids=lambda p: str(p).removeprefix("torch."))
def test_sgmv_several_segments(launcher, dtype, tensor_cores):
    # 5 segments: 70 rows (two 64-row tensor-core items, five 16-row CUDA-core items, the last
    # partial), 1 row, 20 rows without adapter, an empty segment, 59 rows; in = 1096 gives 3 k
    # splits (the last partial); out = 136 spans 3 tiles of 64 columns, 2 of 128 (the last partial)
    n, k_in, out = 150, 1096, 136
    lora_a, lora_b, scales = make_adapters(4, [64, 8, 16, 0], 64, k_in, out, dtype, seed=10)
    starts, slots = [0, 70, 71, 91, 91, 150], [0, 2, -1, 1, 1]
    x = torch.randn(n, k_in, generator=torch.Generator().manual_seed(11)).to(dtype)
    y = base_output(n, out, dtype, seed=12)
    before = y.clone()
    slot_of_row = segments_to_rows(starts, slots, n)
    want = reference(y, x, lora_a, lora_b, slot_of_row, scales)
    launcher.launches.clear()
    got = lk.sgmv(y, x, lora_a, lora_b, torch.tensor(starts), torch.tensor(slots), scales, launcher=launcher,
                  tensor_cores=tensor_cores)
    assert got is y
    check(y, want, before, dtype, slot_of_row)
    assert lk.k_splits(k_in)[0] == 3
    bm, bn = (lk.MMA_BM, lk.MMA_BN) if tensor_cores else (lk.LORA_BM, lk.EXPAND_THREADS)
    assert [grid for _, grid, _ in launcher.launches] == [(n // bm + 5, 3, 1), (n // bm + 5, -(-out // bn), 1)]
    assert ("mma" in launcher.launches[0][0]) == tensor_cores


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sgmv_tensor_cores_rank_not_a_multiple_of_16(launcher, dtype):
    """r_max 24: the shrink's last 16-column ldmatrix reads 8 rank rows past r_max (never loaded,
    never written back); the expand pads K to 32 with zeros."""
    n, k_in, out = 23, 200, 72
    lora_a, lora_b, scales = make_adapters(3, [24, 8, 16], 24, k_in, out, dtype, seed=30)
    starts, slots = [0, 9, 23], [0, 1]
    x = torch.randn(n, k_in, generator=torch.Generator().manual_seed(31)).to(dtype)
    y = base_output(n, out, dtype, seed=32)
    before = y.clone()
    slot_of_row = segments_to_rows(starts, slots, n)
    want = reference(y, x, lora_a, lora_b, slot_of_row, scales)
    lk.sgmv(y, x, lora_a, lora_b, torch.tensor(starts), torch.tensor(slots), scales, launcher=launcher)
    check(y, want, before, dtype, slot_of_row)


def test_sgmv_starts_without_the_end_and_one_row_segments(launcher):
    dtype = torch.bfloat16
    n, k_in, out = 6, 64, 32
    lora_a, lora_b, scales = make_adapters(3, [16, 8, 16], 16, k_in, out, dtype, seed=13)
    starts, slots = [0, 1, 2, 5], [2, 0, 1, 2]  # [num_segs]: the last segment ends at n
    x = torch.randn(n, k_in).to(dtype)
    y = base_output(n, out, dtype, seed=14)
    before = y.clone()
    slot_of_row = segments_to_rows(starts, slots, n)
    want = reference(y, x, lora_a, lora_b, slot_of_row, scales)
    lk.sgmv(y, x, lora_a, lora_b, torch.tensor(starts), torch.tensor(slots), scales, launcher=launcher)
    check(y, want, before, dtype, slot_of_row)


def test_sgmv_agrees_with_bgmv(launcher):
    """The same rows through both operators (f16, ranks 8/64 at r_max 64)."""
    dtype = torch.float16
    n, k_in, out = 40, 256, 64
    lora_a, lora_b, scales = make_adapters(2, [8, 64], 64, k_in, out, dtype, seed=15)
    x = torch.randn(n, k_in).to(dtype)
    starts, slots = [0, 17, 40], [1, 0]
    y1, y2 = base_output(n, out, dtype, seed=16), base_output(n, out, dtype, seed=16)
    lk.sgmv(y1, x, lora_a, lora_b, torch.tensor(starts), torch.tensor(slots), scales, launcher=launcher)
    lk.bgmv(y2, x, lora_a, lora_b, torch.tensor(segments_to_rows(starts, slots, n)), scales, launcher=launcher)
    torch.testing.assert_close(y1, y2, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_agree_with_the_torch_operators(launcher, dtype):
    """lora.punica's torch bgmv/sgmv (what the CPU runs, and what dispatches to these kernels for
    CUDA tensors) and the kernels on the same arguments."""
    from folio.core.executor.lora import punica

    n, k_in, out = 21, 128, 96
    lora_a, lora_b, scales = make_adapters(3, [8, 16, 16], 16, k_in, out, dtype, seed=40)
    x = torch.randn(n, k_in, generator=torch.Generator().manual_seed(41)).to(dtype)
    indices = torch.tensor([(t * 5) % 4 - 1 for t in range(n)])
    starts, slots = torch.tensor([0, 4, 5, 21]), torch.tensor([2, -1, 0])
    for torch_op, kernel_op, index_args in ((punica.bgmv, lk.bgmv, (indices,)),
                                            (punica.sgmv, lk.sgmv, (starts, slots))):
        y_torch, y_kernel = base_output(n, out, dtype, seed=42), base_output(n, out, dtype, seed=42)
        torch_op(y_torch, x, lora_a, lora_b, *index_args, scales)
        kernel_op(y_kernel, x, lora_a, lora_b, *index_args, scales, launcher=launcher)
        # torch rounds the delta to the dtype before adding it: a rounding or two apart
        torch.testing.assert_close(y_kernel, y_torch, rtol=2 * tolerance(dtype), atol=2 * tolerance(dtype))


def test_deterministic(launcher):
    dtype = torch.bfloat16
    lora_a, lora_b, scales = make_adapters(2, [16, 16], 16, 1024, 32, dtype, seed=17)
    x = torch.randn(20, 1024).to(dtype)
    runs = []
    for _ in range(2):
        y = base_output(20, 32, dtype, seed=18)
        runs.append(lk.sgmv(y, x, lora_a, lora_b, torch.tensor([0, 20]), torch.tensor([1]), scales,
                            launcher=launcher))
    assert torch.equal(runs[0], runs[1])


def test_sizes_the_kernels_cannot_take_are_named():
    y, x = torch.zeros(2, 16, dtype=torch.float16), torch.zeros(2, 20, dtype=torch.float16)
    a, b = torch.zeros(1, 12, 20, dtype=torch.float16), torch.zeros(1, 16, 12, dtype=torch.float16)
    problems = lk.shape_problems(y, x, a, b)
    assert any("input size 20" in p for p in problems) and any("rank 12" in p for p in problems)
    assert not lk.applies(y, x, a, b)
    with pytest.raises(ValueError, match="rank 12"):
        lk.bgmv(y, x, a, b, torch.zeros(2, dtype=torch.long), torch.ones(1))
    assert lk.applies(torch.zeros(2, 16), torch.zeros(2, 24), torch.zeros(3, 8, 24), torch.zeros(3, 16, 8))
    assert not lk.applies(torch.zeros(2, 16), torch.zeros(2, 24, dtype=torch.float16), torch.zeros(3, 8, 24),
                          torch.zeros(3, 16, 8))
    with pytest.raises(ck.UnsupportedKernelError, match="tensor-core"):
        lk.sgmv(torch.zeros(2, 16), torch.zeros(2, 24), torch.zeros(3, 8, 24), torch.zeros(3, 16, 8),
                torch.tensor([0, 2]), torch.tensor([1]), torch.ones(3), tensor_cores=True)
    with pytest.raises(ValueError, match="CUDA device"):  # CPU tensors without an emulated launcher
        lk.bgmv(torch.zeros(2, 16), torch.zeros(2, 24), torch.zeros(3, 8, 24), torch.zeros(3, 16, 8),
                torch.zeros(2, dtype=torch.long), torch.ones(3))


# ---------------------------------------------------------------------------- compile
ARCHS = ("80", "90")


@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_without_spills(arch):
    problems = compile_problems(lk.module_source(), "lora.cu", lk.all_name_expressions(), arch)
    assert not problems, f"sm_{arch}:\n" + "\n".join(problems)


def test_python_constants_match_the_kernel_source():
    source = lk.module_source()
    assert '#include "' not in source
    for name, value in (("LORA_MAX_RANK", lk.MAX_RANK), ("LORA_BM", lk.LORA_BM), ("LORA_BK", lk.LORA_BK),
                        ("BGMV_SHRINK_THREADS", lk.BGMV_SHRINK_THREADS),
                        ("SGMV_SHRINK_THREADS", lk.SGMV_SHRINK_THREADS), ("EXPAND_THREADS", lk.EXPAND_THREADS),
                        ("MMA_THREADS", lk.MMA_THREADS), ("MMA_BM", lk.MMA_BM), ("MMA_BN", lk.MMA_BN)):
        assert re.search(rf"constexpr int {name} = {value};", source), name


# ---------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_bgmv_and_sgmv_match_torch(dtype):
    n, k_in, out = 300, 2048, 2560
    lora_a, lora_b, scales = make_adapters(4, [8, 16, 64, 0], 64, k_in, out, dtype, seed=20)
    x = torch.randn(n, k_in, generator=torch.Generator().manual_seed(21)).to(dtype)
    rows = [(t * 7) % 5 - 1 for t in range(n)]  # -1, 0, 1, 2, 3 (slot 3 empty)
    starts, slots = [0, 1, 130, 131, 200, 300], [2, -1, 0, 3, 1]
    for op in ("bgmv", "sgmv", "sgmv on CUDA cores"):
        slot_of_row = rows if op == "bgmv" else segments_to_rows(starts, slots, n)
        y = base_output(n, out, dtype, seed=22)
        before = y.clone()
        want = reference(y, x, lora_a, lora_b, slot_of_row, scales)
        yc = y.cuda()
        cuda_args = [t.cuda() for t in (x, lora_a, lora_b)]
        if op == "bgmv":
            lk.bgmv(yc, *cuda_args, torch.tensor(rows).cuda(), scales.cuda())
        else:
            lk.sgmv(yc, *cuda_args, torch.tensor(starts).cuda(), torch.tensor(slots).cuda(), scales.cuda(),
                    tensor_cores=None if op == "sgmv" else False)
        # the GPU's fp32 sums run in another order (and -ftz): a little more room for fp32
        got = yc.cpu()
        scale = want.abs().max().item()
        err = (got.float() - want).abs().max().item()
        assert err <= max(tolerance(dtype), 1e-4) * scale, (op, dtype, err, scale)
        for t, s in enumerate(slot_of_row):
            if s < 0:
                assert torch.equal(got[t], before[t]), (op, t)
