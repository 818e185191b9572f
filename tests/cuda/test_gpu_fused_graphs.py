"""On a real GPU (``gpu`` marker; skipped without CUDA): the fused kernels against the torch
reference, and greedy tokens with CUDA graphs of the decode step equal to ``--enforce-eager``'s (fp32: the
padded GEMMs of a graph may round differently in 16-bit types)."""

from __future__ import annotations

import pytest

from tests.cuda.fused_cases import DTYPES, check_add_rms_norm, check_rope_write_kv, check_silu_and_mul

pytestmark = pytest.mark.gpu
IDS = [str(d).removeprefix("torch.") for d in DTYPES]


@pytest.fixture(scope="module")
def launcher():
    pytest.importorskip("cupy")
    from folio.core.executor.kernels.cuda_backend import CupyLauncher

    return CupyLauncher()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_fused_kernels(launcher, dtype):
    check_add_rms_norm(launcher, dtype, "cuda", num_tokens=37)
    check_silu_and_mul(launcher, dtype, "cuda", num_tokens=37)
    for head_dim in (64, 96, 128):
        check_rope_write_kv(launcher, dtype, head_dim, "cuda", block_size=16)


def _generate(model_dir, enforce_eager: bool):
    from tests.executor.toy_driver import generate
    from folio.core.executor.runtime.runner import ModelRunner
    from folio.shared.config import RuntimeConfig
    from folio.shared.sampling import SamplingParams

    config = RuntimeConfig(device="cuda", dtype="float32", num_kv_blocks=256, block_size=16,
                           attention_backend="cuda", max_num_seqs=16, enforce_eager=enforce_eager)
    runner = ModelRunner(config, model_dir)
    prompts = [[(7 * i + j) % 250 for j in range(5 + 9 * i)] for i in range(11)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i) for i in range(11)]
    return generate(runner, prompts, params, chunk_size=32), runner


def test_graphs_give_the_eager_tokens(tmp_path):
    pytest.importorskip("cupy")
    from folio.testing.models import write_tiny_model

    model_dir = write_tiny_model(tmp_path, vocab_size=256, hidden_size=256, num_attention_heads=4,
                                 num_key_value_heads=1, intermediate_size=128)
    eager, eager_runner = _generate(model_dir, True)
    assert eager_runner.graphs is None
    graphed, runner = _generate(model_dir, False)
    assert runner.graphs is not None and runner.graphs.buckets == [1, 2, 4, 8, 16]
    assert runner.graphs.num_replays > 0 and runner.graphs.graphs
    assert graphed == eager
