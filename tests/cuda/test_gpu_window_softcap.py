"""Sliding windows, logit soft-caps and GeGLU on a real GPU (``gpu`` marker; skipped without CUDA):
the cases of ``window_cases`` through the CuPy backend against the dense fp32 oracle (and the
torch backend's reference when it takes windows). scripts/gpu_check.sh runs them."""

from __future__ import annotations

import pytest
import torch

from tests.cuda.kv_cases import FP8_KV_SCALES, make_fp8_step, make_step
from tests.cuda.window_cases import check, check_gelu_tanh_and_mul, run_attend

pytestmark = pytest.mark.gpu

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(scope="module")
def make_backend():
    pytest.importorskip("cupy")
    from folio.core.executor.kernels.cuda_backend import CudaAttentionBackend

    def make(dtype, split=None, partition_size=512, kv_dtype=None):
        backend = CudaAttentionBackend(dtype, split=split, kv_dtype=kv_dtype)
        backend.partition_size = partition_size
        return backend

    return make


@pytest.mark.parametrize("dtype,head_dim,block_size", [(F32, 64, 16), (F16, 96, 8), (BF16, 128, 32)],
                         ids=["f32-64-16", "f16-96-8", "bf16-128-32"])
def test_window_softcap_decode_and_chunks(make_backend, dtype, head_dim, block_size):
    """A mixed step (decode rows, a prefix-cached chunk, verification chunks, a prefill from 0)
    over long contexts; windows that end mid-block and longer than a context; split and unsplit."""
    step = make_step([1, 40, 4, 1, 300], [3000, 1500, 700, 5, 300], num_heads=8, num_kv_heads=2, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, device="cuda", seed=head_dim)
    for window, softcap, split in ((1, 0.0, None), (257, 50.0, None), (257, 5.0, True), (4096, 30.0, False)):
        out, scale = run_attend(make_backend, step, window=window, softcap=softcap, split=split, partition_size=64)
        check(out, step, scale, window, softcap)


@pytest.mark.parametrize("softcap", [1e-3, 1e-30])
def test_softcap_fp32_edges(make_backend, softcap):
    step = make_step([1, 7], [400, 300], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=BF16,
                     device="cuda", seed=8)
    out, scale = run_attend(make_backend, step, window=17, softcap=softcap, scale=1e4)
    check(out, step, scale, 17, softcap)


def test_fp8_pool_window_and_softcap(make_backend):
    step = make_fp8_step([1, 13, 1], [2000, 600, 9], BF16, num_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
                         device="cuda", seed=12)
    for split in (False, True):
        out, scale = run_attend(make_backend, step, window=100, softcap=3.0, split=split, partition_size=64,
                                kv_scales=FP8_KV_SCALES)
        check(out, step, scale, 100, 3.0, kv_scales=FP8_KV_SCALES)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_gelu_tanh_and_mul(dtype):
    pytest.importorskip("cupy")
    from folio.core.executor.kernels.cuda_backend import CupyLauncher

    check_gelu_tanh_and_mul(CupyLauncher(), dtype, device="cuda", num_tokens=64)
