"""folio's quantized CPU GEMM (``kernels/csrc/qgemm.c`` through ``quant/cpu_gemm.py``) and the one-call
layer stack (``kernels/csrc/stack.c``): against a float64 reference of what they compute, the same
bits on AVX-512, AVX2 and plain C builds, rows independent of their batch, and no thread spinning
once the calls stop."""

from __future__ import annotations

import os
import time

import pytest
import torch

from folio.core.executor.kernels import cpu_kernels
from folio.core.executor.quant import cpu_gemm
from folio.core.executor.quant.formats import quantize_int4, quantize_int8
from folio.core.executor.quant.linear import QuantLinear, QuantLMHead, unpack_int4

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler for the CPU kernels")

SHAPES = [(960, 576), (45, 64), (200, 1536)]  # SmolLM2's q/k/v; a tile's tail; a long K


def _int4_stored(q4):
    """(q, d, m) as the kernel holds them: d and m rounded to fp16, per block of 32."""
    g = q4.group_size // 32
    scale = q4.scale.float().repeat_interleave(g, 1)
    minimum = q4.zero.float().repeat_interleave(g, 1) - 8 * scale
    return q4.q, scale.half().float(), minimum.half().float()


def _relerr(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("group", [32, 64])
def test_int4_matches_what_it_computes(n, k, group):
    torch.manual_seed(n + k + group)
    q4 = quantize_int4(torch.randn(n, k) * 0.05, group)
    g = cpu_gemm.QGemm.int4(q4)
    for m in (1, 3, 4, 5, 67, 130):  # tails of the 4-row passes and of the 64-row blocks
        x = torch.randn(m, k)
        y = g(x)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert _relerr(y, cpu_gemm.reference(4, x, *_int4_stored(q4))) < 1e-5
        # and close to the dequantized weights: two int8 passes keep about 15 bits of x; what is
        # left is the fp16 rounding of the scales and minima (exact for GGUF's Q4_1, fp16 itself)
        dense = x.double() @ q4.dequantize().double().T
        assert _relerr(y, dense) < 5e-3


@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_matches_what_it_computes(n, k):
    torch.manual_seed(n * k)
    q, d = cpu_gemm.int8_blocks(torch.randn(n, k) * 0.05)
    g = cpu_gemm.QGemm.int8(q, d)
    one_pass = cpu_gemm.QGemm(8, g.packed, n, k, passes=1)  # the LM head's
    for m in (1, 6, 70):
        x = torch.randn(m, k)
        assert _relerr(g(x), cpu_gemm.reference(8, x, q, d, None)) < 1e-5
        assert _relerr(one_pass(x), cpu_gemm.reference(8, x, q, d, None, passes=1)) < 1e-5


def test_bf16_rows_in_and_out():
    torch.manual_seed(3)
    q4 = quantize_int4(torch.randn(96, 128) * 0.05, 32)
    g = cpu_gemm.QGemm.int4(q4)
    x = torch.randn(5, 128).bfloat16()
    y = g(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, g(x.float()).bfloat16())  # the same activations, rounded once at the end


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # AVX2 + FMA; no vectors at all
def test_every_instruction_set_gives_the_same_bits(march):
    try:
        other = cpu_kernels.library_for(march)
    except RuntimeError as exc:
        pytest.skip(f"no {march} build here: {exc}")
    torch.manual_seed(4)
    q4 = quantize_int4(torch.randn(200, 576) * 0.05, 32)
    q8, d8 = cpu_gemm.int8_blocks(torch.randn(130, 576) * 0.05)
    x = torch.randn(9, 576)
    for native in (cpu_gemm.QGemm.int4(q4), cpu_gemm.QGemm.int8(q8, d8), cpu_gemm.QGemm.int8(q8, d8, passes=1)):
        theirs = cpu_gemm.QGemm(native.kind, native.packed, native.n, native.k, lib=other, passes=native.passes)
        assert torch.equal(native(x), theirs(x)), (march, native.kind, native.passes)
    expected = {"x86-64-v3": "avx2", "x86-64": "c"}[march]
    assert other.folio_qgemm_path().decode() == expected


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_is_the_same_in_any_batch(threads):
    torch.manual_seed(5)
    q4 = quantize_int4(torch.randn(3072, 576) * 0.05, 32)
    g = cpu_gemm.QGemm.int4(q4)
    x = torch.randn(70, 576)
    full = g(x, threads=threads)
    for i in range(0, 70, 7):
        assert torch.equal(g(x[i:i + 1], threads=threads), full[i:i + 1])
        assert torch.equal(g(x[i:i + 5], threads=1), full[i:i + 5])


def test_packing_round_trips_and_the_layer_switches_forms():
    torch.manual_seed(6)
    q4 = quantize_int4(torch.randn(45, 128) * 0.05, 32)
    packed = cpu_gemm.pack_int4(q4)
    back = unpack_int4(packed, 45, 128)
    assert torch.equal(back.q, q4.q)
    assert torch.equal(cpu_gemm.pack_int4(back), packed)
    q4 = quantize_int4(torch.randn(48, 128) * 0.05, 32)  # torch's packed kernel takes rows in 16s
    for weight in (q4, quantize_int8(torch.randn(48, 128) * 0.05)):
        layer, x = QuantLinear(weight), torch.randn(3, 128)
        ours = layer(x)
        assert layer.qpacked is not None and layer.packed is None  # one form kept
        layer.set_int8_activations(False)
        theirs = layer(x)
        assert layer.packed is not None
        assert not torch.equal(ours, theirs)  # bf16 activations through torch's kernels
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0.05 * theirs.abs().max().item())
        layer.set_int8_activations(True)
        assert torch.equal(layer(x), ours) and layer.packed is None


def test_the_lm_head_reads_int8_blocks_and_refines_its_top():
    from folio.core.executor.quant.linear import REFINE_TOP

    torch.manual_seed(7)
    weight, x = torch.randn(1000, 64), torch.randn(4, 64)
    head = QuantLMHead(weight)
    assert head.qhead is not None and head.weight_bf16 is None and head.pair is None
    out, exact = head(x), x @ weight.T
    top = exact.topk(REFINE_TOP // 2, dim=-1).indices
    torch.testing.assert_close(out.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, exact, rtol=0, atol=0.05 * exact.abs().max().item())
    assert torch.equal(torch.cat([head(x[i:i + 1]) for i in range(4)]), out)  # batch-invariant as it is


def _thread_cpu_seconds() -> float:
    total = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def test_the_pool_sleeps_when_the_calls_stop():
    torch.manual_seed(8)
    q4 = quantize_int4(torch.randn(3072, 576) * 0.05, 32)
    g, x = cpu_gemm.QGemm.int4(q4), torch.randn(1, 576)
    for _ in range(50):
        g(x, threads=2)  # the workers are up and were just busy
    time.sleep(0.05)
    before = _thread_cpu_seconds()
    time.sleep(1.0)
    assert _thread_cpu_seconds() - before < 0.05  # a spinning worker would take the whole second


@pytest.mark.parametrize("invariant", [False, True])
def test_the_layer_stack_in_one_call_gives_the_modules_bits(tmp_path, invariant):
    """Every step's final hidden states (what the LM head reads) and the greedy tokens, the stack's
    one call against the modules' calls: equal bit for bit, over chunked prompts and decodes (with
    invariance every prefill token takes the stack too)."""
    from folio.core.executor.runtime.runner import ModelRunner
    from folio.shared.config import RuntimeConfig
    from folio.shared.messages import WireSampling
    from folio.testing.models import write_tiny_model
    from tests.executor.toy_driver import generate

    path = write_tiny_model(tmp_path / "m", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2)
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=64, block_size=4, quantization="int4",
                                       batch_invariant=invariant), path)
    stack = runner.backend.stack
    assert stack is not None and runner.model.stack_layout(runner.pool.kv_caches) is not None
    hidden: list[torch.Tensor] = []
    logits_of = runner.model.compute_logits
    runner.model.compute_logits = lambda h: (hidden.append(h.clone()), logits_of(h))[1]
    prompts = [list(range(3, 40)), list(range(50, 61)), [7, 8, 9]]
    params = WireSampling(temperature=0, max_tokens=12, ignore_eos=True)
    fused = generate(runner, prompts, params, chunk_size=5)
    fused_hidden, hidden[:] = list(hidden), []
    assert stack.num_calls >= (18 if invariant else 8)  # decodes; with invariance the chunks too
    runner.backend.stack = None
    assert generate(runner, prompts, params, chunk_size=5) == fused
    assert len(hidden) == len(fused_hidden)
    assert all(torch.equal(a, b) for a, b in zip(hidden, fused_hidden))
