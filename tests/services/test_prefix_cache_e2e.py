"""Prefix caching end to end with the real SmolLM2-135M-Instruct (fp32, CPU) on the real back half
(kvmanager + executor + scheduler over ipc://): a second request that shares a ~1,000-token prefix
computes only its own tail, and its greedy output equals the output with prefix caching off."""

from __future__ import annotations

import pytest

from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.sampling import SamplingParams
from folio.services.in_process import back_half

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    paragraph = ("The library keeps its oldest maps in a cold room below the reading hall, where the "
                 "archivists record every visitor, every map and every hour spent with it. ")
    prefix: list[int] = []
    while len(prefix) < 1000:
        prefix += tokenizer.encode(paragraph)
    prefix = prefix[:1000]
    tail_a = tokenizer.encode(" Question: which room holds the maps? Answer:")
    tail_b = tokenizer.encode(" Question: who records the visitors? Answer:")
    return prefix + tail_a, prefix + tail_b


@pytest.fixture(scope="module")
def runner(smollm_dir):
    return ModelRunner(RuntimeConfig(model=smollm_dir, dtype="float32", device="cpu", block_size=BLOCK_SIZE,
                                     num_kv_blocks=160, max_num_batched_tokens=2048), smollm_dir)


async def counters(bh) -> dict:
    return (await bh.admin("scheduler", "stats")).data


async def test_a_shared_prefix_is_computed_once_and_changes_nothing(smollm_dir, prompts, runner):
    prompt_a, prompt_b = prompts
    kwargs = dict(num_kv_blocks=160, block_size=BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=2048,
                  runner=runner)
    async with back_half(smollm_dir, **kwargs) as bh:
        await bh.submit("cached-a", prompt_a, GREEDY)
        await bh.collect(["cached-a"])
        before = await counters(bh)
        await bh.submit("cached-b", prompt_b, GREEDY)
        out_b = (await bh.collect(["cached-b"]))["cached-b"][0]
        after = await counters(bh)
        kv = (await bh.admin("kvmanager", "stats")).data
        deltas = [d for batch in bh.batches for d in batch.all_deltas() if d.req_id == "cached-b"]
    num_cached = after["num_cached_tokens_total"] - before["num_cached_tokens_total"]
    num_computed = after["num_scheduled_tokens_total"] - before["num_scheduled_tokens_total"]
    assert num_cached == 992  # 62 full blocks of the 1,000-token prefix
    assert num_computed == len(prompt_b) - 992 + GREEDY.max_tokens - 1  # the tail, then the decodes
    assert deltas[-1].num_cached_tokens == 992
    assert kv["num_prefix_cache_hits"] == 992 and kv["num_prefix_cache_queries"] == len(prompt_a) + len(prompt_b)

    async with back_half(smollm_dir, enable_prefix_caching=False, **kwargs) as bh:
        await bh.submit("plain-a", prompt_a, GREEDY)
        await bh.collect(["plain-a"])
        await bh.submit("plain-b", prompt_b, GREEDY)
        plain_b = (await bh.collect(["plain-b"]))["plain-b"][0]
        off = await counters(bh)
    assert off["num_cached_tokens_total"] == 0
    assert off["num_scheduled_tokens_total"] == len(prompt_a) + len(prompt_b) + 2 * (GREEDY.max_tokens - 1)
    assert out_b == plain_b and len(out_b) == GREEDY.max_tokens
