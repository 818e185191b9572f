"""The W4A16 kernels (cuda/quant_gemm.cu) under the CPU emulation against x @ the dequantized
weights, and a model whose projections run them against the same model dequantized."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend
from folio.core.executor.model.loader import _fused_quant_weights, load_model, read_checkpoint
from folio.core.executor.model.layers import ModelSpec
from folio.core.executor.quant.formats import awq_to_int4, int4_to_awq
from folio.core.executor.quant.gpu import GEMV_MAX_ROWS, AwqLinear, check_awq_shape, quantize_model_gpu
from folio.testing.models import write_tiny_model
from tests.cuda.quant_cases import check_awq_linear, check_awq_matmul, random_awq

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
IDS = [str(d).removeprefix("torch.") for d in DTYPES]
# (rows, N, K, group): K=576 (SmolLM2's hidden size) with g32/g64; N not a multiple of a tile
# (the GEMV's 256 columns, the tile's 128); K not a multiple of the GEMV's 256-row slice
SHAPES = [(1, 800, 576, 32), (3, 96, 576, 64), (4, 288, 512, 128), (5, 256, 320, 64), (17, 800, 576, 32),
          (64, 160, 576, 64), (33, 32, 64, 32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("rows,n,k,group", SHAPES, ids=[f"m{m}-n{n}-k{k}-g{g}" for m, n, k, g in SHAPES])
def test_awq_matmul(emu_launcher, dtype, rows, n, k, group):
    check_awq_matmul(emu_launcher, dtype, rows, n, k, group)
    kernel = "awq_gemv" if rows <= GEMV_MAX_ROWS else "awq_gemm"
    c_type = ck.DTYPES[str(dtype).removeprefix("torch.")]
    assert [name for name, _, _ in emu_launcher.launches] == [f"folio::{kernel}<{c_type}>"]


def test_gemv_launch_geometry(emu_launcher):
    """Grid (column tiles, K slices, row groups): every part of a ragged shape is covered."""
    check_awq_matmul(emu_launcher, torch.bfloat16, 7, 800, 576, 32)
    (_, grid, block), = emu_launcher.launches
    assert grid == (4, 3, 4) and block == (ck.GEMV_THREADS, 1, 1)


def test_gemm_splits_k_when_its_tiles_are_few(emu_launcher):
    """7 tiles on the emulated 4 SMs: two K splits of 288 rows (fp32 partial sums); a short K
    stays whole (y written in T directly)."""
    check_awq_matmul(emu_launcher, torch.bfloat16, 17, 800, 576, 32)
    check_awq_matmul(emu_launcher, torch.bfloat16, 33, 32, 64, 32)
    assert [grid for _, grid, _ in emu_launcher.launches] == [(7, 1, 2), (1, 2, 1)]


def test_awq_linear_layer(emu_launcher):
    check_awq_linear(emu_launcher, torch.bfloat16)


def test_rows_are_independent_of_the_batch(emu_launcher):
    """Within one path a row's result does not depend on the other rows of the call."""
    w = random_awq(256, 256, 64, seed=3)
    layer = AwqLinear(w, None, emu_launcher, torch.device("cpu"))
    x = torch.randn(40, 256).to(torch.bfloat16)
    small, large = layer(x[:6]), layer(x)
    assert layer(x[:0]).shape == (0, 256)
    assert torch.equal(layer(x[2:3]), small[2:3]) and torch.equal(layer(x[20:31]), large[20:31])


def test_unfit_shapes_are_refused():
    with pytest.raises(ValueError, match="not a multiple of 32"):
        check_awq_shape(128, 40, 32)
    with pytest.raises(ValueError, match="group size 16"):
        check_awq_shape(128, 64, 16)
    w = random_awq(64, 64, 32)
    w.zero = w.zero + 0.3 * w.scale  # a Q4_1-like minimum, off the integer grid
    with pytest.raises(ValueError, match="integer grid"):
        AwqLinear(w, None, None, torch.device("cpu"))


def test_every_instance_is_built():
    names = ck.all_name_expressions()["quant"]
    assert sorted(names) == sorted(f"folio::{k}<{t}>" for k in ck.QUANT_KERNELS for t in ck.DTYPES.values())
    assert ck.module_of("folio::awq_gemv<folio::bf16>") == "quant"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-awq"), hidden_size=128, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=96, num_hidden_layers=2)


def test_model_with_awq_layers(model_dir, emu_launcher):
    """Every projection of a model on the W4A16 kernels (int4 round to nearest, group 32), a
    prefill of two sequences (13 rows): the hidden states of the same model with the int4 weights
    dequantized into dense layers."""
    config, state, _, quant = read_checkpoint(Path(model_dir))
    spec = ModelSpec.from_hf_config(config)
    weights = _fused_quant_weights(state, quant, spec, "int4", 32, awq_grid=True)
    dtype = torch.bfloat16
    kernel_model = load_model(model_dir, dtype, torch.device("cpu"), "none")
    quantize_model_gpu(kernel_model, "int4", weights, launcher=emu_launcher)
    dense_model = load_model(model_dir, dtype, torch.device("cpu"), "none")
    for i, layer in enumerate(dense_model.layers):
        for part, attr in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                           ("mlp", "down_proj")):
            packed = int4_to_awq(weights[f"layers.{i}.{part}.{attr}"])  # what the kernel reads (fp16 scales)
            w = awq_to_int4(packed["qweight"], packed["qzeros"], packed["scales"], 32)
            getattr(getattr(layer, part), attr).weight.copy_(w.dequantize())
    query_lens = [6, 7]  # 13 rows: the tiled kernel
    ids = torch.tensor([3, 17, 99, 5, 42, 8, 8, 61, 1, 2, 90, 4, 7])
    outputs = []
    for model in (dense_model, kernel_model):
        meta = AttentionMetadata.build(query_lens, query_lens, [[0], [2]], None, 8)
        pool = [(torch.zeros(4, 8, 1, 64, dtype=dtype), torch.zeros(4, 8, 1, 64, dtype=dtype)) for _ in range(2)]
        with torch.inference_mode():
            outputs.append(model(ids, meta.positions, pool, meta, TorchAttentionBackend()))
    want, got = outputs
    torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.05)
    assert {name.split("<")[0] for name, _, _ in emu_launcher.launches} == {"folio::awq_gemm"}
