"""The runtime's step semantics on a tiny random model: batching, chunking, block layouts, seeds,
logprobs, pool sizing and clear errors."""

from __future__ import annotations

import random

import pytest
import torch

from folio.core.executor.runtime.plan_check import InvalidPlan
from folio.core.kv.tensors.pool import PoolShape, blocks_for_budget, cpu_kv_budget_bytes, gpu_num_blocks
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.messages import NewRequestData, StepPlan
from folio.shared.sampling import SamplingParams
from tests.executor.toy_driver import generate

PROMPTS = [[5, 9, 14, 2, 77, 3], list(range(10, 50)), [101], [7] * 19, [60, 61, 62, 63, 64, 65, 66, 67, 68]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def runner_for(model_dir, **kw) -> ModelRunner:
    return ModelRunner(RuntimeConfig(num_kv_blocks=kw.pop("num_kv_blocks", 64), **kw), model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    runner = runner_for(tiny_model_dir)
    return [generate(runner, [p], GREEDY)[0] for p in PROMPTS]


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("chunk_size", [None, 7, 1])
def test_batched_chunked_and_block_sizes_agree(tiny_model_dir, reference, block_size, chunk_size):
    runner = runner_for(tiny_model_dir, block_size=block_size)
    order = list(range(runner.pool.num_blocks))
    random.Random(block_size).shuffle(order)  # scattered, non-contiguous blocks
    assert generate(runner, PROMPTS, GREEDY, chunk_size=chunk_size, block_order=order) == reference


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_model_dir):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16)
    runner = runner_for(tiny_model_dir)
    alone = generate(runner, [PROMPTS[0]], seeded)[0]
    others = SamplingParams(temperature=1.2, max_tokens=16)
    crowded = generate(runner, PROMPTS[1:3] + [PROMPTS[0]] + PROMPTS[3:], [others, others, seeded, others, others])
    assert crowded[2] == alone
    reseeded = SamplingParams(temperature=1.0, top_p=0.9, seed=43, max_tokens=16)
    assert generate(runner, [PROMPTS[0]], reseeded)[0] != alone


def test_prompt_logprobs_match_a_full_forward_across_chunks(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[1]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    runner = runner_for(tiny_model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2, logprobs=3)
    result = None
    for step, (start, n) in enumerate([(0, 15), (15, 15), (30, 10)]):
        new = [NewRequestData(req_id="r", token_ids=prompt, num_prompt_tokens=len(prompt), sampling=params,
                              block_ids=[0, 1, 2])] if step == 0 else []
        from folio.shared.messages import RunningRequestData

        running = [] if step == 0 else [RunningRequestData(req_id="r", new_block_ids=[], num_computed_tokens=start)]
        result = runner.execute(StepPlan(step_id=step, new_reqs=new, running_reqs=running, num_scheduled_tokens={"r": n}))
        if step < 2:
            assert result.req_ids == [] and result.prompt_logprobs == {}
    lps = result.prompt_logprobs["r"]
    assert len(lps) == len(prompt) and lps[0] is None
    for i in range(1, len(prompt)):
        assert lps[i].token_id == prompt[i]
        assert lps[i].logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)
        assert lps[i].top_token_ids == ref[i - 1].topk(2).indices.tolist()
    sampled = result.logprobs[0][0]
    assert sampled.token_id == result.token_ids[0] == int(ref[-1].argmax())
    assert len(sampled.top_token_ids) == 3 and sampled.rank == 1


def test_bad_plans_are_clear_errors(tiny_model_dir):
    runner = runner_for(tiny_model_dir, block_size=8)
    new = NewRequestData(req_id="a", token_ids=[1, 2, 3], num_prompt_tokens=3, sampling=GREEDY, block_ids=[0])
    with pytest.raises(InvalidPlan, match="only 3 to compute"):
        runner.execute(StepPlan(step_id=0, new_reqs=[new], num_scheduled_tokens={"a": 4}))
    long = NewRequestData(req_id="b", token_ids=list(range(20)), num_prompt_tokens=20, sampling=GREEDY, block_ids=[1])
    with pytest.raises(InvalidPlan, match="need more than its 1 blocks"):
        runner.execute(StepPlan(step_id=1, new_reqs=[long], num_scheduled_tokens={"b": 20}))
    from folio.shared.messages import RunningRequestData

    with pytest.raises(InvalidPlan, match="unknown request 'zzz'"):
        runner.execute(StepPlan(step_id=2, running_reqs=[RunningRequestData(req_id="zzz", new_block_ids=[], num_computed_tokens=0)]))
    assert runner.requests == {} and runner.batch.row_of == {}  # nothing of the refused plans was applied


def test_pool_is_allocated_once_in_the_vllm_layout(tiny_model_dir):
    runner = runner_for(tiny_model_dir, num_kv_blocks=10, block_size=16)
    spec = runner.spec
    assert len(runner.pool.kv_caches) == spec.num_layers
    for k, v in runner.pool.kv_caches:
        assert k.shape == v.shape == (10, 16, spec.num_kv_heads, spec.head_dim)
    assert runner.pool.num_bytes == 10 * 2 * spec.num_layers * 16 * spec.num_kv_heads * spec.head_dim * 4


def test_cpu_pool_sizing_from_a_byte_budget(tiny_model_dir):
    shape = PoolShape(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    assert shape.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 4
    assert blocks_for_budget(100 * shape.bytes_per_block + 5, shape) == 100
    assert cpu_kv_budget_bytes(available=8 << 30) == 2 << 30
    assert cpu_kv_budget_bytes(available=64 << 30) == 4 << 30  # capped
    runner = ModelRunner(RuntimeConfig(kv_cache_bytes=1 << 20, block_size=16), tiny_model_dir)
    assert runner.pool.num_blocks == (1 << 20) // runner.pool_shape.bytes_per_block


def test_gpu_pool_sizing_rule():
    shape = PoolShape(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    per_block = shape.bytes_per_block
    assert gpu_num_blocks(80 << 30, 0.5, 10 << 30, shape) == ((40 << 30) - (10 << 30)) // per_block
    with pytest.raises(RuntimeError, match="no GPU memory left for the KV cache"):
        gpu_num_blocks(16 << 30, 0.5, 9 << 30, shape)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        gpu_num_blocks(16 << 30, 1.5, 0, shape)


def test_dtype_and_backend_choices_are_checked(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        ModelRunner(RuntimeConfig(num_kv_blocks=4, dtype="float8"), tiny_model_dir)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ModelRunner(RuntimeConfig(num_kv_blocks=4, attention_backend="cuda", device="cpu"), tiny_model_dir)
    bf16 = ModelRunner(RuntimeConfig(num_kv_blocks=8, dtype="bfloat16"), tiny_model_dir)
    assert bf16.pool.kv_caches[0][0].dtype == torch.bfloat16
    out = generate(bf16, [PROMPTS[0]], GREEDY)[0]
    assert len(out) == GREEDY.max_tokens


def test_the_c_kernel_over_the_persistent_rows_draws_what_the_per_call_sampler_draws(tiny_model_dir):
    """On the CPU the runner samples plain rows through ``cpu_kernels.TableSampler`` (parameters
    and penalty state read in place, tokens recorded in the same call). Under the same torch seed
    the runner gives the same tokens without it (the gathered-rows path: ``sample_batch`` with the
    penalty state gathered, then recorded), greedy and sampled, with and without penalties."""
    params = [SamplingParams(temperature=0.0, presence_penalty=0.8, repetition_penalty=1.4, max_tokens=14),
              SamplingParams(temperature=0.9, top_p=0.9, frequency_penalty=0.5, max_tokens=14),
              SamplingParams(temperature=1.1, min_p=0.05, max_tokens=14),
              SamplingParams(temperature=0.0, max_tokens=14),
              SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=0.7, presence_penalty=-0.3, max_tokens=9)]
    outputs = []
    for table in (True, False):
        runner = runner_for(tiny_model_dir)
        assert runner.table_sampler is not None
        if not table:
            runner.table_sampler = None
        torch.manual_seed(11)
        outputs.append(generate(runner, PROMPTS, params))
    assert outputs[0] == outputs[1]
    assert len({tuple(o) for o in outputs[0]}) == len(PROMPTS)
