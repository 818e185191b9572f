"""The FP8 KV cache (--kv-cache-dtype fp8) on the torch backend: the e4m3 round trip, pool sizing,
calibrated scales, paged decoding over an fp8 pool, and copy-on-write and swap of fp8 blocks."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend
from folio.core.kv.tensors.pool import KVPool, PoolShape
from folio.core.executor.kernels.kv_quant import (
    CALIBRATION_MARGIN,
    FP8_DTYPE,
    FP8_MAX,
    KVScales,
    cache_dtype,
    dequantize,
    kv_scales_from,
    quantize,
)
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.messages import StepPlan
from folio.shared.sampling import SamplingParams
from tests.executor.toy_driver import generate

PROMPTS = [[5, 9, 14, 2, 77, 3], list(range(10, 50)), [101], [7] * 19, [60, 61, 62, 63, 64, 65, 66, 67, 68]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def test_round_trip_is_within_e4m3_precision_and_saturates():
    gen = torch.Generator().manual_seed(0)
    scale = 0.05
    x = torch.randn(10000, generator=gen) * 4
    back = dequantize(quantize(x, scale), scale, torch.float32)
    # 3 mantissa bits: half an ulp is at most 2^-4 of the value (normals); subnormals (below
    # 2^-6 x scale) are multiples of 2^-9 x scale, so the error there is at most half of that
    bound = torch.maximum(x.abs() * 2.0**-4, torch.full_like(x, scale * 2.0**-10))
    assert ((back - x).abs() <= bound).all()
    assert (back - x).abs().max() > 0  # it is a quantization
    big = torch.tensor([1e4, -1e4, FP8_MAX * scale])
    assert dequantize(quantize(big, scale), scale, torch.float32).tolist() == pytest.approx(
        [FP8_MAX * scale, -FP8_MAX * scale, FP8_MAX * scale])
    assert quantize(x, scale).dtype == FP8_DTYPE and quantize(x, scale).element_size() == 1
    assert dequantize(quantize(x, scale), scale, torch.bfloat16).dtype == torch.bfloat16


def test_cache_dtype_choices():
    assert cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert cache_dtype("fp8", torch.float32) == FP8_DTYPE
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int4'"):
        cache_dtype("int4", torch.float32)


def test_an_fp8_pool_holds_twice_the_blocks_of_bf16_and_four_times_fp32(tiny_model_dir):
    shapes = {dt: PoolShape(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=dt)
              for dt in (torch.float32, torch.bfloat16, FP8_DTYPE)}
    assert shapes[torch.bfloat16].bytes_per_block == 2 * shapes[FP8_DTYPE].bytes_per_block
    assert shapes[torch.float32].bytes_per_block == 4 * shapes[FP8_DTYPE].bytes_per_block
    budget = 1 << 20
    runners = {(dt, kv): ModelRunner(RuntimeConfig(kv_cache_bytes=budget, dtype=dt, kv_cache_dtype=kv), tiny_model_dir)
               for dt, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"))}
    blocks = {key: r.pool.num_blocks for key, r in runners.items()}
    assert blocks[("float32", "fp8")] == 4 * blocks[("float32", "auto")] == 2 * blocks[("bfloat16", "auto")]
    fp8 = runners[("float32", "fp8")]
    assert fp8.pool.kv_caches[0][0].dtype == FP8_DTYPE and fp8.pool.num_bytes <= budget
    stats = fp8.stats()
    assert stats["kv_cache_dtype"] == "float8_e4m3fn" and stats["bytes_per_block"] * stats["num_blocks"] <= budget


def test_scales_are_calibrated_per_channel_from_the_calibration_pass(tiny_model_dir):
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=64, kv_cache_dtype="fp8"), tiny_model_dir)
    scales = runner.kv_scales
    heads, head_dim = runner.model.layers[0].self_attn.num_kv_heads, runner.spec.head_dim
    assert len(scales) == runner.spec.num_layers
    for s, layer in zip(scales, runner.model.layers):
        assert layer.self_attn.kv_scales is s and isinstance(s, KVScales)
        assert all(t.shape == (heads, head_dim) and t.dtype == torch.float32 for t in s)
        assert (s.k > 0).all() and (s.v > 0).all() and (s.k != 1.0).all()
        assert len(set(s.k.flatten().tolist())) > heads  # K: a scale per head and channel
        assert len(set(s.v.flatten().tolist())) == 1  # V: one for the layer
        assert s.k_shift.abs().max() > 0  # K's calibrated mean
    assert runner.stats()["kv_scales"] == [s.summary() for s in scales]
    # another text through an fp32 pool in the same rotated basis (kv_quant.rotation): the shifted
    # K and the V, divided by their scales, use the range up to 448 / margin (near, not equal:
    # another text than the calibration's), and saturate only rarely
    rotation = runner.model.layers[0].self_attn.kv_rotation
    assert rotation is not None and all(layer.self_attn.kv_rotation is rotation for layer in runner.model.layers)
    plain = ModelRunner(RuntimeConfig(num_kv_blocks=64), tiny_model_dir)
    for layer in plain.model.layers:
        layer.self_attn.kv_rotation = rotation
    ids = list(range(runner.spec.vocab_size))
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(8))], None, 16)
    with torch.inference_mode():
        plain.model(torch.tensor(ids), meta.positions, plain.pool.kv_caches, meta, plain.backend)
    for (k, v), s in zip(plain.pool.kv_caches, scales):
        for stored in ((k[:len(ids) // 16] - s.k_shift) / s.k, v[:len(ids) // 16] / s.v):
            peak = stored.abs().amax()
            assert FP8_MAX / CALIBRATION_MARGIN / 4 < peak, peak
            assert (stored.abs() > FP8_MAX).float().mean() < 1e-3


def test_the_k_shift_leaves_attention_unchanged_and_shrinks_its_error():
    """Keys that share a large mean (as trained models' do): stored less their calibrated mean,
    attention over the fp8 pool is as over the exact keys up to e4m3's error on the keys'
    differences, not on their common part (the shift moves every score of a query by q . shift,
    which the softmax does not see); without the shift the error is several times larger."""
    gen = torch.Generator().manual_seed(0)
    heads, head_dim, n, num_heads = 2, 64, 48, 4
    mean = torch.randn(heads, head_dim, generator=gen) * 6
    keys = torch.randn(n, heads, head_dim, generator=gen) + mean
    values = torch.randn(n, heads, head_dim, generator=gen)
    query = torch.randn(n, num_heads, head_dim, generator=gen)
    meta = AttentionMetadata.build([n], [n], [[0, 1, 2]], None, 16)
    backend = TorchAttentionBackend()

    def attend(kv_dtype, kv_scales):
        k_cache, v_cache = (torch.zeros(3, 16, heads, head_dim, dtype=kv_dtype) for _ in range(2))
        backend.write_kv(keys, values, k_cache, v_cache, meta, kv_scales)
        meta.plan = None
        return backend.attend(query, k_cache, v_cache, meta, head_dim**-0.5, kv_scales)

    exact = attend(torch.float32, (1.0, 1.0))
    shifted = kv_scales_from(keys, values)
    assert torch.allclose(shifted.k_shift, keys.mean(0))
    unshifted = kv_scales_from(keys, values, shift=False)
    assert unshifted.k_shift.abs().max() == 0
    err_shifted = (attend(FP8_DTYPE, shifted) - exact).abs().mean()
    err_plain = (attend(FP8_DTYPE, unshifted) - exact).abs().mean()
    assert err_shifted < 0.4 * err_plain, (err_shifted, err_plain)
    assert err_shifted < 0.02


def test_paged_decoding_over_an_fp8_pool_does_not_depend_on_batching_chunks_or_blocks(tiny_model_dir):
    """The same greedy tokens alone, batched, chunked, over shuffled blocks: the pool's paging is
    right whatever the element type."""
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=64, kv_cache_dtype="fp8"), tiny_model_dir)
    alone = [generate(runner, [p], GREEDY)[0] for p in PROMPTS]
    order = list(range(runner.pool.num_blocks))
    random.Random(1).shuffle(order)
    assert generate(runner, PROMPTS, GREEDY, chunk_size=7, block_order=order) == alone


def test_fp8_logits_stay_close_to_fp32_on_a_tiny_model(tiny_model_dir):
    """Teacher-forced next-token distributions over fp8 and fp32 pools. The random tiny model is
    far more sensitive than a trained one (measured: KLD 1.1e-2 against 3.3e-5 for a bf16 pool),
    so this bounds gross errors only; folio/bench/eval_quant.py holds the real target on SmolLM2."""
    fp32 = ModelRunner(RuntimeConfig(num_kv_blocks=64), tiny_model_dir)
    fp8 = ModelRunner(RuntimeConfig(num_kv_blocks=64, kv_cache_dtype="fp8"), tiny_model_dir)
    seq = PROMPTS[1] + PROMPTS[3]
    meta = AttentionMetadata.build([len(seq)], [len(seq)], [list(range(4))], None, 16)
    out = []
    with torch.inference_mode():
        for r in (fp32, fp8):
            hidden = r.model(torch.tensor(seq), meta.positions, r.pool.kv_caches, meta, r.backend)
            out.append(r.model.compute_logits(hidden).log_softmax(-1))
            meta.plan = None
    ref, got = out
    kld = (ref.exp() * (ref - got)).sum(-1).mean().item()
    assert 0 < kld < 0.05
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean() >= 0.7


def test_copy_on_write_and_swap_move_fp8_blocks_intact():
    shape = PoolShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=FP8_DTYPE)
    pool = KVPool(shape, 8, torch.device("cpu"), num_host_blocks=4)
    assert pool.num_bytes == 8 * 2 * 2 * 4 * 2 * 8 and pool.host_caches[0][0].dtype == FP8_DTYPE
    gen = torch.Generator().manual_seed(0)
    for k, v in pool.kv_caches:
        k.view(torch.uint8).copy_(quantize(torch.randn(k.shape, generator=gen), 0.01).view(torch.uint8))
        v.view(torch.uint8).copy_(quantize(torch.randn(v.shape, generator=gen), 0.01).view(torch.uint8))

    def block(caches, b):
        return [torch.stack([k[b].view(torch.uint8), v[b].view(torch.uint8)]) for k, v in caches]

    leaving, cow_src = block(pool.kv_caches, 2), block(pool.kv_caches, 4)
    runner = SimpleNamespace(pool=pool, backend=TorchAttentionBackend())
    ModelRunner._copy_blocks(runner, StepPlan(step_id=0, swap_out=[(2, 0)], block_copies=[(4, 5)]))
    assert all(torch.equal(a, b) for a, b in zip(block(pool.host_caches, 0), leaving))
    assert all(torch.equal(a, b) for a, b in zip(block(pool.kv_caches, 5), cow_src))
    ModelRunner._copy_blocks(runner, StepPlan(step_id=1, swap_in=[(0, 7)]))
    assert all(torch.equal(a, b) for a, b in zip(block(pool.kv_caches, 7), leaving))
