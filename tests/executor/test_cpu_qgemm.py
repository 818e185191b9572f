"""folio's quantized CPU kernels (``kernels/csrc/quant.c`` through ``quant/cpu_gemm.py``) and the one-call
layer stack (``kernels/csrc/stack.c``): every GGUF type repacked losslessly (against gguf-py's own
dequantization), the GEMM against a float64 reference of what it computes, the same bits on
AVX-512, AVX2 and plain C builds, rows independent of their batch, checked inputs, and no thread
spinning once the calls stop."""

from __future__ import annotations

import os
import time

import gguf
import numpy as np
import pytest
import torch

from folio.core.executor.kernels import cpu_kernels
from folio.core.executor.quant import cpu_gemm
from folio.core.executor.quant.cpu_gemm import PackedWeight, QGemm
from folio.core.executor.quant.formats import quantize_int4, quantize_int8
from folio.core.executor.quant.linear import QuantLinear, QuantLMHead, unpack_int4
from folio.testing.gguf_blocks import random_blocks

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler for the CPU kernels")

def gguf_values(name: str, raw: np.ndarray, k: int) -> np.ndarray:
    return gguf.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(raw.shape[0], k)


def _relerr(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("name", list(cpu_gemm.TYPES))
def test_every_type_repacks_losslessly_and_multiplies_as_it_should(name):
    rng = np.random.default_rng(cpu_gemm.TYPES[name])
    n, k = 45, 512  # a tile's tail; two K-quant units
    raw = random_blocks(name, n, k, rng)
    order = rng.permutation(n)
    w = PackedWeight.from_gguf(name, raw, k, order)
    assert np.array_equal(w.dequantize().numpy(), gguf_values(name, raw, k)[order])  # bit for bit
    assert np.array_equal(w.rows(torch.tensor([44, 0, 7])).numpy(), gguf_values(name, raw, k)[order[[44, 0, 7]]])
    for passes in (1, 2):
        g = QGemm(w, passes)
        for m in (1, 2, 3, 5, 8, 9, 17, 70):  # every row-pass size and the 64-row blocks' tail
            x = torch.randn(m, k)
            assert _relerr(g(x), cpu_gemm.reference(w, x, passes)) < 2e-5, (passes, m)


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # AVX2 + FMA; no vectors at all
def test_every_instruction_set_gives_the_same_bits(march):
    try:
        other = cpu_kernels.library_for(march)
    except RuntimeError as exc:
        pytest.skip(f"no {march} build here: {exc}")
    rng = np.random.default_rng(4)
    x = torch.randn(11, 512)
    for name in cpu_gemm.TYPES:
        w = PackedWeight.from_gguf(name, random_blocks(name, 40, 512, rng), 512)
        for passes in (1, 2):
            assert torch.equal(QGemm(w, passes)(x), QGemm(w, passes, lib=other)(x)), (march, name, passes)
    expected = {"x86-64-v3": "avx2", "x86-64": "c"}[march]
    assert other.folio_gemm_path().decode() == expected


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_is_the_same_in_any_batch(threads):
    rng = np.random.default_rng(5)
    for name in ("Q4_0", "Q4_K", "Q6_K"):
        w = PackedWeight.from_gguf(name, random_blocks(name, 1536, 512, rng), 512)
        g = QGemm(w)
        x = torch.randn(70, 512)
        full = g(x, threads=threads)
        for i in range(0, 70, 7):
            assert torch.equal(g(x[i:i + 1], threads=threads), full[i:i + 1])
            assert torch.equal(g(x[i:i + 5], threads=1), full[i:i + 5])


def test_a_fused_weight_of_mixed_types_is_its_parts_side_by_side():
    rng = np.random.default_rng(6)
    q, k, v = (PackedWeight.from_gguf(t, random_blocks(t, n, 256, rng), 256)
               for t, n in (("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 40)))
    fused = PackedWeight.cat([q, k, v])
    assert fused.types == ["Q4_K", "Q6_K"] and fused.n == 136 and len(fused.parts) == 3
    x = torch.randn(6, 256)
    assert torch.equal(QGemm(fused)(x), torch.cat([QGemm(p)(x) for p in (q, k, v)], dim=1))


def test_bf16_rows_in_and_out():
    torch.manual_seed(3)
    g = QGemm(PackedWeight.from_int4(quantize_int4(torch.randn(96, 128) * 0.05, 32)))
    x = torch.randn(5, 128).bfloat16()
    y = g(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, g(x.float()).bfloat16())  # the same activations, rounded once at the end


def test_folios_own_int4_and_int8_match_their_dense_weights():
    torch.manual_seed(2)
    for group in (32, 64):
        q4 = quantize_int4(torch.randn(200, 576) * 0.05, group)
        x = torch.randn(9, 576)
        # two int8 passes keep about 15 bits of x; what is left is the fp16 rounding of the scales
        assert _relerr(QGemm(PackedWeight.from_int4(q4))(x), x.double() @ q4.dequantize().double().T) < 5e-3
    q8, d8 = cpu_gemm.int8_blocks(torch.randn(130, 576) * 0.05)
    w8 = PackedWeight.from_int8(q8, d8)
    assert torch.equal(w8.dequantize(), (q8.float().view(130, 18, 32) * d8[..., None]).view(130, 576))


def test_bad_inputs_are_refused_before_anything_is_written():
    w = PackedWeight.from_gguf("Q4_0", random_blocks("Q4_0", 32, 64, np.random.default_rng(0)), 64)
    g = QGemm(w)
    with pytest.raises(ValueError, match=r"\[rows, 64\]"):
        g(torch.randn(3, 32))  # too narrow: read past its rows
    with pytest.raises(ValueError):
        g(torch.randn(64))  # not rows
    with pytest.raises(TypeError):
        g(torch.randn(2, 64).half())  # fp16 read as fp32
    with pytest.raises(ValueError, match="bytes"):  # a part that does not add up, caught in C
        bad = PackedWeight([cpu_gemm.WeightPart(w.parts[0].type, 48, w.parts[0].tiles)], 64)
        QGemm(bad)
    with pytest.raises(ValueError, match="unit"):
        PackedWeight.from_gguf("Q4_K", np.zeros((16, 144), dtype=np.uint8), 128)  # K-quants need 256s
    with pytest.raises(IndexError):
        w.rows(torch.tensor([32]))
    lib = cpu_kernels.library()
    order = np.array([0] * 31 + [99], dtype=np.int64)  # a row that is not there
    out = torch.zeros(w.parts[0].tiles.numel(), dtype=torch.uint8)
    raw = random_blocks("Q4_0", 32, 64, np.random.default_rng(1))
    with pytest.raises(IndexError):
        cpu_kernels.check(lib, lib.folio_repack(2, 32, 64, raw.ctypes.data, raw.shape[1], order.ctypes.data,
                                                out.data_ptr(), out.numel()))
    assert not out.any()


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
        assert layer.weight_packed is not None and layer.packed is None  # one form kept
        layer.set_int8_activations(False)
        theirs = layer(x)
        assert layer.packed is not None
        assert not torch.equal(ours, theirs)  # bf16 activations through torch's kernels
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0.05 * theirs.abs().max().item())
        layer.set_int8_activations(True)
        assert torch.equal(layer(x), ours) and layer.packed is None
    kquant = QuantLinear(PackedWeight.from_gguf("Q4_K", random_blocks("Q4_K", 16, 256, np.random.default_rng(2)), 256))
    with pytest.raises(ValueError, match="bf16"):
        kquant.set_int8_activations(False)  # torch's kernels take int4 groups and int8 only


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


def test_a_gguf_head_reads_its_own_type():
    raw = random_blocks("Q6_K", 1000, 256, np.random.default_rng(8))
    tiles = PackedWeight.from_gguf("Q6_K", raw, 256)
    head, x = QuantLMHead(tiles), torch.randn(3, 256)
    exact = x.double() @ torch.from_numpy(gguf_values("Q6_K", raw, 256)).double().T
    assert _relerr(head(x), exact) < 1e-4  # two int8 passes of x against the file's own weights
    assert torch.equal(torch.cat([head(x[i:i + 1]) for i in range(3)]), head(x))


def _thread_cpu_seconds() -> float:
    total = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def test_the_pool_sleeps_when_the_calls_stop():
    torch.manual_seed(8)
    g, x = QGemm(PackedWeight.from_int4(quantize_int4(torch.randn(3072, 576) * 0.05, 32))), torch.randn(1, 576)
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
    from folio.shared.sampling import SamplingParams
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
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fused = generate(runner, prompts, params, chunk_size=5)
    fused_hidden, hidden[:] = list(hidden), []
    assert stack.num_calls >= (18 if invariant else 8)  # decodes; with invariance the chunks too
    runner.backend.stack = None
    assert generate(runner, prompts, params, chunk_size=5) == fused
    assert len(hidden) == len(fused_hidden)
    assert all(torch.equal(a, b) for a, b in zip(hidden, fused_hidden))
