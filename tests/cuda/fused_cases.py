"""Cases for the fused kernels of cuda/fused_ops.cu, shared by the emulated and the GPU tests:
each runs ``KernelLayerOps`` (through a launcher) and the torch reference on the same inputs."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend
from folio.core.executor.kernels.layer_ops import TORCH_LAYER_OPS, KernelLayerOps
from folio.core.executor.model.layers import rope_cos_sin

# elementwise results: 16-bit types may differ by one rounding step (the RMS sum's order, exp)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _norm(hidden: int, dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = (1.0 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    return SimpleNamespace(weight=weight, eps=1e-5)


def check_add_rms_norm(launcher, dtype, device="cpu", num_tokens: int = 3, hidden: int = 2560, seed: int = 0):
    """Fused residual add + norm, and the plain norm, against the reference; the residual is
    updated in place; a strided input (a view of a wider buffer) is read at its stride."""
    g = torch.Generator().manual_seed(seed)
    ops = KernelLayerOps(launcher)
    norm = _norm(hidden, dtype, device, seed)
    wide = (2.0 * torch.randn(num_tokens, hidden + 64, generator=g)).to(dtype).to(device)
    x = wide[:, :hidden]  # token stride hidden + 64
    residual = torch.randn(num_tokens, hidden, generator=g).to(dtype).to(device)
    want_res, want_out = TORCH_LAYER_OPS.add_rms_norm(x, residual.clone(), norm)
    got_res, got_out = ops.add_rms_norm(x, residual, norm)
    assert got_res.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(got_res, want_res, atol=0, rtol=0)  # one rounded add: exact
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got_out.float(), want_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(ops.rms_norm(x, norm).float(), TORCH_LAYER_OPS.rms_norm(x, norm).float(),
                               atol=tol, rtol=tol)
    assert ops.num_fallbacks == 0


def check_silu_and_mul(launcher, dtype, device="cpu", num_tokens: int = 3, d: int = 2560, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ops = KernelLayerOps(launcher)
    wide = (3.0 * torch.randn(num_tokens, 2 * d + 32, generator=g)).to(dtype).to(device)
    gate_up = wide[:, : 2 * d]
    want = TORCH_LAYER_OPS.silu_and_mul(gate_up)
    got = ops.silu_and_mul(gate_up)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert ops.num_fallbacks == 0


def llama3_config(head_dim: int, num_heads: int, num_kv_heads: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=head_dim * num_heads, num_attention_heads=num_heads,
                       num_key_value_heads=num_kv_heads, max_position_embeddings=8192, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def check_rope_write_kv(launcher, dtype, head_dim: int, device="cpu", block_size: int = 8, seed: int = 2):
    """q rotated as the reference, rotated k and v in their slots, the padding token's slot
    (-1) leaves the pool untouched, with llama3-scaled tables and a strided qkv. Equal bits,
    except fp32 on a GPU, where nvcc may fuse a product and the sum into one FMA."""
    num_heads, num_kv_heads, num_blocks = 4, 2, 6
    g = torch.Generator().manual_seed(seed)
    cos, sin = rope_cos_sin(llama3_config(head_dim, num_heads, num_kv_heads), 8192, dtype)
    model = SimpleNamespace(rope_cos=cos.to(device), rope_sin=sin.to(device))
    attn = SimpleNamespace(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           q_size=num_heads * head_dim, kv_size=num_kv_heads * head_dim, kv_scales=(1.0, 1.0),
                           kv_rotation=None)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    positions = torch.tensor([0, 7, 4095, 8191, 300], dtype=torch.int64, device=device)
    slots = torch.tensor([3, 17, 40, -1, 9], dtype=torch.int64, device=device)
    n = len(positions)
    qkv = torch.randn(n, width + 16, generator=g).to(dtype).to(device)[:, :width]
    pool_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(pool_shape, 7.0, dtype=dtype, device=device) for _ in range(4)]
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.zeros(1, dtype=torch.int32),
                             seq_lens=torch.zeros(0, dtype=torch.int32),
                             block_tables=torch.zeros((0, 1), dtype=torch.int32), max_query_len=1, max_seq_len=1,
                             block_size=block_size, positions=positions)
    ops = KernelLayerOps(launcher)
    want_q = TORCH_LAYER_OPS.rope_write_kv(qkv, attn, TORCH_LAYER_OPS.rope_inputs(model, positions), caches[0],
                                           caches[1], meta, TorchAttentionBackend())
    got_q = ops.rope_write_kv(qkv, attn, ops.rope_inputs(model, positions), caches[2], caches[3], meta, None)
    assert ops.num_fallbacks == 0
    # the kernel rounds each product and the sum to T where the reference does: equal bits
    tol = TOLERANCE[dtype] if dtype == torch.float32 and device != "cpu" else 0
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(caches[2], caches[0], atol=tol, rtol=tol)
    torch.testing.assert_close(caches[3], caches[1], atol=0, rtol=0)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    untouched = caches[2].view(-1, num_kv_heads * head_dim)[~written.to(device)]
    assert bool((untouched == 7.0).all())
