"""The fp8 (e4m3) KV pool on the kernel side, under the CPU emulation: the conversions of
cuda/common.cuh bit for bit against torch's float8_e4m3fn, and write_kv, the decode kernel and the
CUDA-core chunk kernel over fp8 pools against the torch backend on the same pools."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from folio.core.executor.kernels.attention import TorchAttentionBackend
from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend, make_host_pool
from folio.core.executor.quant.kv_quant import FP8_DTYPE, FP8_MAX, quantize
from tests.cuda.emu_runtime import run_probe
from tests.cuda.kv_cases import FP8_KV_SCALES, fresh_meta, make_fp8_step

F16, BF16 = torch.float16, torch.bfloat16


def _torch_fp8_bits(x: torch.Tensor) -> np.ndarray:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8).numpy()


def test_fp8_conversions_match_torch_bit_for_bit(emu_lib):
    """Every e4m3 value, the midpoints between neighbours (ties: nearest even), a hair either side
    of them, subnormals, the saturation edge, infinities, NaN and random floats of every scale."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    finite = values[torch.isfinite(values)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, 447.9, 448.0, 449.0, 463.9, 464.0, 465.0, 480.0, 1e6, 1e-10, 2.0**-10,
                            2.0**-9, 3 * 2.0**-10, 2.0**-6, float("inf"), float("-inf"), float("nan")])
    inputs = torch.cat([finite, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), -mids,
                        special, -special, torch.randn(20000, generator=gen) * 10 ** torch.randint(-4, 4, (20000,),
                                                                                                 generator=gen)])
    inputs_np = inputs.numpy().astype(np.float32)
    out = np.zeros(len(inputs_np), dtype=np.uint8)
    widened = np.zeros(256, dtype=np.float32)
    run_probe(emu_lib, "folio_probe::fp8_probe", [out, widened, inputs_np, np.array([len(inputs_np)], np.int32)],
              threads=128)
    expected = _torch_fp8_bits(inputs)
    assert np.array_equal(out, expected), inputs_np[out != expected][:10]
    torch_widened = values.numpy()
    nan = np.isnan(torch_widened)
    assert np.array_equal(np.isnan(widened), nan)
    assert np.array_equal(widened[~nan].view(np.uint32), torch_widened[~nan].view(np.uint32))  # -0.0 too


def _backend(launcher, dtype, split=None):
    return KernelAttentionBackend(launcher, dtype, split=split, partition_size=32, kv_dtype=FP8_DTYPE)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_write_kv_into_an_fp8_pool_equals_the_torch_backend(emu_launcher, dtype):
    step = make_fp8_step([3, 1, 4], [3, 10, 12], dtype, block_size=8)
    meta = fresh_meta(step)
    gen = torch.Generator().manual_seed(1)
    qkv = (torch.randn(8, 3 * 2 * 64, generator=gen) * 4).to(dtype)
    key, value = qkv[:, 128:256].view(8, 2, 64), qkv[:, 256:].view(8, 2, 64)
    k_ref, v_ref = step.k_cache.clone(), step.v_cache.clone()
    TorchAttentionBackend().write_kv(key, value, k_ref, v_ref, meta, (0.013, 0.0007))
    k_out, v_out = step.k_cache.clone(), step.v_cache.clone()
    _backend(emu_launcher, dtype).write_kv(key, value, k_out, v_out, fresh_meta(step), (0.013, 0.0007))
    assert torch.equal(k_out.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_out.view(torch.uint8), v_ref.view(torch.uint8))  # saturated values included
    assert not torch.equal(k_out.view(torch.uint8), step.k_cache.view(torch.uint8))
    assert [n for n, _, _ in emu_launcher.launches] == [f"folio::write_kv<folio::{'f16' if dtype == F16 else 'bf16'}, "
                                                       "folio::fp8e4m3>"]


# (id, dtype, head_dim, block_size, num_heads, num_kv_heads, query_lens, seq_lens, split)
FP8_CASES = [
    ("decode-bf16-h64-gqa2", BF16, 64, 16, 4, 2, [1, 1, 1], [1, 37, 90], False),
    ("decode-f16-h128-split", F16, 128, 32, 8, 2, [1, 1], [70, 130], True),
    ("decode-bf16-h96-b8", BF16, 96, 8, 2, 2, [1, 1], [20, 41], None),
    ("mixed-chunks-f16-h64-split", F16, 64, 8, 8, 2, [1, 7, 1, 20], [33, 7, 9, 45], True),
    ("chunk-bf16-h128-gqa4", BF16, 128, 16, 8, 2, [18], [40], False),
]


@pytest.mark.parametrize("case", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_attend_over_an_fp8_pool_matches_the_torch_backend(emu_launcher, case):
    _, dtype, head_dim, block_size, num_heads, num_kv_heads, query_lens, seq_lens, split = case
    step = make_fp8_step(query_lens, seq_lens, dtype, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, block_size=block_size, seed=head_dim + block_size)
    scale, kv_scales = head_dim**-0.5, FP8_KV_SCALES
    out = _backend(emu_launcher, dtype, split).attend(step.query, step.k_cache, step.v_cache, fresh_meta(step),
                                                      scale, kv_scales)
    # the reference: the torch backend dequantizing the same fp8 pool, all in fp32
    expected = TorchAttentionBackend().attend(step.query.float(), step.k_cache, step.v_cache, fresh_meta(step),
                                              scale, kv_scales)
    tol = 2e-3 if dtype == F16 else 1.6e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    launched = {name.split("<")[0].removeprefix("folio::") for name, _, _ in emu_launcher.launches}
    assert all(name.endswith("folio::fp8e4m3>") for name, _, _ in emu_launcher.launches if "reduce" not in name)
    assert "paged_prefill" not in launched  # fp8 chunks take the CUDA-core kernel
    if max(query_lens) > 1:
        assert "paged_attention" in launched
    # the scales matter: the same bytes read with scale 1 give another result
    wrong = _backend(emu_launcher, dtype, split).attend(step.query, step.k_cache, step.v_cache, fresh_meta(step),
                                                        scale)
    assert not torch.allclose(wrong.float(), expected, atol=tol, rtol=tol)


def test_copy_and_swap_move_fp8_blocks_bit_for_bit(emu_launcher):
    gen = torch.Generator().manual_seed(2)
    pool = [(quantize(torch.randn(6, 8, 2, 64, generator=gen), 0.01), quantize(torch.randn(6, 8, 2, 64, generator=gen),
                                                                               0.01)) for _ in range(2)]
    want = [(k.clone(), v.clone()) for k, v in pool]
    backend = _backend(emu_launcher, BF16)
    backend.copy_blocks(pool, [(0, 3), (5, 1)])
    TorchAttentionBackend().copy_blocks(want, [(0, 3), (5, 1)])
    host = make_host_pool(pool, num_blocks=4, pin=False)
    assert host[0][0].dtype == FP8_DTYPE and host[0][0].nbytes == 4 * 8 * 2 * 64
    backend.swap_out(pool, host, [(3, 0), (1, 2)])
    for k, v in pool:
        k.view(torch.uint8)[3].zero_()
        v.view(torch.uint8)[1].zero_()
    backend.swap_in(host, pool, [(0, 3), (2, 1)])
    for (k, v), (kw, vw) in zip(pool, want):
        assert torch.equal(k.view(torch.uint8), kw.view(torch.uint8)) and torch.equal(v.view(torch.uint8),
                                                                                     vw.view(torch.uint8))


def test_fp32_activations_over_an_fp8_pool_are_refused_clearly(emu_launcher):
    from folio.core.executor.kernels.cuda_kernels import UnsupportedKernelError

    with pytest.raises(UnsupportedKernelError, match="fp8 KV pool.*--attention-backend torch"):
        KernelAttentionBackend(emu_launcher, torch.float32, kv_dtype=FP8_DTYPE)
