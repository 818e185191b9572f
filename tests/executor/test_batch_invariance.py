"""Batch invariance on the CPU (``--batch-invariant``, off by default): a token's logits do not depend
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
    return LLM(smollm_dir, quantization=request.param, batch_invariant=True, **ENGINE)


@pytest.mark.slow
def test_concurrent_streams_equal_their_solo_outputs(llm):
    solo = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    before = llm.stats()
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    after = llm.stats()
    assert after["num_preemptions"] > before["num_preemptions"], "the pool was meant to force preemptions"
    assert after["num_cached_tokens_total"] > before["num_cached_tokens_total"], "the prefix cache was warm"
    differ = [i for i, (a, b) in enumerate(zip(solo, together)) if list(a) != list(b)]
    assert not differ, f"streams {differ} changed in a batch of {len(PROMPTS)}"


@pytest.mark.slow
def test_prefilled_token_equals_decoded_token_bitwise(llm):
    decoded, prefilled = _decoded_and_prefilled(llm)
    assert prefilled == decoded


@pytest.mark.slow
def test_the_batch_dependent_kernels_fail_the_bitwise_check(smollm_dir):
    """The check above can fail: without batch invariance a prefilled token's logprobs differ."""
    decoded, prefilled = _decoded_and_prefilled(LLM(smollm_dir, batch_invariant=False, **ENGINE))
    assert prefilled != decoded


@pytest.mark.parametrize("num_threads", [2, 3, 16])
def test_attention_rows_shared_among_threads_are_bitwise_the_same(num_threads):
    """A step's rows split among threads (as a long prefill's are) give the single thread's bits."""
    import ctypes

    import numpy as np
    import torch

    from folio.core.executor.kernels import cpu_kernels

    lib = cpu_kernels.library()
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_heads, num_kv_heads, head_dim = 40, 16, 6, 2, 64
    k_cache, v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    tables = torch.randperm(num_blocks, generator=gen)[:36].view(2, 18).to(torch.int32).contiguous()
    # a prefill of 200 tokens (sequence 0, positions 0..199) and 3 decodes of sequence 1
    lens = np.array(list(range(1, 201)) + [250, 270, 288], dtype=np.int64)
    seq = np.array([0] * 200 + [1] * 3, dtype=np.int64)
    tok = np.arange(len(lens), dtype=np.int64)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    need = lib.folio_attention_scratch(num_heads // num_kv_heads, int(lens.max()))
    rows = cpu_kernels.Rows(m=len(lens), tok=tok.ctypes.data, seq=seq.ctypes.data, lens=lens.ctypes.data,
                            block_tables=tables.data_ptr(), num_seqs=tables.shape[0], max_blocks=tables.shape[1])
    kv = cpu_kernels.KV(k=k_cache.data_ptr(), v=v_cache.data_ptr(), num_blocks=num_blocks, block_size=block_size,
                        num_kv_heads=num_kv_heads, head_dim=head_dim)
    lib.folio_set_threads(num_threads)
    outs = []
    for threads in (1, num_threads):
        out, scratch = torch.empty_like(q), np.empty(threads * need, dtype=np.float32)
        cpu_kernels.check(lib, lib.folio_decode_attention(ctypes.byref(rows), q.data_ptr(), len(lens), num_heads,
                                                          ctypes.byref(kv), 0.125, 0, 0.0, out.data_ptr(),
                                                          scratch.ctypes.data, need, threads))
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    # and the kernel computes attention: row 199 (the prefill's last token) against the reference
    keys = torch.cat([k_cache[b] for b in tables[0, :13].long()])[:200]  # [200, kv_heads, head_dim]
    vals = torch.cat([v_cache[b] for b in tables[0, :13].long()])[:200]
    qh = q[199].view(num_kv_heads, 3, head_dim)
    p = torch.softmax(torch.einsum("ghd,kgd->ghk", qh, keys) * 0.125, dim=-1)
    torch.testing.assert_close(outs[0][199], torch.einsum("ghk,kgd->ghd", p, vals).reshape(num_heads, head_dim))
