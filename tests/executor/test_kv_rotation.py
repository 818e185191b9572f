"""The fp8 pool's rotated basis (kv_quant.rotation): orthogonal, invisible to the model's math over
an exact pool, and smaller score errors over an e4m3 one when keys carry outlier channels."""

from __future__ import annotations

import pytest
import torch

from folio.core.executor.kernels.attention import AttentionMetadata
from folio.core.executor.kernels.kv_quant import dequantize, quantize, rotation, scale_for
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig


@pytest.mark.parametrize("head_dim", [64, 128, 80, 96])
def test_rotation_is_orthogonal_and_spreads_a_channel(head_dim):
    r = rotation(head_dim)
    assert r.shape == (head_dim, head_dim)
    assert torch.allclose(r @ r.T, torch.eye(head_dim), atol=1e-6)
    one_channel = torch.zeros(head_dim)
    one_channel[head_dim - 1] = 1.0
    spread = (one_channel @ r).abs()
    if head_dim & (head_dim - 1) == 0:  # Hadamard: every channel gets exactly 1 / sqrt(head_dim)
        assert torch.allclose(spread, torch.full_like(spread, head_dim**-0.5), atol=1e-6)
    else:
        assert spread.max() < 0.5
    assert torch.equal(rotation(head_dim), r)  # the same basis every start (pools outlive nothing else)


def test_a_rotated_basis_leaves_logits_unchanged_over_an_exact_pool(tiny_model_dir):
    """q, k and v rotated before the write and the output rotated back: the fp32 model's logits
    stay what they were (a missing or one-sided rotation changes them by far more)."""
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=64), tiny_model_dir)
    seq = list(range(3, 40))
    meta = AttentionMetadata.build([len(seq)], [len(seq)], [list(range(3))], None, 16)
    logits, keys = [], []
    with torch.inference_mode():
        for r in (None, rotation(runner.spec.head_dim)):
            for layer in runner.model.layers:
                layer.self_attn.kv_rotation = r
            hidden = runner.model(torch.tensor(seq), meta.positions, runner.pool.kv_caches, meta, runner.backend)
            logits.append(runner.model.compute_logits(hidden))
            keys.append(runner.pool.kv_caches[0][0].clone())
            meta.plan = None
    plain, rotated = logits
    assert torch.allclose(plain, rotated, atol=1e-4, rtol=1e-4)
    # the pool did hold other numbers: the keys in the rotated basis
    assert (keys[0] - keys[1]).abs().max() > 1e-2
    assert torch.allclose(keys[0] @ rotation(runner.spec.head_dim), keys[1], atol=1e-5)


def test_rotation_shrinks_e4m3_score_errors_of_keys_with_outlier_channels():
    """Queries and keys that share large channels (as RoPE's slow pairs do in trained models): the
    rotated e4m3 keys give q.k with less than half the error of the plain ones."""
    gen = torch.Generator().manual_seed(0)
    head_dim, n = 64, 512
    boost = torch.ones(head_dim)
    boost[-4:] = 25.0
    q, k = torch.randn(n, head_dim, generator=gen) * boost, torch.randn(n, head_dim, generator=gen) * boost
    r = rotation(head_dim)
    exact = q @ k.T

    def err(keys: torch.Tensor, queries: torch.Tensor) -> float:
        scale = scale_for(keys.abs().max().item())
        back = dequantize(quantize(keys, scale), scale, torch.float32)
        return ((queries @ back.T) - exact).abs().mean().item()

    plain, rotated = err(k, q), err(k @ r, q @ r)
    assert rotated < 0.5 * plain, (plain, rotated)
