"""Sliding windows and logit soft-caps in the attention kernels (decode, tensor-core prefill,
CUDA-core chunk kernel, their split paths, fp8 pools) and the fused GeGLU kernel, on the CPU
emulation against a dense fp32 oracle (and the torch backend's reference when it takes windows).
Windows end mid-block, are 1 token or longer than the context; K/V before every window are
NaN in the pool the kernels read, so a kernel that loaded one into its math would fail."""

from __future__ import annotations

import math
import random

import pytest
import torch

from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend
from folio.core.executor.kernels.layer_ops import KernelLayerOps
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.sampling import SamplingParams
from folio.testing.models import write_tiny_model
from tests.cuda.kv_cases import FP8_KV_SCALES, fresh_meta, make_fp8_step, make_step
from tests.cuda.window_cases import check, check_gelu_tanh_and_mul, run_attend
from tests.executor.toy_driver import generate

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _run(launcher, step, **kwargs):
    return run_attend(lambda dtype, **kw: KernelAttentionBackend(launcher, dtype, **kw), step, **kwargs)


def _kernels(launcher):
    return {name.split("<")[0].removeprefix("folio::") for name, _, _ in launcher.launches}


# ---------------------------------------------------------------- decode (cp.async kernel)
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
def test_decode_windows_end_mid_block(emu_launcher, dtype, split):
    """Windows of 1, 13 (ends mid-block), 16 (a whole block) and 500 (longer than every context),
    over contexts of 1 to 130 keys; split: 8-key splits of the window, the short sequences' later
    splits empty (lse -inf in the merge)."""
    step = make_step([1, 1, 1, 1], [1, 21, 77, 130], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype=dtype, seed=3)
    for window in (1, 13, 16, 500):
        emu_launcher.launches.clear()
        out, scale = _run(emu_launcher, step, window=window, split=split, partition_size=8)
        check(out, step, scale, window, 0.0)
        # a window of 8 keys or fewer is one split: no merge
        assert _kernels(emu_launcher) == {"paged_decode"} | ({"paged_attention_reduce"} if split and window > 8 else set())


def test_decode_split_count_follows_the_window(emu_launcher):
    """The automatic split choice sizes splits by the keys inside the window: a 70-key window over
    a 2,000-key context is planned as 70 keys (2 granules), not 2,000."""
    step = make_step([1], [2000], num_heads=8, num_kv_heads=1, head_dim=128, block_size=32, dtype=BF16, seed=4)
    backend = KernelAttentionBackend(emu_launcher, BF16)
    meta = fresh_meta(step)
    full, windowed = backend.plan(meta, 8, 1), backend.plan(meta, 8, 1, window=70)
    assert full.decode.num_splits * full.decode.split_size >= 2000
    assert windowed.decode.num_splits * windowed.decode.split_size < 2 * 64 + 1
    assert windowed.decode.items is full.decode.items  # the same item tensor: no new device copy
    out, scale = _run(emu_launcher, step, window=70)
    check(out, step, scale, 70, 0.0)
    grid = [g for name, g, _ in emu_launcher.launches if "paged_decode" in name][0]
    assert grid[0] == windowed.decode.num_splits


@pytest.mark.parametrize("group", [1, 4, 7, 16])
def test_decode_window_gqa(emu_launcher, group):
    step = make_step([1, 1], [70, 9], num_heads=2 * group, num_kv_heads=2, head_dim=128, block_size=8,
                     dtype=BF16, seed=group)
    out, scale = _run(emu_launcher, step, window=27, softcap=5.0, split=True, partition_size=16)
    check(out, step, scale, 27, 5.0)


# ---------------------------------------------------------------- chunks (tensor-core and CUDA-core)
CHUNK_CASES = [
    # (query_lens, seq_lens): a prefill from 0, a prefix-cached continuation chunk, short
    # verification chunks (spec decode: 3-5 tokens), a mixed step with decode rows
    ([40], [40]),
    ([24, 30], [90, 30]),
    ([3, 5, 4], [61, 100, 33]),
    ([1, 17, 1, 6], [50, 80, 9, 6]),
]


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("case", range(len(CHUNK_CASES)))
def test_chunk_windows(emu_launcher, dtype, case):
    q_lens, s_lens = CHUNK_CASES[case]
    step = make_step(q_lens, s_lens, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
                     seed=10 + case)
    for window, split in ((1, False), (19, False), (19, True), (1000, True)):
        emu_launcher.launches.clear()
        out, scale = _run(emu_launcher, step, window=window, split=split, partition_size=16)
        check(out, step, scale, window, 0.0)
        chunk_kernel = "paged_attention" if dtype == F32 else "paged_prefill"
        assert chunk_kernel in _kernels(emu_launcher)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_chunk_window_large_group_and_heads(emu_launcher, dtype):
    """GQA 8 (a chunk CTA covers 1-8 tokens x the group), head 128, blocks of 8, window mid-block."""
    step = make_step([12, 1], [75, 40], num_heads=8, num_kv_heads=1, head_dim=128, block_size=8, dtype=dtype,
                     seed=5)
    out, scale = _run(emu_launcher, step, window=21, softcap=30.0, split=True, partition_size=16)
    check(out, step, scale, 21, 30.0)


# ---------------------------------------------------------------- soft-caps
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_softcap_bites(emu_launcher, dtype):
    """Scores around +-40 (q scaled up) under a cap of 5: the cap changes the result (checked), and
    the kernels match the capped oracle, decode and chunks, with and without a window."""
    step = make_step([1, 9, 1], [33, 40, 70], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype=dtype, seed=7)
    step.query = (step.query.float() * 4.0).to(dtype)
    scale = 64**-0.5
    uncapped, _ = _run(emu_launcher, step, scale=scale)
    for window in (0, 11):
        out, _ = _run(emu_launcher, step, window=window, softcap=5.0, scale=scale, split=window > 0,
                      partition_size=16)
        check(out, step, scale, window, 5.0)
    assert (out.float() - uncapped.float()).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("softcap", [1e-3, 1e-30, 3e38], ids=["cap1e-3", "cap1e-30", "cap3e38"])
def test_softcap_fp32_edges(emu_launcher, dtype, softcap):
    """Tiny caps under large scores (score / cap overflows to inf: tanh 1, the score becomes the
    cap), a cap near the fp32 maximum (tanh(s / c) ~ s / c); scale 1e4 makes scores ~1e5."""
    step = make_step([1, 7], [40, 30], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
                     seed=8)
    out, scale = _run(emu_launcher, step, window=17, softcap=softcap, scale=1e4)
    # the oracle's division and the kernel's multiplication by the reciprocal may differ in the last
    # bit of a capped score; with scores ~1e5 and a huge cap that is ~1e-2 of a logit
    tol = 2e-2 if softcap > 1e30 else None
    check(out, step, scale, 17, softcap, tol=tol)


def test_softcap_infinite_scores(emu_launcher):
    """fp32 q.k overflowing to +-inf (every term of a dot product has the key's sign): the cap
    maps them to +-cap, as the oracle's inf / cap and tanh do, and nothing becomes NaN. Without a
    cap the same step is NaN or inf in the oracle too, so only the capped case is checked."""
    step = make_step([1, 5], [24, 20], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8, seed=9)
    gen = torch.Generator().manual_seed(9)
    step.query = torch.rand(step.query.shape, generator=gen) * 1e30 + 1e29
    sign = torch.where(torch.rand(step.k_cache.shape[:3] + (1,), generator=gen) < 0.5, -1.0, 1.0)
    step.k_cache = sign * (torch.rand(step.k_cache.shape, generator=gen) * 1e30 + 1e29)
    for split in (False, True):
        out, scale = _run(emu_launcher, step, window=9, softcap=50.0, scale=1.0, split=split, partition_size=8)
        check(out, step, scale, 9, 50.0)


# ---------------------------------------------------------------- fp8 pools
def test_fp8_pool_window_and_softcap(emu_launcher):
    """Over an e4m3 pool (decode kernel and the CUDA-core chunk kernel, the K scale folded into q):
    the cap applies to the dequantized score."""
    step = make_fp8_step([1, 13, 1], [45, 60, 9], BF16, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                         seed=12)
    for split in (False, True):
        emu_launcher.launches.clear()
        out, scale = _run(emu_launcher, step, window=14, softcap=3.0, split=split, partition_size=16,
                          kv_scales=FP8_KV_SCALES)
        check(out, step, scale, 14, 3.0, kv_scales=FP8_KV_SCALES)
        assert {"paged_decode", "paged_attention"} <= _kernels(emu_launcher)


def test_bad_window_or_softcap_is_refused(emu_launcher):
    step = make_step([1], [5], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8, seed=1)
    for window, softcap in ((-1, 0.0), (0, -1.0), (0, math.inf), (0, math.nan), (0, 1e-50)):
        with pytest.raises(ValueError):
            _run(emu_launcher, step, window=window, softcap=softcap)
    assert not emu_launcher.launches


# ---------------------------------------------------------------- GeGLU
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_gelu_tanh_and_mul(emu_launcher, dtype):
    check_gelu_tanh_and_mul(emu_launcher, dtype)
    assert [name for name, _, _ in emu_launcher.launches] == [f"folio::gelu_tanh_and_mul<{ck.DTYPES[str(dtype)[6:]]}>"]


def test_gelu_tanh_and_mul_falls_back_for_unfit_rows(emu_launcher):
    ops = KernelLayerOps(emu_launcher)
    x = torch.randn(2, 2 * 30)  # d = 30 fp32: 120 bytes, not whole 16-byte vectors
    want = torch.nn.functional.gelu(x[:, :30], approximate="tanh") * x[:, 30:]
    torch.testing.assert_close(ops.gelu_tanh_and_mul(x), want)
    assert ops.num_fallbacks == 1 and not emu_launcher.launches


# ---------------------------------------------------------------- a Gemma 2 model end to end
@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    # head_dim 64 (a built instance); layer 0 windowed (6 positions), layer 1 global; both soft-caps
    # bite; GeGLU MLPs; the query scale is not head_dim's
    return write_tiny_model(tmp_path_factory.mktemp("tiny-gemma2"), "gemma2", hidden_size=128, head_dim=64,
                            num_attention_heads=2, num_key_value_heads=1, intermediate_size=96, sliding_window=6,
                            attn_logit_softcapping=3.0, final_logit_softcapping=4.0, query_pre_attn_scalar=24,
                            tie_word_embeddings=False)


def _generate(model_dir, backend_factory=None):
    config = RuntimeConfig(device="cpu", dtype="float32", num_kv_blocks=24, block_size=8, attention_backend="torch")
    runner = ModelRunner(config, model_dir)
    if backend_factory is not None:
        runner.backend = backend_factory(runner)
    order = list(range(24))
    random.Random(5).shuffle(order)
    prompts = [[3, 17, 99, 5, 42, 8, 8, 61, 120, 7, 33, 2, 90, 11, 4], [9, 1, 77, 23, 5]]
    return generate(runner, prompts, SamplingParams(temperature=0.0, max_tokens=8), chunk_size=6, block_order=order)


class _NoWindows(KernelAttentionBackend):
    """The kernel backend with the layers' windows dropped: the control that shows the test sees them."""

    def attend(self, *args, window=0, softcap=0.0, **kwargs):
        return super().attend(*args, window=0, softcap=softcap, **kwargs)


@pytest.mark.slow  # over 8 s: the full suite's
@pytest.mark.parametrize("split", [None, True])
def test_gemma2_greedy_tokens_equal_torch_backend(gemma2_dir, emu_launcher, split):
    """Chunked prefill (chunks of 6 over a 15-token prompt), decode past the window, split or not:
    the same greedy tokens as the torch backend, with the kernels' GeGLU; dropping the windows
    changes them."""
    expected = _generate(gemma2_dir)
    got = _generate(gemma2_dir, lambda r: KernelAttentionBackend(emu_launcher, r.dtype, split=split, partition_size=8))
    assert got == expected
    launched = {name.split("<")[0] for name, _, _ in emu_launcher.launches}
    assert {"folio::paged_decode", "folio::paged_attention", "folio::gelu_tanh_and_mul"} <= launched
    if split is None:
        assert _generate(gemma2_dir, lambda r: _NoWindows(emu_launcher, r.dtype)) != expected


@pytest.mark.slow  # over 8 s: the full suite's
def test_gemma2_graph_path_gives_the_eager_tokens(gemma2_dir, emu_launcher):
    """The decode-graph path (static padded buffers whose plan covers the whole table, run eagerly
    over the emulated kernels): the windowed layers' plans are derived from the graph's plan
    without new device copies, and padding rows (length 0) read nothing."""
    from folio.core.executor.runtime.cuda_graphs import DecodeGraphs, graph_buckets

    def runner(graphs: bool) -> ModelRunner:
        config = RuntimeConfig(device="cpu", dtype="float32", num_kv_blocks=40, block_size=8,
                               attention_backend="torch", max_num_seqs=8)
        r = ModelRunner(config, gemma2_dir)
        r.backend = KernelAttentionBackend(emu_launcher, r.dtype)
        if graphs:
            r.graphs = DecodeGraphs(r.model, r.backend, r.pool.kv_caches, 8, 6, graph_buckets(8), r.device,
                                    capture=False)
        return r

    prompts = [[3, 17, 99, 5, 42, 8, 8, 61, 120, 7, 33], [9, 1, 77], [5, 5, 6, 2, 90, 11]]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (9, 3, 6)]
    eager = generate(runner(False), prompts, params, chunk_size=4)
    graph_runner = runner(True)
    assert generate(graph_runner, prompts, params, chunk_size=4) == eager
    assert graph_runner.graphs.num_replays >= 5
    # a windowed layer's plan (key: group, KV heads, fp8, window) beside the full one
    assert any(len(key) == 4 for meta in graph_runner.graphs.metas.values() for key in meta.plan)
