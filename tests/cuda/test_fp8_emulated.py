"""The fp8 (e4m3) KV pool on the kernel side, under the CPU emulation: the conversions of
cuda/common.cuh bit for bit against torch's float8_e4m3fn; write_kv, the decode kernel and the
CUDA-core chunk kernel over fp8 pools against the torch backend on the same pools, with one scale
per layer and with a layer's calibrated KVScales (K and V scales per head and channel, K's shift);
and the fused RoPE + KV write (cuda/fused_ops.cu) into an fp8 pool, rotation included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from types import SimpleNamespace

from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend
from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend, make_host_pool
from folio.core.executor.kernels.layer_ops import TORCH_LAYER_OPS, KernelLayerOps
from folio.core.executor.model.layers import rope_cos_sin
from folio.core.executor.kernels.kv_quant import FP8_DTYPE, FP8_MAX, KVScales, kv_scales_from, quantize, rotation
from tests.cuda.emu_runtime import run_probe
from tests.cuda.fused_cases import llama3_config
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


def _layer_scales(num_kv_heads: int, head_dim: int, seed: int, spread: float = 4.0) -> KVScales:
    """A layer's calibrated scales from made-up calibration K/V whose channels differ in size and
    mean (what kv_scales_from sees in a trained model)."""
    gen = torch.Generator().manual_seed(seed)
    size = torch.exp(torch.randn(num_kv_heads, head_dim, generator=gen))
    k = torch.randn(64, num_kv_heads, head_dim, generator=gen) * size + spread * torch.randn(num_kv_heads, head_dim,
                                                                                              generator=gen)
    return kv_scales_from(k, torch.randn(64, num_kv_heads, head_dim, generator=gen))


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_write_kv_with_per_channel_scales_and_a_k_shift_equals_the_torch_backend(emu_launcher, dtype):
    step = make_fp8_step([3, 1, 4], [3, 10, 12], dtype, block_size=8)
    scales = _layer_scales(2, 64, seed=3)
    assert len(set(scales.k.flatten().tolist())) > 1 and scales.k_shift.abs().min() > 0
    gen = torch.Generator().manual_seed(1)
    key = (torch.randn(8, 2, 64, generator=gen) * scales.k * 100 + scales.k_shift).to(dtype)
    value = (torch.randn(8, 2, 64, generator=gen) * 3).to(dtype)
    k_ref, v_ref = step.k_cache.clone(), step.v_cache.clone()
    TorchAttentionBackend().write_kv(key, value, k_ref, v_ref, fresh_meta(step), scales)
    k_out, v_out = step.k_cache.clone(), step.v_cache.clone()
    _backend(emu_launcher, dtype).write_kv(key, value, k_out, v_out, fresh_meta(step), scales)
    assert torch.equal(k_out.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_out.view(torch.uint8), v_ref.view(torch.uint8))
    # the shift was taken off: without it the same keys store other bytes
    unshifted = step.k_cache.clone()
    TorchAttentionBackend().write_kv(key, value, unshifted, step.v_cache.clone(), fresh_meta(step),
                                     KVScales(scales.k, scales.v, torch.zeros_like(scales.k_shift)))
    assert not torch.equal(unshifted.view(torch.uint8), k_ref.view(torch.uint8))


# (id, dtype, head_dim, block_size, num_heads, num_kv_heads, query_lens, seq_lens, split)
FP8_CASES = [
    ("decode-bf16-h64-gqa2", BF16, 64, 16, 4, 2, [1, 1, 1], [1, 37, 90], False),
    ("decode-f16-h128-split", F16, 128, 32, 8, 2, [1, 1], [70, 130], True),
    ("decode-bf16-h96-b8", BF16, 96, 8, 2, 2, [1, 1], [20, 41], None),
    ("mixed-chunks-f16-h64-split", F16, 64, 8, 8, 2, [1, 7, 1, 20], [33, 7, 9, 45], True),
    ("chunk-bf16-h128-gqa4", BF16, 128, 16, 8, 2, [18], [40], False),
]


@pytest.mark.parametrize("per_channel", [False, True], ids=["layer-scales", "channel-scales"])
@pytest.mark.parametrize("case", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_attend_over_an_fp8_pool_matches_the_torch_backend(emu_launcher, case, per_channel):
    _, dtype, head_dim, block_size, num_heads, num_kv_heads, query_lens, seq_lens, split = case
    step = make_fp8_step(query_lens, seq_lens, dtype, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, block_size=block_size, seed=head_dim + block_size)
    scale, kv_scales = head_dim**-0.5, FP8_KV_SCALES
    if per_channel:  # a calibrated layer's: scales per head and channel, around FP8_KV_SCALES' size
        s = _layer_scales(num_kv_heads, head_dim, seed=head_dim)
        kv_scales = KVScales(s.k / s.k.mean() * FP8_KV_SCALES[0], s.v * torch.exp(
            torch.randn(s.v.shape, generator=torch.Generator().manual_seed(5))) / s.v.mean() * FP8_KV_SCALES[1],
            s.k_shift)
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


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("head_dim", [64, 96])
def test_fused_rope_write_kv_into_an_fp8_pool_matches_the_reference(emu_launcher, dtype, head_dim):
    """The fused kernel's fp8 instance: RoPE, the layer's rotation (Hadamard at 64, a random
    orthogonal one at 96), the K shift and per-channel scales, against the torch path
    (apply_rope, x @ rotation, write_kv). The rotation's sums run in another order than torch's
    matmul: q within a rounding step of T, each stored e4m3 value equal or one step apart."""
    num_heads, num_kv_heads, num_blocks, block_size = 4, 2, 6, 8
    g = torch.Generator().manual_seed(head_dim)
    cos, sin = rope_cos_sin(llama3_config(head_dim, num_heads, num_kv_heads), 8192, dtype)
    model = SimpleNamespace(rope_cos=cos, rope_sin=sin)
    scales = _layer_scales(num_kv_heads, head_dim, seed=head_dim, spread=1.0)
    attn = SimpleNamespace(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           q_size=num_heads * head_dim, kv_size=num_kv_heads * head_dim, kv_scales=scales,
                           kv_rotation=rotation(head_dim, dtype))
    width = (num_heads + 2 * num_kv_heads) * head_dim
    positions = torch.tensor([0, 7, 4095, 8191, 300], dtype=torch.int64)
    slots = torch.tensor([3, 17, 40, -1, 9], dtype=torch.int64)
    qkv = (torch.randn(len(positions), width + 16, generator=g) * 2).to(dtype)[:, :width]
    pool_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [quantize(torch.full(pool_shape, 7.0), 1.0) for _ in range(4)]
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.zeros(1, dtype=torch.int32),
                             seq_lens=torch.zeros(0, dtype=torch.int32),
                             block_tables=torch.zeros((0, 1), dtype=torch.int32), max_query_len=1, max_seq_len=1,
                             block_size=block_size, positions=positions)
    ops = KernelLayerOps(emu_launcher)
    want_q = TORCH_LAYER_OPS.rope_write_kv(qkv, attn, TORCH_LAYER_OPS.rope_inputs(model, positions), caches[0],
                                           caches[1], meta, TorchAttentionBackend())
    got_q = ops.rope_write_kv(qkv, attn, ops.rope_inputs(model, positions), caches[2], caches[3], meta, None)
    assert ops.num_fallbacks == 0
    assert [n for n, _, _ in emu_launcher.launches] == [
        f"folio::rope_write_kv<folio::{'f16' if dtype == F16 else 'bf16'}, folio::fp8e4m3>"]
    tol = 2e-3 if dtype == F16 else 1.6e-2
    torch.testing.assert_close(got_q.float(), want_q.float(), atol=tol, rtol=tol)
    for got, want in ((caches[2], caches[0]), (caches[3], caches[1])):
        a, b = got.float(), want.float()  # the stored e4m3 values: equal, or neighbours (1/8 apart at most)
        assert bool(((a - b).abs() <= 0.125 * torch.maximum(a.abs(), b.abs()) + 2.0**-9).all())
        assert (got.view(torch.uint8) == want.view(torch.uint8)).float().mean() > 0.9
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for cache in caches[2:]:  # the padding token's slot and the others untouched
        rows = cache.float().view(-1, num_kv_heads * head_dim)
        assert bool((rows[~written] == 7.0).all()) and not bool((rows[written] == 7.0).all(-1).any())


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
