"""On a real GPU (``gpu`` marker; skipped without CUDA): the W4A16 kernels against x @ the
dequantized weights, FP8 weights through ``torch._scaled_mm`` against the float emulation of the
same quantized operands (sm_89+), and a model loaded ``--quantization int4`` on the device."""

from __future__ import annotations

import pytest
import torch

from folio.core.executor.quant.gpu import Fp8Linear, fp8_quantize, fp8_reference_mm
from tests.cuda.quant_cases import check_awq_linear, check_awq_matmul

pytestmark = pytest.mark.gpu
DTYPES = (torch.float16, torch.bfloat16)
SHAPES = [(1, 800, 576, 32), (3, 96, 576, 64), (8, 3072, 2048, 128), (17, 800, 576, 32), (64, 160, 576, 64),
          (1, 2048, 8192, 128), (300, 16384, 2048, 128)]


@pytest.fixture(scope="module")
def launcher():
    pytest.importorskip("cupy")
    from folio.core.executor.kernels.cuda_backend import CupyLauncher

    return CupyLauncher()


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("rows,n,k,group", SHAPES, ids=[f"m{m}-n{n}-k{k}-g{g}" for m, n, k, g in SHAPES])
def test_awq_matmul(launcher, dtype, rows, n, k, group):
    check_awq_matmul(launcher, dtype, rows, n, k, group, device="cuda")


def test_awq_linear(launcher):
    check_awq_linear(launcher, torch.bfloat16, device="cuda")


def test_fp8_linear_against_the_emulated_scaled_mm():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89+")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1024, 512, generator=g) * 0.02).to("cuda", torch.bfloat16)
    layer = Fp8Linear(w)
    for rows in (1, 37, 256):
        x = torch.randn(rows, 512, generator=g).to("cuda", torch.bfloat16)
        got = layer(x)
        xq, xs = fp8_quantize(x)
        want = fp8_reference_mm(xq, xs, layer.weight_q, layer.weight_scale)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)
        dense = x.float() @ w.float().t()
        assert ((got.float() - dense).norm() / dense.norm()).item() < 0.06


def test_model_loaded_int4_on_the_gpu(tiny_model_dir):
    """``--quantization int4`` on a GPU puts every projection on the W4A16 kernel; its logits stay
    close to the dense model's (the tiny model's hidden size 64 takes group 32)."""
    pytest.importorskip("cupy")
    from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend
    from folio.core.executor.model.loader import load_model
    from folio.core.executor.quant.gpu import AwqLinear

    device = torch.device("cuda")
    quant = load_model(tiny_model_dir, torch.bfloat16, device, "int4", group_size=32)
    dense = load_model(tiny_model_dir, torch.bfloat16, device, "none")
    assert quant.quantization == "int4" and isinstance(quant.layers[0].mlp.down_proj, AwqLinear)
    ids = torch.tensor([3, 17, 99, 5, 42, 8, 8, 61, 1, 2, 90, 4, 7], device=device)
    outs = []
    for model in (dense, quant):
        meta = AttentionMetadata.build([6, 7], [6, 7], [[0], [2]], None, 8, device)
        pool = [tuple(torch.zeros(4, 8, 2, 16, dtype=torch.bfloat16, device=device) for _ in "kv")
                for _ in range(2)]
        with torch.inference_mode():
            outs.append(model.compute_logits(model(ids, meta.positions, pool, meta, TorchAttentionBackend())))
    cos = torch.nn.functional.cosine_similarity(outs[0].float(), outs[1].float(), dim=-1)
    assert cos.min() > 0.9, cos
