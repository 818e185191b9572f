"""The kernels and the whole executor on a real GPU (``gpu`` marker; skipped without CUDA).

Every built instance (dtype x head size x block size) runs one mixed decode/chunk step, split
and unsplit, against the torch backend; then cache write, copy-on-write, swap through a pinned
host pool, a non-default stream, and greedy generation with the cuda backend against the torch
backend. scripts/gpu_check.sh runs these on a lent GPU machine.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.kernels.attention import TorchAttentionBackend
from folio.core.executor.kernels.kernel_backend import make_host_pool
from tests.cuda.kv_cases import FP8_KV_SCALES, TOLERANCE, fresh_meta, make_fp8_step, make_step, reference_attention

pytestmark = pytest.mark.gpu

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INSTANCES = list(itertools.product(ck.DTYPES, ck.HEAD_SIZES, ck.BLOCK_SIZES))


@pytest.fixture(scope="module")
def cuda_backend_cls():
    pytest.importorskip("cupy")
    from folio.core.executor.kernels.cuda_backend import CudaAttentionBackend

    return CudaAttentionBackend


@pytest.mark.parametrize("dtype_name,head_dim,block_size", INSTANCES, ids=["-".join(map(str, i)) for i in INSTANCES])
def test_attend_every_instance(cuda_backend_cls, dtype_name, head_dim, block_size):
    dtype = DTYPES[dtype_name]
    step = make_step([1, 9, 1, 30], [700, 9, 40, 1100], num_heads=8, num_kv_heads=2, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, device="cuda")
    expected = reference_attention(step, head_dim**-0.5)
    for split in (False, True):
        backend = cuda_backend_cls(dtype, split=split)
        out = backend.attend(step.query, step.k_cache, step.v_cache, fresh_meta(step), head_dim**-0.5)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol, msg=lambda m: f"split={split}: {m}")


@pytest.mark.parametrize("group", [1, 4, 7, 16])
def test_attend_gqa_groups_and_long_context(cuda_backend_cls, group):
    step = make_step([1, 1, 17], [9000, 3, 5000], num_heads=2 * group, num_kv_heads=2, head_dim=128,
                     block_size=16, dtype=torch.bfloat16, device="cuda", seed=group)
    out = cuda_backend_cls(torch.bfloat16).attend(step.query, step.k_cache, step.v_cache, fresh_meta(step), 0.088)
    torch.testing.assert_close(out.float(), reference_attention(step, 0.088), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("group", [2, 8])
def test_decode_split_and_unsplit_long_context(cuda_backend_cls, group):
    """The decode kernel alone (one new token per sequence), forced split, forced unsplit and the
    automatic choice, over contexts that end in partial blocks."""
    step = make_step([1, 1, 1], [20000, 4097, 1], num_heads=4 * group, num_kv_heads=4, head_dim=64,
                     block_size=32, dtype=torch.bfloat16, device="cuda", seed=group)
    expected = reference_attention(step, 0.125)
    for split in (False, True, None):
        out = cuda_backend_cls(torch.bfloat16, split=split).attend(step.query, step.k_cache, step.v_cache,
                                                                   fresh_meta(step), 0.125)
        torch.testing.assert_close(out.float(), expected, atol=1.6e-2, rtol=1.6e-2, msg=lambda m: f"{split}: {m}")


def test_largest_step_runs(cuda_backend_cls):
    """A 140,000-token step (35 chunks of 4,000 tokens, GQA 4): 70,000 chunk work items, more
    than grid y allows; the whole grid runs and the last sequence matches a dense oracle."""
    from folio.core.executor.kernels.attention import dense_causal_attention

    q_len = 4000
    step = make_step([q_len] * 35, [q_len] * 35, num_heads=4, num_kv_heads=1, head_dim=64, block_size=32,
                     dtype=torch.bfloat16, device="cuda", seed=2)
    out = cuda_backend_cls(torch.bfloat16).attend(step.query, step.k_cache, step.v_cache, fresh_meta(step), 0.125)
    keys = step.k_cache[step.tables[-1]].flatten(0, 1)[:q_len].float()
    values = step.v_cache[step.tables[-1]].flatten(0, 1)[:q_len].float()
    expected = dense_causal_attention(step.query[-q_len:].float(), keys, values, 0.125)
    torch.testing.assert_close(out[-q_len:].float(), expected, atol=1.6e-2, rtol=1.6e-2)


def test_write_kv_with_padding(cuda_backend_cls):
    step = make_step([3, 1, 4], [3, 10, 12], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype=torch.float16, device="cuda")
    meta = fresh_meta(step)
    meta.slot_mapping = torch.cat([step.slots, torch.full((2,), -1, dtype=torch.int64, device="cuda")])
    qkv = torch.randn(10, 384, dtype=torch.float16, device="cuda")
    key, value = qkv[:, 128:256].view(10, 2, 64), qkv[:, 256:].view(10, 2, 64)
    k_ref, v_ref = step.k_cache.clone(), step.v_cache.clone()
    TorchAttentionBackend().write_kv(key, value, k_ref, v_ref, meta)
    meta.plan = None
    cuda_backend_cls(torch.float16).write_kv(key, value, step.k_cache, step.v_cache, meta)
    assert torch.equal(step.k_cache, k_ref) and torch.equal(step.v_cache, v_ref)


def test_copy_blocks_and_swap_roundtrip(cuda_backend_cls):
    backend = cuda_backend_cls(torch.bfloat16)
    shape = (8, 16, 2, 128)
    pool = [(torch.randn(shape, device="cuda").bfloat16(), torch.randn(shape, device="cuda").bfloat16())
            for _ in range(3)]
    expected = [(k.clone(), v.clone()) for k, v in pool]
    TorchAttentionBackend().copy_blocks(expected, [(0, 5), (7, 2)])
    backend.copy_blocks(pool, [(0, 5), (7, 2)])
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for kv, ke in zip(pool, expected) for a, b in zip(kv, ke))
    host = make_host_pool(pool, num_blocks=4, pin=True)
    backend.swap_out(pool, host, [(5, 0), (1, 3)])
    torch.cuda.synchronize()
    assert torch.equal(host[2][0][0], pool[2][0][5].cpu()) and torch.equal(host[1][1][3], pool[1][1][1].cpu())
    for k, v in pool:
        k[5].zero_()
        v[1].zero_()
    backend.swap_in(host, pool, [(0, 5), (3, 1)])
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for kv, ke in zip(pool, expected) for a, b in zip(kv, ke))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_pool_write_and_attend(cuda_backend_cls, dtype):
    """An e4m3 pool: write_kv bit for bit as the torch backend, decode and chunks (split and
    unsplit) against the torch backend dequantizing the same pool."""
    from folio.core.executor.kernels.kv_quant import FP8_DTYPE

    step = make_fp8_step([1, 9, 1, 30], [700, 9, 40, 1100], dtype, num_heads=8, num_kv_heads=2, head_dim=128,
                         block_size=16, device="cuda")
    expected = TorchAttentionBackend().attend(step.query.float(), step.k_cache, step.v_cache, fresh_meta(step),
                                              0.088, FP8_KV_SCALES)
    for split in (False, True):
        backend = cuda_backend_cls(dtype, split=split, kv_dtype=FP8_DTYPE)
        out = backend.attend(step.query, step.k_cache, step.v_cache, fresh_meta(step), 0.088, FP8_KV_SCALES)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol, msg=lambda m: f"split={split}: {m}")
    key = torch.randn(40, 2, 128, device="cuda").to(dtype) * 5
    value = torch.randn(40, 2, 128, device="cuda").to(dtype)
    meta = fresh_meta(step)
    meta.slot_mapping = step.slots[:40]
    k_ref, v_ref = step.k_cache.clone(), step.v_cache.clone()
    TorchAttentionBackend().write_kv(key, value, k_ref, v_ref, meta, (0.013, 0.0007))
    cuda_backend_cls(dtype, kv_dtype=FP8_DTYPE).write_kv(key, value, step.k_cache, step.v_cache, meta, (0.013, 0.0007))
    assert torch.equal(step.k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(step.v_cache.view(torch.uint8), v_ref.view(torch.uint8))


def test_runs_on_torch_current_stream(cuda_backend_cls):
    step = make_step([1, 5], [300, 40], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype=torch.float16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = cuda_backend_cls(torch.float16).attend(step.query, step.k_cache, step.v_cache, fresh_meta(step), 0.125)
        result = out.float()  # a torch op on the same stream: ordered after the kernel
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(result, reference_attention(step, 0.125), atol=2e-3, rtol=2e-3)


def _greedy(model_dir, backend: str, dtype: str, kv_cache_dtype: str = "auto"):
    from tests.executor.toy_driver import generate
    from folio.core.executor.runtime.runner import ModelRunner
    from folio.shared.config import RuntimeConfig
    from folio.shared.sampling import SamplingParams

    config = RuntimeConfig(device="cuda", dtype=dtype, num_kv_blocks=256, block_size=16, attention_backend=backend,
                           kv_cache_dtype=kv_cache_dtype)
    runner = ModelRunner(config, model_dir)
    assert runner.backend.name == backend
    prompts = [[3, 17, 99, 5, 42, 8, 8, 61, 120, 7, 33, 2, 90, 11, 4] * 3, [9, 1, 77, 23, 5], [6] * 40]
    return generate(runner, prompts, SamplingParams(temperature=0.0, max_tokens=24), chunk_size=16)


def test_executor_greedy_equal_tiny_model(cuda_backend_cls, tmp_path):
    from folio.testing.models import write_tiny_model

    model_dir = write_tiny_model(tmp_path, hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
                                 intermediate_size=128)
    assert _greedy(model_dir, "cuda", "float32") == _greedy(model_dir, "torch", "float32")


@pytest.mark.slow
def test_executor_greedy_equal_smollm(cuda_backend_cls, smollm_dir):
    assert _greedy(smollm_dir, "cuda", "float32") == _greedy(smollm_dir, "torch", "float32")


def test_executor_fp8_kv_cache_tiny_model(cuda_backend_cls, tmp_path):
    """bf16 over an fp8 pool with the cuda backend (calibration, CUDA graphs, chunked prefill): the
    greedy tokens of the torch backend over the same pool, allowing a late near-tie to differ."""
    from folio.testing.models import write_tiny_model

    model_dir = write_tiny_model(tmp_path, hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
                                 intermediate_size=128)
    cuda, ref = _greedy(model_dir, "cuda", "bfloat16", "fp8"), _greedy(model_dir, "torch", "bfloat16", "fp8")
    assert sum(a[:4] == b[:4] for a, b in zip(cuda, ref)) >= 2, (cuda, ref)
