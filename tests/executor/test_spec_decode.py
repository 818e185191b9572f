"""Speculative decoding end to end through the scheduler, the allocator and the runner
(``LocalEngine``): proposers, verification in the paged path, rollback, lossless output."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from folio.core.executor.runtime.spec_decode import NgramProposer
from folio.shared.config import RuntimeConfig
from folio.core.kv.allocator import cdiv
from folio.shared.messages import KVTruncate
from folio.testing.models import write_tiny_model
from tests.core.engine import LocalEngine, engine_request

# --------------------------------------------------------------------------- n-gram proposer


def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    assert p.propose_one([1, 2, 3, 9, 9, 1, 2, 3]) == [9, 9, 1]
    # the 2-gram [7, 8] occurs twice: the latest occurrence wins
    assert p.propose_one([7, 8, 1, 5, 7, 8, 2, 6, 7, 8]) == [2, 6, 7]
    assert p.propose_one([4, 5, 6]) == []  # nothing repeats
    assert NgramProposer(k=2, min_n=2, max_n=2).propose_one([1, 5, 2, 1]) == []  # a 1-gram is too short
    assert p.propose_one([1, 2, 1]) == [2, 1]  # what follows runs into the end: fewer than k


# --------------------------------------------------------------------------- engines


def make_runner(model_dir, num_kv_blocks=256, block_size=4, quantization="none", **spec):
    from folio.core.executor.runtime.runner import ModelRunner

    # the dense weights by default; the packed int4 ones (SmolLM2's ``auto``) in one identity check
    config = RuntimeConfig(num_kv_blocks=num_kv_blocks, block_size=block_size, device="cpu", dtype="float32",
                           quantization=quantization, **spec)
    return ModelRunner(config, model_dir)


def run(runner, reqs, **options):
    engine = LocalEngine(runner, **options)
    for m in reqs:
        engine.add(m)
    outputs = engine.run()
    return engine, {r: o.token_ids for r, o in outputs.items()}


def write_target_and_draft(tmp_path_factory, name: str, vocab_size: int) -> tuple[str, str]:
    """A tiny target and a tiny draft of another shape (different weights): they disagree often."""
    target = write_tiny_model(tmp_path_factory.mktemp(f"{name}-target"), vocab_size=vocab_size)
    draft = write_tiny_model(tmp_path_factory.mktemp(f"{name}-draft"), vocab_size=vocab_size, hidden_size=32,
                             num_hidden_layers=1, intermediate_size=48)
    return target, draft


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return write_target_and_draft(tmp_path_factory, "spec", 64)


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(1, 64) for _ in range(rng.randint(3, 8))]
        prompts.append((phrase * 6)[: rng.randint(12, 40)])
    return prompts


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_output_is_unchanged_by_speculation_on_a_tiny_model(tiny_pair, proposer):
    target, draft = tiny_pair
    reqs = [engine_request(f"r{i}", p, 24, ignore_eos=True) for i, p in enumerate(repetitive_prompts(12))]
    _, plain = run(make_runner(target), reqs)
    spec = dict(speculative_model="ngram" if proposer == "ngram" else draft, num_speculative_tokens=3)
    engine, fast = run(make_runner(target, **spec), reqs)
    assert fast == plain
    c = engine.sched.counters
    assert c["num_spec_drafts"] > 0 and c["num_spec_draft_tokens"] >= c["num_spec_accepted_tokens"] > 0
    assert engine.alloc.num_used_blocks == 0


def test_rejected_drafts_give_their_slots_back(tiny_pair):
    target, draft = tiny_pair
    runner = make_runner(target, speculative_model=draft, num_speculative_tokens=4)
    engine = LocalEngine(runner)
    for i, p in enumerate(repetitive_prompts(6, seed=3)):
        engine.add(engine_request(f"r{i}", p, 30, ignore_eos=True))
    shrunk = 0
    while True:
        pending = dict(engine.sched.pending_truncate)
        if not engine.step():
            break
        truncated = {op.req_id: op.num_tokens for op in engine.logs[-1] if isinstance(op, KVTruncate)}
        assert truncated == pending  # the next log shrinks the tables first thing
        shrunk += len(truncated)
        for running in engine.plans[-1].running_reqs:
            if running.req_id in truncated:  # blocks inside its table went: the executor gets it whole
                assert running.block_ids == engine.alloc.block_table(running.req_id)
                assert len(running.block_ids) >= cdiv(truncated[running.req_id], engine.sched.block_size)
    c = engine.sched.counters
    assert shrunk > 0  # some rejection left a block holding only rejected slots: it went back
    assert c["num_spec_accepted_tokens"] < c["num_spec_draft_tokens"]  # this draft is often wrong
    assert engine.alloc.num_used_blocks == 0 and not runner.proposer.seqs  # draft cache freed too


def test_the_target_as_its_own_draft_has_every_draft_accepted(tiny_pair):
    """With the target as the draft, every greedy draft is the target's own choice: all accepted,
    which also shows that the draft catches up on the tokens it did not compute."""
    target, _ = tiny_pair
    reqs = [engine_request(f"r{i}", p, 20, ignore_eos=True) for i, p in enumerate(repetitive_prompts(6, seed=9))]
    engine, _ = run(make_runner(target, speculative_model=target, num_speculative_tokens=3), reqs)
    c = engine.sched.counters
    assert c["num_spec_draft_tokens"] > 0 and c["num_spec_accepted_tokens"] == c["num_spec_draft_tokens"]


def test_the_draft_cache_keeps_only_accepted_tokens(tiny_pair):
    """After a verification that accepted one draft and then chose another token, the draft's
    next proposal equals a fresh draft's for the same tokens: no rejected token's KV survives."""
    from folio.core.executor.kernels.attention import TorchAttentionBackend
    from folio.core.executor.runtime.input_batch import InputBatch
    from folio.core.executor.runtime.runner import RunnerRequest
    from folio.core.executor.runtime.spec_decode import DraftModelProposer
    from folio.shared.sampling import SamplingParams

    target, draft = tiny_pair

    def proposer():
        return DraftModelProposer(draft, 3, 64, 4, 64, torch.device("cpu"), torch.float32, TorchAttentionBackend())

    prompt = repetitive_prompts(1, seed=11)[0]
    batch = InputBatch(1, 64, 4, torch.device("cpu"))
    row = batch.add("a", list(prompt), len(prompt), 0, [], SamplingParams(temperature=0.0))
    state = RunnerRequest("a", row, batch, SamplingParams(temperature=0.0), True)
    used = proposer()
    first = used.propose([state])[0].token_ids
    other = (first[1] + 1) % 64  # the target accepted the first draft, then chose something else
    used.rollback("a", len(prompt) + 1)
    batch.append_tokens(row, [first[0], other])
    again = used.propose([state])[0]
    fresh = proposer().propose([state])[0]
    assert again.token_ids == fresh.token_ids
    torch.testing.assert_close(again.probs, fresh.probs, atol=1e-5, rtol=1e-5)


def test_speculation_stops_when_the_batch_is_large(tiny_pair):
    target, _ = tiny_pair
    runner = make_runner(target, speculative_model="ngram", num_speculative_tokens=3,
                         speculative_disable_by_batch_size=3)
    prompts = repetitive_prompts(3, seed=5)
    crowded, _ = run(runner, [engine_request(f"r{i}", p, 16, ignore_eos=True) for i, p in enumerate(prompts)])
    assert crowded.sched.counters["num_spec_drafts"] == 0  # three sample every step: no drafts
    alone_engine, _ = run(runner, [engine_request("solo", prompts[0], 16, ignore_eos=True)])
    assert alone_engine.sched.counters["num_spec_drafts"] > 0


# --------------------------------------------------------------------------- losslessness


def exact_distribution(model_dir, prompt, num_tokens, params) -> dict[tuple[int, ...], float]:
    """The target's exact distribution of its next ``num_tokens`` tokens under ``params``."""
    from transformers import AutoModelForCausalLM

    from folio.core.executor.sampling.rejection import processed_probs
    from folio.core.executor.sampling.sampler import SamplingRow

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    dist = {(): 1.0}
    for _ in range(num_tokens):
        nxt = {}
        for seq, p in dist.items():
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + list(seq)])).logits[0, -1:].float()
            probs = processed_probs(logits, [SamplingRow(params, None, prompt, list(seq))])[0]
            for t, q in enumerate(probs.tolist()):
                if q > 0:
                    nxt[seq + (t,)] = p * q
        dist = nxt
    return dist


def chi_square_p_value(counts: dict, expected: dict[tuple, float], total: int) -> float:
    """Pearson's test, cells with expected count below 5 pooled into one."""
    from scipy.stats import chi2

    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, p in expected.items():
        e = p * total
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(cell, 0), pooled_exp + e
            continue
        stat += (counts.get(cell, 0) - e) ** 2 / e
        dof += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    assert not set(counts) - set(expected), "a continuation the target cannot produce"
    return float(chi2.sf(stat, dof))


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    return write_target_and_draft(tmp_path_factory, "chi", 5)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0)] + [pytest.param(t, p, marks=pytest.mark.slow)  # 7-9 s each
                                                  for t, p in ((0.7, 1.0), (1.0, 0.8), (1.3, 0.6))])
def test_sampled_continuations_follow_the_target_distribution_exactly(small_vocab_pair, temperature, top_p):
    """Many unseeded samples of a 3-token continuation, with and without a draft model that
    disagrees with the target often, each pass a chi-square test against the exact target."""
    target, draft = small_vocab_pair
    prompt, num_tokens, total = [1, 3, 2, 4], 3, 6000
    params = dict(temperature=temperature, top_p=top_p, ignore_eos=True)
    expected = exact_distribution(target, prompt, num_tokens, msgspec.structs.replace(
        engine_request("x", prompt, num_tokens, **params).sampling))
    for spec in ({}, dict(speculative_model=draft, num_speculative_tokens=2)):
        engine, outputs = run(make_runner(target, num_kv_blocks=4096, **spec),
                              [engine_request(f"s{i}", prompt, num_tokens, **params) for i in range(total)],
                              max_num_batched_tokens=4096)
        counts: dict[tuple, int] = {}
        for tokens in outputs.values():
            counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
        assert chi_square_p_value(counts, expected, total) > 1e-3, spec
        if spec:
            c = engine.sched.counters
            assert c["num_spec_draft_tokens"] > 0 and c["num_spec_accepted_tokens"] < c["num_spec_draft_tokens"]


# --------------------------------------------------------------------------- SmolLM2


SMOLLM_PROMPTS = [
    ("Rewrite this sentence in the same words: The quick brown fox jumps over the lazy dog near the river bank.", 28),
    ("List the numbers from one to twelve, separated by commas.", 32),
    ("What is the capital of France?", 16),
    ("Copy this list exactly: apples, pears, plums, cherries, grapes, lemons, limes.", 28),
    ("Write a short poem about the sea.", 20),
]


@pytest.fixture(scope="module")
def smollm_prompts(smollm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    out = []
    for text, max_tokens in SMOLLM_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append((list(ids["input_ids"] if hasattr(ids, "keys") else ids), max_tokens))
    return out, tok.eos_token_id


@pytest.mark.slow
@pytest.mark.parametrize("proposer,quantization", [("ngram", "none"), ("draft", "none"), ("ngram", "auto"),
                                                   ("eagle3", "auto")])
def test_greedy_smollm2_is_identical_with_speculation(smollm_dir, smollm_prompts, tmp_path_factory, proposer,
                                                      quantization):
    """The issue's check: SmolLM2-135M-Instruct, greedy, alone (batch 1) and all together; ``auto``
    serves the packaged Q4_1 weights int4 with bf16 activations, where one flipped last bit of
    attention changed a near-tie until verified tokens attended as decodes do."""
    from folio.core.model_files import truncate_layers

    prompts, eos = smollm_prompts
    reqs = [engine_request(f"p{i}", p, n, eos_token_id=eos) for i, (p, n) in enumerate(prompts)]
    if proposer == "ngram":
        spec = dict(speculative_model="ngram", num_speculative_tokens=4)
    elif proposer == "eagle3":  # the head shipped for SmolLM2, drafting every step
        spec = dict(speculative_config='{"method": "eagle3", "adaptive": false}')
    else:  # SmolLM2's first 8 of 30 layers, with its embeddings, norm and head
        draft = truncate_layers(smollm_dir, tmp_path_factory.mktemp("smollm-draft"), 8)
        spec = dict(speculative_model=str(draft), num_speculative_tokens=3)
    plain_runner = make_runner(smollm_dir, block_size=16, quantization=quantization)
    spec_runner = make_runner(smollm_dir, block_size=16, quantization=quantization, **spec)
    _, batched_plain = run(plain_runner, reqs)
    engine, batched_spec = run(spec_runner, reqs)
    assert batched_spec == batched_plain
    assert engine.sched.counters["num_spec_accepted_tokens"] > 0
    for m in reqs[:1]:  # batch 1
        assert run(spec_runner, [m])[1] == {m.req_id: batched_plain[m.req_id]}
