"""Tensor parallelism from the packaged SmolLM2 GGUF (Q4_1/Q8_0), each rank reading only its slices.

The slice reader (``gguf_slices.py``) against transformers' dequantization of the whole file
(the prepared default-model folder holds exactly that), bitwise; three ranks (9 heads and 3 KV
heads split three ways, gloo) against one rank, greedy token for token; and one rank's peak
anonymous resident memory while it loads, sampled from ``/proc``, against the dense model.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path

import pytest
import torch

from folio.core.executor.model.gguf_slices import GGUFSlices
from folio.core.executor.model.loader import load_hf_config, read_safetensors
from folio.core.executor.runtime.runner import ModelRunner
from folio.core.executor.runtime.workers import ParallelRunner
from folio.shared.config import RuntimeConfig
from folio.core.model_files import packaged_gguf
from tests.core.engine import LocalEngine, engine_request

pytestmark = pytest.mark.slow


def test_slices_are_transformers_dequantization_bitwise(smollm_dir):
    gguf = packaged_gguf()
    reader = GGUFSlices(gguf, load_hf_config(gguf))
    reference = read_safetensors(Path(smollm_dir))  # load_gguf_state's output, saved by prepare
    assert set(reference) == set(reader.tensors)  # tied embeddings: neither has lm_head
    for name, want in reference.items():
        got = reader.read(name, None, 0, 0)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    # a rank's slices are the same slices of the whole: q rows of heads 3..5 (un-permuted per
    # head), k rows of KV head 1, down_proj's input columns 512..1024 (whole Q4_1 blocks)
    for name, dim, start, end in [("model.layers.4.self_attn.q_proj.weight", 0, 192, 384),
                                  ("model.layers.4.self_attn.k_proj.weight", 0, 64, 128),
                                  ("model.layers.7.mlp.down_proj.weight", 1, 512, 1024),
                                  ("model.embed_tokens.weight", 0, 16384, 32768)]:
        got = reader.read(name, dim, start, end)
        assert torch.equal(got, reference[name].narrow(dim, start, end - start)), name
    with pytest.raises(ValueError, match="blocks of 32"):
        reader.read("model.layers.0.mlp.down_proj.weight", 1, 0, 500)


def config(model: str, tp: int) -> RuntimeConfig:
    return RuntimeConfig(model=model, device="cpu", dtype="float32", quantization="none", block_size=16,
                         num_kv_blocks=16, max_num_seqs=2, max_num_batched_tokens=64, tensor_parallel_size=tp)


def greedy(runner) -> list[int]:
    engine = LocalEngine(runner, max_num_batched_tokens=64)
    engine.add(engine_request("g", [1, 504, 3458, 314, 260, 3575, 282, 4649, 30], 8))
    return engine.run()["g"].token_ids


def test_three_ranks_from_the_gguf_decode_what_one_rank_decodes(smollm_dir):
    gguf = str(packaged_gguf())
    failures: list[str] = []
    group = ParallelRunner(config(gguf, 3), gguf, on_failure=failures.append)
    try:
        ours = greedy(group)
    finally:
        group.close()
    assert not failures
    assert len(ours) == 8
    assert ours == greedy(ModelRunner(config(smollm_dir, 1), smollm_dir))


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def _load_one_rank(rank: int, size: int, out) -> None:
    """In a fresh process: load one rank's shard while a thread samples anonymous resident memory."""
    from folio.core.executor.model.loader import load_model
    from folio.core.executor.parallel.comm import Shard

    path = packaged_gguf()
    load_hf_config(path)  # the imports and the config parse, before the baseline
    before, peak, done = _rss_anon(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    model = load_model(path, torch.float32, torch.device("cpu"), "none", shard=Shard(rank, size))
    done.set()
    sampler.join()
    peak[0] = max(peak[0], _rss_anon())
    out.put((peak[0] - before, sum(p.numel() * 4 for p in model.parameters())))


def test_a_rank_never_holds_the_dense_model_while_loading(smollm_dir):
    dense = sum(t.numel() * 4 for t in read_safetensors(Path(smollm_dir)).values())  # ~540 MB fp32
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_load_one_rank, args=(1, 3, out))
    proc.start()
    growth, rank_bytes = out.get(timeout=300)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert rank_bytes < 0.4 * dense  # a third of the model, plus the replicated norms
    # its third, plus the reader's tables and dequantization temporaries; not the whole model
    assert growth < 0.6 * dense, (growth, dense)
