"""The whole executor on the CPU with the kernel backend (emulated kernels) against the torch
backend: greedy tokens equal, through chunked prefill, decode and shuffled blocks."""

from __future__ import annotations

import random

import pytest

from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.sampling import SamplingParams
from folio.testing.models import write_tiny_model
from tests.executor.toy_driver import generate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 64 (a built kernel instance), GQA group 2
    return write_tiny_model(tmp_path_factory.mktemp("tiny-h64"), hidden_size=128, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=96)


def _run(model_dir, backend_factory=None):
    config = RuntimeConfig(device="cpu", dtype="float32", num_kv_blocks=24, block_size=8, attention_backend="torch")
    runner = ModelRunner(config, model_dir)
    if backend_factory is not None:
        runner.backend = backend_factory(runner)
    order = list(range(24))
    random.Random(5).shuffle(order)
    prompts = [[3, 17, 99, 5, 42, 8, 8, 61, 120, 7, 33, 2, 90, 11, 4], [9, 1, 77, 23, 5]]
    return generate(runner, prompts, SamplingParams(temperature=0.0, max_tokens=6), chunk_size=6, block_order=order)


@pytest.mark.parametrize("split", [None, True])
def test_greedy_tokens_equal_torch_backend(model_dir, emu_launcher, split):
    expected = _run(model_dir)
    got = _run(model_dir, lambda runner: KernelAttentionBackend(emu_launcher, runner.dtype, split=split,
                                                                partition_size=8))
    assert got == expected
    launched = {name.split("<")[0] for name, _, _ in emu_launcher.launches}
    assert {"folio::paged_decode", "folio::paged_attention"} <= launched  # decode steps and prefill chunks
    assert {"folio::add_rms_norm", "folio::rope_write_kv", "folio::silu_and_mul"} <= launched  # fused layer ops
    assert "folio::paged_attention_reduce" in launched or not split
