"""Batch invariance on a GPU (``gpu``-marked; skipped without one): the Llama-3.2-1B shape with
random weights in bf16, the cuda backend with ``--batch-invariant`` (its default).

- 8 concurrent greedy streams (prompts of different lengths, fed in 24-token chunks, decode
  steps in CUDA graphs) give each stream's solo output (its prompt prefilled whole);
- the logits of a token computed inside a whole-prompt prefill, as a one-token decode step, and
  inside a chunk after a cached prefix are bitwise the same, as are its logits decoded beside
  other sequences.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

VOCAB = 49152


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    pytest.importorskip("cupy")
    from folio.bench.step import MODEL_SHAPES, write_random_checkpoint
    from folio.core.executor.runtime.runner import ModelRunner
    from folio.shared.config import RuntimeConfig

    assert MODEL_SHAPES["1b"]["vocab_size"] == VOCAB
    # drawn on the GPU in bf16 (2.5 GB), where write_tiny_model would init and save 5 GB in fp32 on the CPU
    path = write_random_checkpoint(tmp_path_factory.mktemp("m1b"), "cuda", torch.bfloat16, **MODEL_SHAPES["1b"])
    config = RuntimeConfig(device="cuda", dtype="bfloat16", max_num_seqs=16, batch_invariant=True)
    r = ModelRunner(config, path)
    assert r.backend.name == "cuda" and r.backend.batch_invariant
    from folio.core.executor.kernels.gemm_kernels import InvariantLinear

    assert isinstance(r.model.layers[0].mlp.down_proj, InvariantLinear)
    assert isinstance(r.model.packed_lm_head, InvariantLinear)
    return r


def _prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 40, 64, 77, 100, 131, 250)]


def test_concurrent_greedy_streams_equal_their_solo_outputs(runner):
    from folio.shared.sampling import SamplingParams
    from tests.executor.toy_driver import generate

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    together = generate(runner, _prompts(), params, chunk_size=24)
    solo = [generate(runner, [p], params)[0] for p in _prompts()]
    assert together == solo


def _logits(runner, seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
    """One step over (tokens, number already cached, blocks) per sequence: the logits of each
    sequence's last token."""
    from folio.core.executor.kernels.attention import AttentionMetadata

    bs = runner.pool.block_size
    ids = torch.tensor([t for tokens, cached, _ in seqs for t in tokens[cached:]], device="cuda")
    meta = AttentionMetadata.build([len(t) - c for t, c, _ in seqs], [len(t) for t, _, _ in seqs],
                                   [b for _, _, b in seqs], None, bs, "cuda")
    with torch.inference_mode():
        hidden = runner.model(ids, meta.positions, runner.pool.kv_caches, meta, runner.backend)
        last = torch.tensor(meta.query_start_loc[1:].tolist(), device="cuda") - 1
        return runner.model.compute_logits(hidden.index_select(0, last))


def test_prefill_and_decode_logits_are_bitwise_equal(runner):
    bs = runner.pool.block_size
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (700,), generator=gen).tolist()  # past the 512-key partition
    other = torch.randint(0, VOCAB, (300,), generator=gen).tolist()
    n = -(-len(tokens) // bs)
    a, b, c, d = (list(range(i * n, (i + 1) * n)) for i in range(4))  # disjoint blocks per computation

    prefilled = _logits(runner, [(tokens, 0, a)])[0]
    _logits(runner, [(tokens[:-1], 0, b)])
    decoded = _logits(runner, [(tokens, len(tokens) - 1, b)])[0]
    _logits(runner, [(tokens[:333], 0, c)])  # a cached prefix that ends mid-block
    after_hit = _logits(runner, [(tokens, 333, c)])[0]
    _logits(runner, [(other[:-1], 0, d[: -(-300 // bs)])])
    beside = _logits(runner, [(other, len(other) - 1, d[: -(-300 // bs)]), (tokens, len(tokens) - 1, b)])[1]

    assert torch.isfinite(prefilled).all()
    for name, got in (("decoded", decoded), ("after a prefix hit", after_hit), ("decoded in a batch", beside)):
        assert torch.equal(got.view(torch.int32), prefilled.view(torch.int32)), \
            f"{name}: max |diff| {(got - prefilled).abs().max().item()}"
