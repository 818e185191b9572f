"""FP8 (e4m3) weights: the quantize math against a dequantized reference, with ``_scaled_mm``
emulated in float math on the CPU, and the refusal on devices without FP8 (the CPU included).
The real ``_scaled_mm`` path is tests/cuda/test_gpu_quant.py's."""

from __future__ import annotations

import pytest
import torch

from folio.core.executor.model.loader import load_model, resolve_quantization
from folio.core.executor.quant.gpu import FP8_MAX, Fp8Linear, fp8_quantize, fp8_reference_mm, require_fp8


def test_per_row_scales_and_saturation():
    t = torch.tensor([[1.0, -2.0, 0.5], [1000.0, -3000.0, 1e-3], [0.0, 0.0, 0.0]])
    q, scale = fp8_quantize(t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale[:2, 0], torch.tensor([2.0, 3000.0]) / FP8_MAX)
    assert q.float().abs().max() == FP8_MAX  # each row's largest value lands on +-448
    assert torch.isfinite(q.float()).all() and (q.float()[2] == 0).all()
    # saturation is explicit: e4m3fn has no infinity, and a bare cast's handling of range is the backend's
    wide = (torch.tensor([[600.0, -1e4, 5.0]]) / 1.0).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    assert wide.float().tolist() == [[448.0, -448.0, 5.0]]


def test_e4m3_round_trip_is_within_its_precision():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-3, 1, 64).unsqueeze(1)  # rows of very different ranges
    q, scale = fp8_quantize(w)
    back = q.float() * scale
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normal values; small ones sit at the subnormal step
    assert ((back - w).abs() <= w.abs() * 2**-4 + scale * 2**-9).all()


def test_scaled_mm_emulation_against_the_dense_product():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 256, generator=g).to(torch.bfloat16)
    x[3] *= 50.0  # per-token scales: one loud token does not flatten the others
    w = torch.randn(96, 256, generator=g) * 0.02
    wq, ws = fp8_quantize(w)
    xq, xs = fp8_quantize(x)
    got = fp8_reference_mm(xq, xs, wq, ws.t()).float()
    want = x.float() @ w.t()
    err = (got - want).norm(dim=1) / want.norm(dim=1)
    assert err.max() < 0.06, err  # two e4m3 roundings, each ~2^-5 relative on average
    layer_scale = Fp8Linear(w).weight_scale
    assert layer_scale.shape == (1, 96) and torch.equal(layer_scale, ws.t())


def test_shapes_that_scaled_mm_cannot_take_are_refused():
    with pytest.raises(ValueError, match="multiples of 16"):
        Fp8Linear(torch.randn(40, 24))


def test_fp8_is_refused_on_the_cpu_with_a_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match=r"sm_89\+.*device is cpu"):
        require_fp8(torch.device("cpu"))
    with pytest.raises(ValueError, match="sm_89"):
        resolve_quantization("fp8", "none", torch.device("cpu"))
    with pytest.raises(ValueError, match="sm_89"):
        load_model(tiny_model_dir, torch.float32, torch.device("cpu"), "fp8")


def test_fp8_refusal_names_the_device_and_its_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"cuda:0 is NVIDIA A100-SXM4-80GB, compute capability 8\.0"):
        require_fp8(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    require_fp8(torch.device("cuda", 0))  # Ada: allowed
    assert resolve_quantization("fp8", "none", torch.device("cuda", 0)) == "fp8"
