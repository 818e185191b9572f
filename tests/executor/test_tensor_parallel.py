"""Tensor parallelism on the CPU (gloo, two ranks, the mp backend) against one rank.

Two tiny random models: a Llama whose heads, KV heads and intermediate size divide by 2 (with an
odd vocabulary, so the last rank's vocabulary rows are padded), and a Qwen2 (q/k/v biases) with
one KV head, which both ranks must hold, and tied embeddings. Every check compares a TP=2 group
with a TP=1 runner on the same requests, stepped by the real scheduler and allocator
(``LocalEngine``): greedy and seeded outputs token for token, prompt logprobs, beams, swapping and
speculative decoding; then each rank's resident weights against the whole model's.
"""

from __future__ import annotations

import pytest
import torch

from folio.core.executor.parallel.comm import Shard
from folio.core.executor.runtime.plan_check import InvalidPlan
from folio.core.executor.runtime.runner import ModelRunner
from folio.core.executor.runtime.workers import ParallelRunner, resident_tensors
from folio.shared.config import RuntimeConfig
from folio.shared.messages import NewRequestData, StepPlan
from folio.shared.sampling import SamplingParams
from folio.testing.models import write_tiny_model
from tests.core.engine import LocalEngine, engine_request

BLOCK = 4
PROMPTS = [[5, 9, 17, 3, 44, 2, 8, 61, 7, 30, 11], [1, 2, 3, 4, 1, 2, 3], [100, 7, 7, 120, 3, 9, 14, 15, 88, 2, 6, 5, 4,
                                                                            19, 22, 31, 2, 64]]


@pytest.fixture(scope="module")
def even_model(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tp-even"), vocab_size=131)


@pytest.fixture(scope="module")
def mqa_model(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tp-mqa"), model_type="qwen2", num_key_value_heads=1,
                            tie_word_embeddings=True)


def config(model: str, tp: int = 1, **options) -> RuntimeConfig:
    return RuntimeConfig(model=model, device="cpu", dtype="float32", quantization="none", block_size=BLOCK,
                         num_kv_blocks=96, max_num_seqs=16, max_num_batched_tokens=32, tensor_parallel_size=tp,
                         **options)


class Group:
    """A TP=2 group in this process (rank 0) that records failures instead of exiting."""

    def __init__(self, model: str, **options):
        self.failures: list[str] = []
        self.runner = ParallelRunner(config(model, 2, **options), model, on_failure=self.failures.append)

    def close(self):
        self.runner.close()


@pytest.fixture(scope="module")
def even_group(even_model):
    # speculation with the model as its own draft: rank 0 loads the draft whole
    group = Group(even_model, speculative_model=even_model, num_speculative_tokens=3)
    yield group
    group.close()
    assert not group.failures


@pytest.fixture(scope="module")
def mqa_group(mqa_model):
    group = Group(mqa_model, num_host_blocks=64)
    yield group
    group.close()
    assert not group.failures


def requests():
    """Greedy (chunked prefills: the budget is 32 tokens), seeded sampling with top-p/top-k and
    penalties, logprobs and prompt logprobs."""
    reqs = [engine_request(f"g{i}", p, 12) for i, p in enumerate(PROMPTS)]
    reqs += [engine_request(f"s{i}", p, 12, temperature=0.9, top_p=0.9, top_k=40, seed=7 + i,
                            frequency_penalty=0.3) for i, p in enumerate(PROMPTS)]
    reqs.append(engine_request("lp", PROMPTS[0], 6, logprobs=3, prompt_logprobs=2))
    return reqs


def outputs(runner, reqs, **engine_options):
    engine = LocalEngine(runner, max_num_batched_tokens=32, **engine_options)
    for r in reqs:
        engine.add(r)
    return {k: (v.token_ids, v.finish_reason) for k, v in engine.run().items()}


def test_two_ranks_sample_what_one_rank_samples(mqa_model, mqa_group):
    ours = outputs(mqa_group.runner, requests())
    assert ours == outputs(ModelRunner(config(mqa_model), mqa_model), requests())
    assert all(len(tokens) > 0 for tokens, _ in ours.values())


def test_prompt_logprobs_agree(mqa_group, mqa_model):
    # the scheduler hands the logprobs to the tokenizer: compare what the runner reported
    one = ModelRunner(config(mqa_model), mqa_model)
    plan_results = []
    for runner in (one, mqa_group.runner):
        engine = LocalEngine(runner, max_num_batched_tokens=8)
        engine.add(engine_request("lp2", PROMPTS[2], 3, prompt_logprobs=2))
        reported = []
        while engine.sched.has_work():
            out = engine.sched.schedule()
            engine.alloc.apply(out)
            result = runner.execute(engine.sched.build_plan(out))
            reported.append(result.prompt_logprobs.get("lp2"))
            engine.sched.update_from_result(out, result)
        plan_results.append([lp for lp in reported if lp is not None])
    (ref,), (tp,) = plan_results
    assert len(ref) == len(PROMPTS[2]) and ref[0] is None
    for a, b in zip(ref[1:], tp[1:]):
        assert (a.token_id, a.rank, a.top_token_ids) == (b.token_id, b.rank, b.top_token_ids)
        assert [a.logprob, *a.top_logprobs] == pytest.approx([b.logprob, *b.top_logprobs], abs=1e-4)


def test_beams_are_unchanged(mqa_model, mqa_group):
    beam = {"use_beam_search": True, "n": 3, "best_of": 3, "early_stopping": True}

    def run(runner):
        reqs = [engine_request("b0", PROMPTS[0], 8, eos_token_id=3, fork_req_ids=["b1", "b2"], **beam)]
        return outputs(runner, reqs)
    assert run(mqa_group.runner) == run(ModelRunner(config(mqa_model), mqa_model))


def test_speculative_decoding_is_unchanged(even_model, even_group):
    reqs = requests()
    ours = outputs(even_group.runner, reqs)
    # with the same proposer on one rank: the same drafts, the same accepted tokens, the same draws
    spec_one = ModelRunner(config(even_model, speculative_model=even_model, num_speculative_tokens=3), even_model)
    assert ours == outputs(spec_one, reqs)
    # lossless: greedy requests also match plain decoding on one rank
    plain = outputs(ModelRunner(config(even_model), even_model), reqs)
    assert {k: v for k, v in ours.items() if k.startswith("g")} == {k: v for k, v in plain.items() if k.startswith("g")}
    assert even_group.runner.runner.proposer is not None


def test_swapping_acts_on_every_ranks_pool(mqa_model, mqa_group):
    """More than the pool holds (96 blocks of 4 tokens), preempted by swapping to each rank's host
    tier and back: the same tokens as one rank."""
    import random

    rng = random.Random(3)
    reqs = [engine_request(f"w{i}", [rng.randrange(1, 128) for _ in range(rng.randint(10, 30))], 24,
                           ignore_eos=True, **({} if i % 2 else dict(temperature=0.8, seed=i)))
            for i in range(12)]

    def run(runner):
        engine = LocalEngine(runner, max_num_batched_tokens=32, preemption_mode="swap")
        for r in reqs:
            engine.add(r)
        return {k: v.token_ids for k, v in engine.run().items()}, engine.sched.counters["num_swap_outs"]

    ours, num_swap_outs = run(mqa_group.runner)
    assert num_swap_outs > 0
    assert ours == run(ModelRunner(config(mqa_model, num_host_blocks=64), mqa_model))[0]


def test_a_refused_plan_reaches_no_rank_and_the_group_serves_on(mqa_model, mqa_group):
    """A plan that does not fit is refused on rank 0 before the broadcast: no rank exits, and the
    group then samples what one rank samples."""
    bad = StepPlan(step_id=10**6, new_reqs=[NewRequestData(req_id="x", token_ids=[1, 2], num_prompt_tokens=2,
                                                            sampling=SamplingParams(temperature=0.0), block_ids=[96])],
                   num_scheduled_tokens={"x": 2}, finished_req_ids=["gone"])
    with pytest.raises(InvalidPlan, match="x: block id 96 is outside the pool"):
        mqa_group.runner.execute(bad)
    assert not mqa_group.failures
    reqs = requests()[:3]
    assert outputs(mqa_group.runner, reqs) == outputs(ModelRunner(config(mqa_model), mqa_model), reqs)


def _weight_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("which", ["even", "mqa"])
def test_each_rank_holds_its_share_of_the_weights(which, even_model, mqa_model, even_group, mqa_group):
    model_dir, group = (even_model, even_group) if which == "even" else (mqa_model, mqa_group)
    whole = ModelRunner(config(model_dir), model_dir).model
    spec = whole.spec
    # the parts every rank holds whole: norms and RoPE tables; K/V rows where KV heads are replicated
    replicated = _weight_bytes([whole.norm.weight, whole.rope_cos, whole.rope_sin])
    replicated += sum(_weight_bytes([layer.input_layernorm.weight, layer.post_attention_layernorm.weight])
                      for layer in whole.layers)
    kv_rows = 2 * spec.num_kv_heads * spec.head_dim * (spec.hidden_size + int(spec.qkv_bias)) * 4 * spec.num_layers
    if spec.num_kv_heads < 2:
        replicated += kv_rows
    padding = (-spec.vocab_size % 2) * spec.hidden_size * 4 * (1 if spec.tie_word_embeddings else 2)
    total = _weight_bytes(resident_tensors(whole))
    outputs(group.runner, [engine_request("w", PROMPTS[1], 2)])  # at least one step on every rank
    reports = group.runner.rank_reports()
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["device"] == "cpu" and report["num_steps"] > 0 and report["memory_bytes"] > 0
        assert report["weight_bytes"] <= (total - replicated) / 2 + replicated + padding, report
        assert report["weight_bytes"] < 0.75 * total  # a real split, not a copy
    # rank 0's own count agrees with what the group reports for it
    assert reports[0]["weight_bytes"] == _weight_bytes(resident_tensors(group.runner.runner.model))


def test_refuses_a_model_that_does_not_split(tmp_path):
    odd = write_tiny_model(tmp_path / "odd", num_attention_heads=4, num_key_value_heads=4, intermediate_size=95,
                           hidden_size=64)
    with pytest.raises(ValueError, match="intermediate size"):
        ParallelRunner(config(odd, 2), odd, on_failure=lambda reason: None)
    with pytest.raises(ValueError, match="does not shard yet"):
        from folio.core.executor.model.loader import load_model

        load_model(odd, torch.float32, torch.device("cpu"), "int8", shard=Shard(0, 2))
