"""Quantized weights: the formats (Q4_1 repack, AutoAWQ packing, round to nearest), the packed CPU
layers against their dequantized reference, and loading quantized models."""

from __future__ import annotations

import pytest
import torch

from folio.core.executor.quant.formats import (
    AWQ_ORDER, Int4Weight, awq_to_int4, int4_to_awq, pack_awq, quantize_int4, quantize_int8, read_gguf_quant,
    unpack_awq,
)
from folio.core.executor.quant.linear import QuantLinear


def test_awq_packing_round_trips_in_autoawq_nibble_order():
    values = torch.randint(0, 16, (6, 24))
    packed = pack_awq(values)
    assert packed.dtype == torch.int32 and packed.shape == (6, 3)
    assert torch.equal(unpack_awq(packed), values.to(torch.uint8))
    # nibble i (bits 4i..4i+3) of each word holds column AWQ_ORDER[i] of its eight
    word = pack_awq(torch.arange(8).reshape(1, 8))[0, 0].item() & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == list(AWQ_ORDER) == [0, 2, 4, 6, 1, 3, 5, 7]


def test_awq_tensors_round_trip_through_int4():
    w = quantize_int4(torch.randn(64, 96), 32)
    awq = int4_to_awq(w)
    assert awq["qweight"].shape == (96, 8) and awq["qzeros"].shape == (3, 8) and awq["scales"].shape == (3, 64)
    back = awq_to_int4(awq["qweight"], awq["qzeros"], awq["scales"], 32)
    assert torch.equal(back.q, w.q)
    # scales are stored fp16 in the AWQ layout
    torch.testing.assert_close(back.dequantize(), w.dequantize(), rtol=2e-3, atol=2e-3)


def test_round_to_nearest_errors_are_within_half_a_step():
    w = torch.randn(32, 128)
    q4 = quantize_int4(w, 64)
    step = q4.scale.repeat_interleave(64, dim=1)
    assert ((q4.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    q8 = quantize_int8(w)
    assert ((q8.dequantize() - w).abs() <= q8.scale.unsqueeze(1) / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="not a multiple of group size 128; use 32 or 64"):
        quantize_int4(torch.randn(8, 576), 128)


@pytest.mark.parametrize("act", ["int8", "bf16"])  # folio's kernels; torch's
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_packed_layer_matches_its_dequantized_reference(bits, rows, act):
    torch.manual_seed(bits * 100 + rows)
    w = torch.randn(96, 128) * 0.05
    qw = quantize_int4(w, 32) if bits == 4 else quantize_int8(w)
    bias = torch.randn(96)
    layer = QuantLinear(qw, bias)
    layer.set_int8_activations(act == "int8")
    x = torch.randn(rows, 128)
    ref = torch.nn.functional.linear(x.bfloat16().float(), qw.dequantize().bfloat16().float(), bias)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 96)
    # bf16 (or int8 per block of 32) activations and scales: about 1% of the output's scale
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_int4_layer_uses_the_zero_point():
    # a constant weight row: all of it sits in zero, none in q - 8
    qw = Int4Weight(torch.full((16, 64), 8, dtype=torch.uint8), torch.ones(16, 2), torch.full((16, 2), 0.5), 32)
    out = QuantLinear(qw)(torch.ones(1, 64))
    torch.testing.assert_close(out, torch.full((1, 16), 32.0))


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_layer_takes_operands_at_any_address(bits):
    # safetensors places tensors at 8-byte offsets; torch's int8 kernel crashed on such a weight
    def at_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
        buf = torch.empty(t.numel() * t.element_size() + offset, dtype=torch.uint8)[offset:]
        return buf.view(t.dtype).view(t.shape).copy_(t)

    torch.manual_seed(bits)
    w = torch.randn(576, 576) * 0.05
    qw = quantize_int4(w, 32) if bits == 4 else quantize_int8(w)
    if bits == 8:
        qw = type(qw)(at_offset(qw.q, 56), qw.scale)
        assert qw.q.data_ptr() % 64 == 56
    x = torch.randn(39, 576).bfloat16()
    shifted = at_offset(x, 16)
    ref = torch.nn.functional.linear(x.float(), qw.dequantize().bfloat16().float())
    out = QuantLinear(qw)(shifted)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_gptq_is_round_to_nearest_without_correlation_and_beats_it_with():
    from folio.cli.gptq import gptq_quantize_int8

    torch.manual_seed(0)
    w = torch.randn(64, 96) * 0.05
    # uncorrelated inputs of one scale: no error is worth moving, GPTQ rounds to nearest
    assert torch.equal(gptq_quantize_int8(w, torch.eye(96) * 7.0).q, quantize_int8(w).q)
    # correlated inputs (a shared factor plus noise, and a few loud channels): lower output error
    x = torch.randn(512, 8) @ torch.randn(8, 96) + 0.1 * torch.randn(512, 96)
    x[:, :4] *= 10
    q = gptq_quantize_int8(w, x.double().t() @ x.double())
    assert torch.equal(q.scale, quantize_int8(w).scale)  # the same per-channel scales and format
    assert q.q.dtype == torch.int8 and q.q.abs().max() <= 127

    def err(qw):
        return (x @ (w - qw.dequantize()).t()).pow(2).mean().item()

    assert err(q) < 0.2 * err(quantize_int8(w))


@pytest.mark.slow
def test_q4_1_blocks_repack_exactly_into_int4_groups(smollm_dir):
    from pathlib import Path

    from folio.core.executor.model.loader import load_hf_config, read_safetensors
    from folio.core.model_files import packaged_gguf

    dense = read_safetensors(Path(smollm_dir))  # transformers' own dequantization of the GGUF
    method, quant = read_gguf_quant(packaged_gguf(), load_hf_config(Path(smollm_dir)))
    assert method == "int4" and len(quant) == 7 * 30
    for name, w in quant.items():
        assert w.group_size == 32 and w.q.max() <= 15
        torch.testing.assert_close(w.dequantize(), dense[name], rtol=0, atol=1e-6)


def _logits(model, ids):
    from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend

    spec, n = model.spec, len(ids)
    shape = (n, 1, spec.num_kv_heads, spec.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
    meta = AttentionMetadata.build([n], [n], [list(range(n))], None, 1)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), meta.positions, kv, meta, TorchAttentionBackend()))


@pytest.mark.parametrize("method", ["int8", "int4", "awq"])
def test_folio_quantize_writes_a_folder_that_loads_back(tmp_path, tiny_model_dir, method):
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from folio.core.executor.model.loader import load_model
    from folio.cli.quantize import main

    out = tmp_path / method
    assert main(["--method", method, "--group-size", "32", "--calibration-tokens", "64", tiny_model_dir, str(out)]) == 0
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    state = load_file(out / "model.safetensors")
    if method == "int8":
        assert qconfig["quant_method"] == "folio-int8"
        assert state["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    else:  # AutoAWQ GEMM layout, as transformers describes it
        assert qconfig["quant_method"] == "awq" and qconfig["bits"] == 4 and qconfig["group_size"] == 32
        assert qconfig["zero_point"] is True and qconfig["version"] == "gemm"
        # down_proj: in 96, out 64
        assert state["model.layers.0.mlp.down_proj.qweight"].shape == (96, 8)
        assert state["model.layers.0.mlp.down_proj.qzeros"].shape == (3, 8)
        assert state["model.layers.0.mlp.down_proj.scales"].shape == (3, 64)
        assert state["model.layers.0.mlp.down_proj.scales"].dtype == torch.float16
    served = load_model(out, torch.float32, torch.device("cpu"), "auto")
    assert served.quantization == ("int8" if method == "int8" else "awq")
    dense = load_model(out, torch.float32, torch.device("cpu"), "none")  # the folder's weights, dequantized
    assert dense.quantization == "none"
    original = load_model(Path(tiny_model_dir), torch.float32, torch.device("cpu"), "none")
    ids = [1, 5, 9, 33, 2, 7, 100, 64]
    served_logits, dense_logits = _logits(served, ids), _logits(dense, ids)
    cos = torch.nn.functional.cosine_similarity
    # served = its dequantized weights up to bf16 activations and scales
    assert cos(served_logits, dense_logits, dim=-1).min() > 0.995
    # and a 4-bit random-weight model drifts from the original, but stays the same function
    assert cos(dense_logits, _logits(original, ids), dim=-1).min() > (0.99 if method == "int8" else 0.8)


def test_folio_quantize_refuses_a_group_size_that_does_not_fit(tmp_path, tiny_model_dir, capsys):
    from folio.cli.quantize import main

    assert main(["--method", "int4", "--group-size", "64", tiny_model_dir, str(tmp_path / "x")]) == 2
    assert "96 input channels, not a multiple of group size 64; use 32" in capsys.readouterr().err


@pytest.mark.parametrize("model_type", ["gemma2", "phi3", "qwen3_moe"])
def test_folio_quantize_refuses_families_it_would_write_wrong(tmp_path, model_type, capsys):
    """Gemma's (1 + w) norms, Phi-3's fused projections and experts are not rewritten by the tool."""
    from folio.cli.quantize import main
    from folio.testing.models import write_tiny_model

    path = write_tiny_model(tmp_path / model_type, model_type, pad_token_id=0, eos_token_id=1)
    assert main(["--method", "int4", "--group-size", "32", str(path), str(tmp_path / "x")]) == 2
    assert f"not {model_type!r}; serve it with --quantization int8 or int4" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_runner_serves_each_quantization_and_refuses_fp8_on_the_cpu(tiny_model_dir):
    from tests.executor.toy_driver import generate
    from folio.core.executor.runtime.runner import ModelRunner
    from folio.shared.config import RuntimeConfig
    from folio.shared.sampling import SamplingParams

    outputs = {}
    for method in ("none", "int8", "int4"):
        runner = ModelRunner(RuntimeConfig(num_kv_blocks=16, block_size=4, quantization=method), tiny_model_dir)
        assert runner.stats()["quantization"] == method
        outputs[method] = generate(runner, [list(range(3, 15))], SamplingParams(temperature=0, max_tokens=6))[0]
    assert all(len(o) == 6 for o in outputs.values())
    with pytest.raises(ValueError, match="fp8 weights need a CUDA GPU"):
        ModelRunner(RuntimeConfig(num_kv_blocks=16, quantization="fp8"), tiny_model_dir)
    with pytest.raises(ValueError, match="needs an AWQ checkpoint"):
        ModelRunner(RuntimeConfig(num_kv_blocks=16, quantization="awq"), tiny_model_dir)


@pytest.mark.parametrize("rows", [3, 9])  # the int4 pair (up to SMALL_ROWS rows), the bf16 copy
def test_lm_head_refines_its_top_logits_exactly(rows):
    from folio.core.executor.quant.linear import REFINE_TOP, SMALL_ROWS, QuantLMHead

    assert (rows <= SMALL_ROWS) == (rows == 3)
    torch.manual_seed(0)
    weight, x = torch.randn(512, 64), torch.randn(rows, 64)
    exact = x @ weight.t()
    head, short = QuantLMHead(weight), QuantLMHead(weight[:500])
    head.set_int8_activations(False)  # torch's kernels (--cpu-quant-activations bf16)
    short.set_int8_activations(False)
    assert head.pair is not None and short.pair is None  # a vocabulary the kernel takes
    out = head(x)
    top = exact.topk(REFINE_TOP // 2, dim=-1).indices  # surely inside the approximate pass's top 64
    torch.testing.assert_close(out.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    rest = torch.ones_like(out, dtype=torch.bool).scatter_(1, exact.topk(100, dim=-1).indices, False)
    assert not torch.allclose(out[rest], exact[rest], rtol=1e-5, atol=1e-5)  # the tail stays approximate
    # bf16 weights, or int8 groups (a step of max|w| / 127): the tail within their rounding
    torch.testing.assert_close(out, exact, rtol=2e-2, atol=0.1 if rows > SMALL_ROWS else 0.3)


def test_a_batch_invariant_lm_head_keeps_one_copy_and_turns_back():
    """Invariant: the oneDNN-packed copy alone (the bf16 copy and the int4 pair dropped), each row
    the same alone or in a batch; turned off again, the head gives what a fresh head gives."""
    from folio.core.executor.quant.linear import QuantLMHead

    torch.manual_seed(2)
    weight, x = torch.randn(512, 64), torch.randn(9, 64)
    head, fresh = QuantLMHead(weight), QuantLMHead(weight)
    head.set_int8_activations(False)  # torch's kernels (--cpu-quant-activations bf16)
    fresh.set_int8_activations(False)
    head.batch_invariant = True
    batch = head(x)
    assert head.packed is not None and head.weight_bf16 is None and head.pair is None
    assert torch.equal(torch.cat([head(x[i:i + 1]) for i in range(9)]), batch)
    head.batch_invariant = False
    assert torch.equal(head(x), fresh(x)) and head.packed is None


def test_the_lm_heads_int4_pair_sums_to_its_int8_groups_and_recovers_q8_0():
    from folio.core.executor.quant.linear import int8_as_int4_pair

    torch.manual_seed(1)
    # Q8_0-style weights: int8 per group of 32 times an fp16 scale, dequantized to fp32
    q = torch.randint(-127, 128, (40, 96)).float()
    q.view(40, 3, 32)[..., 0] = 127  # each group reaches its scale
    d = (torch.rand(40, 3) * 0.02 + 1e-3).half().float()
    weight = (q.view(40, 3, 32) * d[..., None]).view(40, 96)
    hi, lo = int8_as_int4_pair(weight)
    assert hi.q.max() <= 15 and lo.q.max() <= 15
    assert torch.equal(hi.dequantize() + lo.dequantize(), weight)  # exact in fp32 scales
@pytest.mark.parametrize("act", ["int8", "bf16"])
@pytest.mark.parametrize("bits", [4, 8])
def test_packed_layers_are_row_invariant(bits, act):
    # a row's output is bitwise the same alone or in any batch: tokens do not depend on batching
    torch.manual_seed(bits)
    w = torch.randn(192, 128) * 0.05
    layer = QuantLinear(quantize_int4(w, 32) if bits == 4 else quantize_int8(w))
    layer.set_int8_activations(act == "int8")
    x = torch.randn(70, 128)
    full = layer(x)
    for i in range(0, 70, 9):
        assert torch.equal(layer(x[i:i + 1]), full[i:i + 1])
        assert torch.equal(layer(x[i:i + 3]), full[i:i + 3])


def test_auto_keeps_the_checkpoint_format_on_the_cpu_and_what_a_gpu_kernel_takes_elsewhere():
    from folio.core.executor.model.loader import resolve_quantization

    assert resolve_quantization("auto", "int4", torch.device("cpu")) == "int4"
    assert resolve_quantization("auto", "int4", torch.device("cuda")) == "none"  # Q4_1: off the AWQ grid
    assert resolve_quantization("auto", "awq", torch.device("cuda")) == "awq"
    assert resolve_quantization("int4", "none", torch.device("cuda")) == "int4"
    with pytest.raises(ValueError, match="no kernel on cuda"):
        resolve_quantization("int8", "none", torch.device("cuda"))
    with pytest.raises(ValueError, match="no kernel on mps"):
        resolve_quantization("int4", "none", torch.device("mps"))
