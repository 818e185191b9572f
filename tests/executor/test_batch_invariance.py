"""Batch invariance on the CPU (``--batch-invariant``, on by default): a token's logits do not depend
on the batch it was computed in, on the chunk that held it, on prefill against decode, on prefix-cache
hits or on a recompute after preemption. Checked on the real default model (SmolLM2-135M, int4 with
bf16 activations, where a reordered reduction flips near ties) and on its fp32 dequantization:

- 32 concurrent greedy streams under a 64-token budget (every prompt is cut into chunks at other
  boundaries than alone), a 64-block pool (preemptions by recompute) and a warm prefix cache each
  equal the stream run alone;
- the logprobs of tokens that were decoded equal, bit for bit, those of the same tokens prefilled
  (``prompt_logprobs``), top alternatives included.

With ``batch_invariant=False`` (the batch-dependent kernels: SDPA for prefill chunks, a call-size
dependent LM head) the second check fails on this model.
"""

from __future__ import annotations

import pytest

from folio import LLM, SamplingParams

SYSTEM = ("You are a careful assistant for a small bakery. You answer questions about opening hours, bread, "
          "cakes and orders, politely and in short sentences, and you never invent prices. ") * 2
TOPICS = ["the moon", "bread", "rivers", "chess", "volcanoes", "owls", "copper", "tea", "glaciers", "bees",
          "trains", "coral", "maps", "salt", "wind", "paper"]
PROMPTS = [SYSTEM + f"Tell me one fact about {t}." for t in TOPICS] + \
          [f"Write a short story about {t} and a bridge, in three sentences, with a twist at the end." for t in TOPICS]
ENGINE = {"max_num_batched_tokens": 64, "num_kv_blocks": 64, "max_num_seqs": 32}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _logprob_rows(positions, token_ids):
    """[(chosen token's logprob, {token: logprob} of the alternatives)] per position, exact floats."""
    return [(pos[t].logprob, {k: v.logprob for k, v in pos.items()}) for pos, t in zip(positions, token_ids)]


def _decoded_and_prefilled(llm: LLM):
    """The logprob rows of 12 greedy tokens as decoded, and of the same tokens prefilled: sent
    again as prompt (in 64-token chunks, most of it a prefix hit) with ``prompt_logprobs``."""
    decoded = llm.generate([PROMPTS[17]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3),
                           use_tqdm=False)[0]
    out = decoded.outputs[0]
    ids = list(decoded.prompt_token_ids) + list(out.token_ids)
    prefilled = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=3),
                             use_tqdm=False)[0]
    return (_logprob_rows(out.logprobs, out.token_ids),
            _logprob_rows(prefilled.prompt_logprobs[-len(out.token_ids):], out.token_ids))


@pytest.fixture(scope="module", params=["auto", "none"], ids=["int4", "fp32"])
def llm(request, smollm_dir) -> LLM:
    return LLM(smollm_dir, quantization=request.param, **ENGINE)


def test_concurrent_streams_equal_their_solo_outputs(llm):
    solo = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    before = llm.stats()
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    after = llm.stats()
    assert after["num_preemptions"] > before["num_preemptions"], "the pool was meant to force preemptions"
    assert after["num_cached_tokens_total"] > before["num_cached_tokens_total"], "the prefix cache was warm"
    differ = [i for i, (a, b) in enumerate(zip(solo, together)) if list(a) != list(b)]
    assert not differ, f"streams {differ} changed in a batch of {len(PROMPTS)}"


def test_prefilled_token_equals_decoded_token_bitwise(llm):
    decoded, prefilled = _decoded_and_prefilled(llm)
    assert prefilled == decoded


def test_the_batch_dependent_kernels_fail_the_bitwise_check(smollm_dir):
    """The check above can fail: without batch invariance a prefilled token's logprobs differ."""
    decoded, prefilled = _decoded_and_prefilled(LLM(smollm_dir, batch_invariant=False, **ENGINE))
    assert prefilled != decoded
