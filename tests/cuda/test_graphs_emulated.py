"""CUDA graphs of the decode step, the parts a CPU can check: bucket sizes, the static buffers and
their padding, and greedy tokens through the graph path (static padded buffers, forward run
eagerly over them with the emulated kernels) equal to the eager path's. The capture itself is
in test_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from folio.core.executor.kernels.attention import AttentionMetadata
from folio.core.executor.runtime.cuda_graphs import DecodeGraphs, bucket_for, graph_buckets
from folio.core.executor.runtime.input_batch import StepInputs
from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.sampling import SamplingParams
from folio.testing.models import write_tiny_model
from tests.executor.toy_driver import generate


def test_buckets():
    assert graph_buckets(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert graph_buckets(1000) == graph_buckets(256)
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(3) == [1, 2, 3]
    assert graph_buckets(1) == [1]
    buckets = graph_buckets(256)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 255, 256, 257)] == [1, 2, 4, 8, 8, 16, 256, 256, None]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-graphs"), hidden_size=128, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=96)


def _runner(model_dir, launcher, graphs: bool) -> ModelRunner:
    config = RuntimeConfig(device="cpu", dtype="float32", num_kv_blocks=40, block_size=8, attention_backend="torch",
                           max_num_seqs=8)
    runner = ModelRunner(config, model_dir)
    assert runner.graphs is None  # never on the CPU
    runner.backend = KernelAttentionBackend(launcher, runner.dtype)
    if graphs:
        runner.graphs = DecodeGraphs(runner.model, runner.backend, runner.pool.kv_caches, 8, 6, graph_buckets(8),
                                     runner.device, capture=False)
    return runner


@pytest.mark.slow  # about 10 s
def test_graph_path_gives_the_eager_tokens(model_dir, emu_launcher):
    """Five requests finishing one after another: decode batches of 5, 4, 3, 2, 1 run in buckets
    8, 4, 4, 2, 1 (padding rows re-padded as the batch shrinks) and sample what eager steps do."""
    prompts = [[3, 17, 99, 5, 42, 8, 8, 61, 120, 7, 33], [9, 1, 77], [5, 5, 6, 2, 90, 11], [4], [60, 61, 62, 63, 64]]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (9, 3, 6, 2, 5)]
    eager = generate(_runner(model_dir, emu_launcher, False), prompts, params, chunk_size=4)
    runner = _runner(model_dir, emu_launcher, True)
    got = generate(runner, prompts, params, chunk_size=4)
    assert got == eager
    assert runner.graphs.num_replays >= 7  # every decode-only step took the graph path


def _step(n: int, seq_lens: list[int], width: int) -> StepInputs:
    tables = torch.arange(n * width, dtype=torch.int32).view(n, width)
    meta = AttentionMetadata(slot_mapping=torch.arange(100, 100 + n, dtype=torch.int64),
                             query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables, max_query_len=1,
                             max_seq_len=max(seq_lens), block_size=8, query_lens_list=[1] * n,
                             seq_lens_list=seq_lens, positions=torch.tensor(seq_lens, dtype=torch.int64) - 1)
    rows = np.arange(n)
    return StepInputs(torch.arange(10, 10 + n), meta, torch.arange(n), rows, np.ones(n, dtype=np.int64),
                      np.ones(n, dtype=bool), np.zeros(n, dtype=np.int64), rows, torch.arange(n), torch.zeros(n, 8))


def test_static_buffers_hold_the_step_and_padding(model_dir, emu_launcher):
    runner = _runner(model_dir, emu_launcher, True)
    graphs = runner.graphs
    assert graphs.buckets == [1, 2, 4, 8]
    for n, width in ((7, 3), (3, 2), (1, 1)):
        step = _step(n, [9 + i for i in range(n)], width)
        assert graphs.can_run(step)
        bucket = graphs.load(step)
        assert bucket == bucket_for(n, graphs.buckets)
        meta = graphs.metas[bucket]
        # the real rows: what the eager step would read
        assert torch.equal(graphs.input_ids[:n], step.input_ids)
        assert torch.equal(meta.positions[:n], step.meta.positions)
        assert torch.equal(meta.slot_mapping[:n], step.meta.slot_mapping)
        assert torch.equal(meta.seq_lens[:n], step.meta.seq_lens)
        assert torch.equal(meta.block_tables[:n, :width], step.meta.block_tables)
        # every other row is padding: length 0 (no key read), slot -1 (nothing written)
        assert (graphs.seq_lens[n:] == 0).all() and (graphs.slot_mapping[n:] == -1).all()
        assert (graphs.positions[n:] == 0).all()
        assert meta.query_start_loc.tolist() == list(range(bucket + 1))
    # the graph's plan covers the whole static table: any context the table holds
    plan = next(iter(graphs.metas[8].plan.values()))
    assert plan.decode.num_items == 8 and plan.decode.num_splits * plan.decode.split_size >= 6 * 8


def test_steps_the_graphs_do_not_take(model_dir, emu_launcher):
    graphs = _runner(model_dir, emu_launcher, True).graphs
    assert not graphs.can_run(_step(9, [5] * 9, 1))  # above the largest bucket
    assert not graphs.can_run(_step(2, [5, 9], 7))  # a table wider than the static one
    chunk = _step(2, [5, 9], 2)
    chunk.meta.max_query_len = 3  # a prefill chunk
    assert not graphs.can_run(chunk)
