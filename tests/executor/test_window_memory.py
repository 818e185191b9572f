"""Sliding-window memory end to end: a tiny Mistral with a window of 8 runs prompts whose tokens
outnumber its window and its whole KV pool through the real scheduler (``EngineCore``), whose
replica gives back the blocks behind the window as each sequence grows (checked against an
allocator of record fed the same logs), and its greedy tokens are still transformers' argmax at
every position, in fp32. Alone, beside another request with preemption, and verifying n-gram
drafts; and as services (kvmanager, executor, scheduler over ipc://), where the window travels
with the executor's pool registration and the kvmanager's log replays the frees with the
scheduler's digest. A model with a global layer (Qwen2 with its first layer full) frees nothing."""

from __future__ import annotations

import pytest
import torch

from folio.core.executor.runtime.runner import ModelRunner
from folio.core.kv.allocator import cdiv
from folio.shared.config import RuntimeConfig
from folio.shared.sampling import SamplingParams
from folio.services.in_process import back_half
from folio.testing.models import write_tiny_model
from tests.core.engine import LocalEngine, engine_request
from tests.core.kv_owner import Owner

WINDOW, BLOCK_SIZE = 8, 4
PROMPT = [(5 * j + 3) % 120 + 2 for j in range(21)]
MAX_TOKENS = 24  # 21 + 24 tokens: 12 blocks without freeing


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_tiny_model(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=WINDOW)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def engine(path, num_kv_blocks, budget=8, **runtime) -> LocalEngine:
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=num_kv_blocks, block_size=BLOCK_SIZE, device="cpu",
                                       dtype="float32", quantization="none", max_num_batched_tokens=budget,
                                       **runtime), path)
    core = LocalEngine(runner, max_num_seqs=4, max_num_batched_tokens=budget)
    # the allocator of record is built for the pool the kvmanager would hear of: with its window
    core.alloc = Owner(runner.pool.num_blocks, BLOCK_SIZE, enable_prefix_caching=True,
                       sliding_window=core.scheduler.pool.sliding_window)
    return core


def reference_tokens(hf, prompt, n):
    """transformers' greedy continuation, one argmax at a time over the whole sequence."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_sequence_longer_than_its_window_and_the_pool(mistral, backend):
    """The torch reference and the C kernels alike never read the entries the window passed."""
    path, hf = mistral
    core = engine(path, num_kv_blocks=5, attention_backend=backend)
    assert core.runner.backend.name == backend
    assert core.scheduler.pool.sliding_window == WINDOW
    assert cdiv(len(PROMPT) + MAX_TOKENS - 1, BLOCK_SIZE) > 5  # it could not run without freeing
    core.add(engine_request("a", PROMPT, MAX_TOKENS, ignore_eos=True))
    out = core.run()["a"]
    assert out.error is None and out.token_ids == reference_tokens(hf, PROMPT, MAX_TOKENS)
    assert core.alloc.counters["num_window_skipped_blocks"] >= 8
    assert core.scheduler.counters["num_preemptions"] == 0


def test_beside_another_request_with_preemption(mistral):
    path, hf = mistral
    other = [(11 * j + 7) % 120 + 2 for j in range(17)]
    core = engine(path, num_kv_blocks=7)  # two windows and a chunk do not fit beside each other
    core.add(engine_request("a", PROMPT, MAX_TOKENS, ignore_eos=True))
    core.add(engine_request("b", other, MAX_TOKENS, ignore_eos=True))
    outs = core.run()
    assert outs["a"].token_ids == reference_tokens(hf, PROMPT, MAX_TOKENS)
    assert outs["b"].token_ids == reference_tokens(hf, other, MAX_TOKENS)
    assert core.scheduler.counters["num_preemptions"] > 0
    assert core.alloc.num_free_blocks == 7


def test_verifying_ngram_drafts(mistral):
    path, hf = mistral
    loop = PROMPT[:10] * 3  # a repeated stretch for the proposer to match
    core = engine(path, num_kv_blocks=6, speculative_model="ngram", num_speculative_tokens=3)
    core.add(engine_request("a", loop, MAX_TOKENS, ignore_eos=True))
    out = core.run()["a"]
    assert out.token_ids == reference_tokens(hf, loop, MAX_TOKENS)
    assert core.scheduler.counters["num_spec_draft_tokens"] > 0


@pytest.mark.asyncio
async def test_the_services_free_behind_the_window_in_step(mistral):
    path, hf = mistral
    async with back_half(path, num_kv_blocks=6, block_size=BLOCK_SIZE, max_num_batched_tokens=8) as bh:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        (tokens,) = await bh.generate([PROMPT], params)
        assert tokens == reference_tokens(hf, PROMPT, MAX_TOKENS)
        kv = (await bh.admin("kvmanager", "stats")).data
        sched = (await bh.admin("scheduler", "stats")).data
    assert kv["sliding_window"] == WINDOW and kv["num_window_skipped_blocks"] >= 8 and kv["num_refused_ops"] == 0
    assert sched["num_digest_mismatches"] == 0 and sched["num_epochs"] == 1


def test_a_model_with_a_global_layer_frees_nothing(tmp_path):
    path = write_tiny_model(tmp_path / "qwen2", "qwen2", use_sliding_window=True, sliding_window=WINDOW,
                            max_window_layers=1)
    core = engine(path, num_kv_blocks=16)
    assert core.scheduler.pool.sliding_window == 0
    core.add(engine_request("a", PROMPT, MAX_TOKENS, ignore_eos=True))
    assert core.run()["a"].error is None
    assert core.alloc.counters["num_window_skipped_blocks"] == 0
