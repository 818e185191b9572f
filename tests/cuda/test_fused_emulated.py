"""The fused kernels (cuda/fused_ops.cu) under the CPU emulation against the torch reference, and a
model forward with the kernel backend (fused kernels, emulated attention) against the torch path."""

from __future__ import annotations

import pytest
import torch

from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend
from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend
from folio.core.executor.model.loader import load_model
from folio.testing.models import write_tiny_model
from tests.cuda.fused_cases import DTYPES, check_add_rms_norm, check_rope_write_kv, check_silu_and_mul

IDS = [str(d).removeprefix("torch.") for d in DTYPES]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_add_rms_norm(emu_launcher, dtype):
    check_add_rms_norm(emu_launcher, dtype)
    assert {name for name, _, _ in emu_launcher.launches} == {f"folio::add_rms_norm<{_c(dtype)}>"}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_silu_and_mul(emu_launcher, dtype):
    check_silu_and_mul(emu_launcher, dtype)
    assert [name for name, _, _ in emu_launcher.launches] == [f"folio::silu_and_mul<{_c(dtype)}>"]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_rope_write_kv(emu_launcher, dtype, head_dim):
    check_rope_write_kv(emu_launcher, dtype, head_dim)
    assert [name for name, _, _ in emu_launcher.launches] == [f"folio::rope_write_kv<{_c(dtype)}>"]


def test_unfit_shapes_fall_back_to_the_reference(emu_launcher):
    """A row that is not whole 16-byte vectors takes the torch path (and says so)."""
    backend = KernelAttentionBackend(emu_launcher, torch.float32)
    ops = backend.layer_ops
    x = torch.randn(2, 2 * 30)  # d = 30 fp32: 120 bytes
    torch.testing.assert_close(ops.silu_and_mul(x), torch.nn.functional.silu(x[:, :30]) * x[:, 30:])
    assert ops.num_fallbacks == 1 and not emu_launcher.launches


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-fused"), hidden_size=128, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=96, num_hidden_layers=2,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_model_forward_with_fused_kernels(model_dir, emu_launcher, dtype):
    """A prefill of two sequences through every layer: the kernel backend's fused norms, RoPE + KV
    write and activation give the torch path's hidden states and the same pool contents."""
    model = load_model(model_dir, dtype, torch.device("cpu"), "none")
    query_lens, block_size = [5, 3], 8
    meta_args = (query_lens, query_lens, [[0], [2]], None, block_size)
    ids = torch.tensor([3, 17, 99, 5, 42, 8, 8, 61])
    outputs = []
    for backend in (TorchAttentionBackend(), KernelAttentionBackend(emu_launcher, dtype)):
        meta = AttentionMetadata.build(*meta_args)
        pool = [(torch.zeros(4, block_size, 1, 64, dtype=dtype), torch.zeros(4, block_size, 1, 64, dtype=dtype))
                for _ in range(2)]
        with torch.inference_mode():
            outputs.append((model(ids, meta.positions, pool, meta, backend), pool))
    (want, want_pool), (got, got_pool) = outputs
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    for (wk, wv), (gk, gv) in zip(want_pool, got_pool):
        torch.testing.assert_close(gk.float(), wk.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(gv.float(), wv.float(), atol=tol, rtol=tol)
    launched = {name.split("<")[0] for name, _, _ in emu_launcher.launches}
    assert {"folio::add_rms_norm", "folio::rope_write_kv", "folio::silu_and_mul"} <= launched


def _c(dtype) -> str:
    return {torch.float32: "float", torch.float16: "folio::f16", torch.bfloat16: "folio::bf16"}[dtype]
