"""Sliding windows and logit soft-caps in the torch reference backend (and the CPU kernel backend,
over the same steps), against a dense float64 oracle written here: decode rows, short chunks
(verification), long chunks after a cached prefix, windows ending mid-block, longer than the
sequence and of one token, GQA, an fp8 pool, and blocks wholly before the window that hold
poison (the scheduler may free them and point their table entries anywhere)."""

from __future__ import annotations

import platform
import random

import pytest
import torch

from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend
from folio.core.executor.kernels.kv_quant import FP8_DTYPE, quantize

BS = 8
# (cached tokens, new tokens) per sequence: decodes at several lengths (partial last blocks), a
# verification chunk (4 rows), a prompt in one chunk and a chunk after a cached prefix
SPECS = [(0, 1), (37, 1), (100, 1), (8, 1), (21, 4), (0, 29), (45, 20)]
WINDOWS = [1, 5, 8, 13, 1000]  # 5 and 13 end mid-block; 1000 is longer than every sequence


def oracle(q, k, v, scale, window, softcap):
    """One sequence's queries (its last ``len(q)`` positions) over its dense keys, in float64: the
    scores scaled, capped, masked (causal and the window), softmax, times v."""
    n, seq_len, heads, kv_heads = q.shape[0], k.shape[0], q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    q_pos = torch.arange(seq_len - n, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    allowed = k_pos <= q_pos
    if window > 0:
        allowed &= k_pos > q_pos - window
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def make_step(specs, heads, kv_heads, dim, seed, fp8=False):
    """A shuffled pool with each sequence's cached context in it, the step's metadata, its queries
    and each sequence's dense K/V (as the pool returns them: fp8 values dequantized)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum((c + n + BS - 1) // BS for c, n in specs) + 2
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    poison = ids.pop()  # a block no sequence uses (see poison_before_windows)
    dtype = FP8_DTYPE if fp8 else torch.float32
    k_cache = torch.zeros(num_blocks, BS, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros(num_blocks, BS, kv_heads, dim, dtype=dtype)
    scales = (0.02, 0.03) if fp8 else (1.0, 1.0)
    tables, dense = [], []
    for cached, new in specs:
        total = cached + new
        table = [ids.pop() for _ in range((total + BS - 1) // BS)]
        k = torch.randn(total, kv_heads, dim, generator=gen)
        v = torch.randn(total, kv_heads, dim, generator=gen)
        if fp8:  # what the pool holds, dequantized
            k, v = quantize(k, scales[0]).float() * scales[0], quantize(v, scales[1]).float() * scales[1]
        for p in range(total):  # the whole context: the new tokens' K/V are written as write_kv would
            blk, off = table[p // BS], p % BS
            k_cache[blk, off] = quantize(k[p], scales[0]) if fp8 else k[p]
            v_cache[blk, off] = quantize(v[p], scales[1]) if fp8 else v[p]
        tables.append(table)
        dense.append((k, v))
    meta = AttentionMetadata.build([n for _, n in specs], [c + n for c, n in specs], tables, None, BS)
    q = torch.randn(sum(n for _, n in specs), heads, dim, generator=gen) * 3  # scores the caps bite on
    return k_cache, v_cache, meta, q, dense, scales, poison


def poison_before_windows(specs, meta, k_cache, v_cache, poison, window):
    """Point every table entry wholly before the step's windows at a block of NaN keys and inf
    values; returns how many entries were redirected."""
    if k_cache.dtype == FP8_DTYPE:
        k_cache.view(torch.uint8)[poison] = 0x7F  # e4m3's NaN
        v_cache.view(torch.uint8)[poison] = 0x7F
    else:
        k_cache[poison], v_cache[poison] = float("nan"), float("inf")
    redirected = 0
    for b, (cached, _) in enumerate(specs):
        first_key = max(0, cached - window + 1)  # the step's first query sees no key before this
        for j in range(first_key // BS):
            meta.block_tables[b, j] = poison
            redirected += 1
    return redirected


def expected(specs, q, dense, scale, window, softcap):
    outs, at = [], 0
    for (cached, new), (k, v) in zip(specs, dense):
        outs.append(oracle(q[at:at + new], k, v, scale, window, softcap))
        at += new
    return torch.cat(outs).float()


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("softcap", [0.0, 1.5])
@pytest.mark.parametrize("window", WINDOWS)
def test_windows_and_caps_match_the_dense_oracle(heads, kv_heads, softcap, window):
    dim = 16
    k_cache, v_cache, meta, q, dense, scales, _ = make_step(SPECS, heads, kv_heads, dim, seed=window + heads)
    out = TorchAttentionBackend().attend(q, k_cache, v_cache, meta, dim**-0.5, window=window, softcap=softcap)
    torch.testing.assert_close(out, expected(SPECS, q, dense, dim**-0.5, window, softcap), rtol=1e-5, atol=1e-5)


def test_the_features_change_the_result_and_a_window_past_the_sequence_changes_nothing():
    dim = 16
    k_cache, v_cache, meta, q, dense, scales, _ = make_step(SPECS, 6, 2, dim, seed=3)
    backend = TorchAttentionBackend()
    plain = backend.attend(q, k_cache, v_cache, meta, dim**-0.5)
    # the same plan serves every layer: windows and caps in any order, each as if alone
    windowed = backend.attend(q, k_cache, v_cache, meta, dim**-0.5, window=5)
    capped = backend.attend(q, k_cache, v_cache, meta, dim**-0.5, softcap=1.5)
    assert torch.equal(backend.attend(q, k_cache, v_cache, meta, dim**-0.5), plain)
    long = backend.attend(q, k_cache, v_cache, meta, dim**-0.5, window=1000)
    assert torch.equal(long, plain)  # the same blocks and mask values: SDPA's bits
    meta.plan = None
    assert torch.equal(backend.attend(q, k_cache, v_cache, meta, dim**-0.5, window=5), windowed)
    # decode rows past the window, and the chunks, differ when windowed or capped
    for got in (windowed, capped):
        assert (got - plain).abs().amax() > 1e-2
    # a window of one: each token reads its own value
    ones = backend.attend(q, k_cache, v_cache, meta, dim**-0.5, window=1, softcap=1.5)
    at, own = 0, []
    for (cached, new), (_, v) in zip(SPECS, dense):
        own.append(v[cached:cached + new].repeat_interleave(3, dim=1))
        at += new
    torch.testing.assert_close(ones, torch.cat(own), rtol=0, atol=0)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 1.5])
@pytest.mark.parametrize("window", [5, 13])
def test_blocks_wholly_before_the_window_are_never_read(fp8, softcap, window):
    dim = 16
    k_cache, v_cache, meta, q, dense, scales, poison = make_step(SPECS, 6, 2, dim, seed=window, fp8=fp8)
    assert poison_before_windows(SPECS, meta, k_cache, v_cache, poison, window) >= 8
    out = TorchAttentionBackend().attend(q, k_cache, v_cache, meta, dim**-0.5, scales, window=window, softcap=softcap)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected(SPECS, q, dense, dim**-0.5, window, softcap), rtol=1e-5, atol=1e-5)


def test_an_fp8_pool_with_window_and_cap_through_write_kv():
    """The step's new K/V go through write_kv's quantization; the rest as in the plain fp8 path."""
    dim, specs = 16, [(30, 1), (11, 3), (20, 18)]
    k_cache, v_cache, meta, q, dense, scales, _ = make_step(specs, 4, 2, dim, seed=11, fp8=True)
    new_k = torch.cat([k[c:] for (c, _), (k, _) in zip(specs, dense)])
    new_v = torch.cat([v[c:] for (c, _), (_, v) in zip(specs, dense)])
    backend = TorchAttentionBackend()
    backend.write_kv(new_k, new_v, k_cache, v_cache, meta, scales)  # the exact fp8 values: rewritten as they were
    out = backend.attend(q, k_cache, v_cache, meta, dim**-0.5, scales, window=7, softcap=2.0)
    torch.testing.assert_close(out, expected(specs, q, dense, dim**-0.5, 7, 2.0), rtol=1e-5, atol=1e-5)


def test_bf16_queries_with_a_cap_stay_close():
    dim = 16
    k_cache, v_cache, meta, q, dense, scales, _ = make_step(SPECS, 4, 2, dim, seed=5)
    out = TorchAttentionBackend().attend(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), meta, dim**-0.5,
                                         window=13, softcap=1.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected(SPECS, q, dense, dim**-0.5, 13, 1.5), rtol=3e-2, atol=3e-2)


def test_negative_parameters_are_refused():
    k_cache, v_cache, meta, q, _, _, _ = make_step([(3, 1)], 2, 2, 8, seed=0)
    with pytest.raises(ValueError):
        TorchAttentionBackend().attend(q, k_cache, v_cache, meta, 0.3, window=-1)


MARCHES = ["native"] + (["x86-64-v3"] if platform.machine() in ("x86_64", "AMD64") else [])


@pytest.fixture(scope="module", params=MARCHES)
def cpu_backend(request):
    """The kernel backend over this machine's build, and over an AVX2-only one (x86-64-v3: no
    AVX-512, whatever this CPU has)."""
    from folio.core.executor.kernels import cpu_kernels
    from folio.core.executor.kernels.cpu_backend import CpuKernelBackend

    if request.param == "native":
        lib = cpu_kernels.library()
    else:
        try:
            lib = cpu_kernels.library_for(request.param)
        except (OSError, RuntimeError) as exc:
            pytest.skip(f"no {request.param} build here: {exc}")
    if lib is None:
        pytest.skip("no C compiler here")
    return CpuKernelBackend(lib, torch.float32, final_norm=None)


@pytest.mark.parametrize("act", ["gelu_tanh_and_mul", "silu_and_mul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_activations_match_the_reference(cpu_backend, act, dtype):
    from folio.core.executor.kernels.layer_ops import TORCH_LAYER_OPS

    gate_up = (torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    gate_up[0, :10] = torch.tensor([-90.0, -20.0, -5.0, -1e-3, 0.0, 1e-3, 2.0, 5.0, 20.0, 90.0])
    ops = cpu_backend.layer_ops
    ops.num_fallbacks = 0
    for out_dtype in (torch.float32, torch.bfloat16):
        ops.act_dtype = out_dtype
        got = getattr(ops, act)(gate_up)
        want = getattr(TORCH_LAYER_OPS, act)(gate_up.float())
        assert got.dtype == out_dtype
        if out_dtype == torch.bfloat16:  # one bf16 rounding step
            torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-5)
        else:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-5)  # tanh -> -1: 0 there
        assert torch.equal(getattr(ops, act)(gate_up[4:5]), got[4:5])  # a row alone, as in the batch
    ops.act_dtype = torch.float32
    assert ops.num_fallbacks == 0
    getattr(ops, act)(gate_up[:, ::2])  # not whole rows: the reference, counted
    assert ops.num_fallbacks == 1


def test_the_other_layer_kernels_hold_on_every_build(cpu_backend):
    """Residual add + RMSNorm and the exp under the sampler, on each build."""
    from types import SimpleNamespace

    import numpy as np

    from folio.core.executor.kernels.layer_ops import TORCH_LAYER_OPS

    x, residual = torch.randn(5, 576), torch.randn(5, 576) * 3
    norm = SimpleNamespace(weight=1 + 0.1 * torch.randn(576), eps=1e-5)
    want_res, want = TORCH_LAYER_OPS.add_rms_norm(x, residual.clone(), norm)
    res, got = cpu_backend.layer_ops.add_rms_norm(x, residual.clone(), norm)
    assert torch.equal(res, want_res)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    xs = np.linspace(-87.0, 0.0, 10001, dtype=np.float32)
    out = np.empty_like(xs)
    cpu_backend.lib.folio_exp_nonpositive(xs.size, xs.ctypes.data, out.ctypes.data)
    np.testing.assert_allclose(out, np.exp(xs.astype(np.float64)), rtol=3e-7, atol=0)


@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 64), (4, 4, 16)])
@pytest.mark.parametrize("window,softcap", [(0, 1.5), (1, 0.0), (5, 0.0), (13, 1.5), (1000, 1.5)])
def test_the_c_kernels_match_the_reference_and_read_nothing_before_the_window(cpu_backend, heads, kv_heads, dim,
                                                                              window, softcap):
    scale = dim**-0.5
    k_cache, v_cache, meta, q, dense, _, poison = make_step(SPECS, heads, kv_heads, dim, seed=window + dim)
    want = TorchAttentionBackend().attend(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
    meta.plan = None
    if window:
        poison_before_windows(SPECS, meta, k_cache, v_cache, poison, window)
    got = cpu_backend.attend(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, expected(SPECS, q, dense, scale, window, softcap), rtol=1e-5, atol=1e-5)
