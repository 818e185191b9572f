"""The correctness oracle: folio's greedy output equals transformers' on SmolLM2-135M-Instruct (fp32).

Eight varied prompts (chat-templated and raw, short and a few hundred tokens), 64 new tokens each,
EOS not stopping either side. The same outputs must come back when the prompts run alone, all
together in one varlen batch, fed in chunks of 7 tokens, and with block sizes 8, 16 and 32, on
the default path (torch/SDPA) and with ``batch_invariant`` (the per-row C kernels).
"""

from __future__ import annotations

import pytest
import torch

from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.sampling import SamplingParams
from tests.executor.toy_driver import generate

pytestmark = pytest.mark.slow

NUM_NEW = 64
# Two top logits closer than this are a near-tie that fp32 rounding may order either way.
NEAR_TIE = 1e-3

DOC = (
    "The Amazon rainforest covers much of the Amazon basin of South America. This basin "
    "encompasses seven million square kilometres, of which five and a half million are covered "
    "by the rainforest. The region includes territory belonging to nine nations. The majority of "
    "the forest is contained within Brazil, with 60% of the rainforest, followed by Peru with 13%, "
    "Colombia with 10%, and with minor amounts in Bolivia, Ecuador, French Guiana, Guyana, "
    "Suriname, and Venezuela. "
)


def build_prompts(tokenizer) -> list[list[int]]:
    def chat(text, system=None):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    raw = [
        tokenizer.encode("The quick brown fox"),
        tokenizer.encode("def fibonacci(n):\n    "),
        tokenizer.encode("Once upon a time, in a small village by the sea, there lived"),
        tokenizer.encode(DOC * 3 + "\nIn summary, the Amazon"),
    ]
    templated = [
        chat("What is the capital of France?"),
        chat("Write a haiku about autumn leaves."),
        chat("Summarize this text in two sentences:\n" + DOC * 4, system="You are a concise assistant."),
        chat("List three prime numbers and explain why they are prime."),
    ]
    return raw + templated


@pytest.fixture(scope="module")
def case(smollm_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    prompts = build_prompts(tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = tokenizer.eos_token_id
    expected = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            # an explicit mask: chat prompts contain <|im_end|>, which is also the pad token
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW, do_sample=False)
            expected.append(out[0, len(p) :].tolist())
    return hf, prompts, expected


def assert_same_or_near_tie(hf, prompt, expected, got):
    """Equal token for token; should they part, the reference's two best logits at that
    position must be within float rounding of each other (anything else is a bug)."""
    if got == expected:
        return
    i = next(j for j, (a, b) in enumerate(zip(expected, got)) if a != b)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + expected[:i]])).logits[0, -1]
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, f"diverged at new token {i} with a top-2 logit gap of {gap:.2e}"


def test_prompts_are_varied(case):
    _, prompts, _ = case
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] < 20 and lengths[-1] > 300


def run(smollm_dir, prompts, block_size=16, chunk_size=None, alone=False, batch_invariant=False):
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=600, block_size=block_size, quantization="none",
                                       batch_invariant=batch_invariant), smollm_dir)
    assert runner.backend.name == ("cpu" if batch_invariant else "torch")
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    if alone:
        return [generate(runner, [p], params)[0] for p in prompts]
    return generate(runner, prompts, params, chunk_size=chunk_size)


@pytest.mark.parametrize(
    "mode",
    ["alone", "batched", "chunked-7", "block-8", "block-32"],
)
def test_greedy_equals_transformers(case, smollm_dir, mode, batch_invariant):
    hf, prompts, expected = case
    kwargs = {
        "alone": dict(alone=True),
        "batched": {},
        "chunked-7": dict(chunk_size=7),
        "block-8": dict(block_size=8),
        "block-32": dict(block_size=32, chunk_size=7),
    }[mode]
    outputs = run(smollm_dir, prompts, batch_invariant=batch_invariant, **kwargs)
    for prompt, exp, got in zip(prompts, expected, outputs):
        assert len(got) == NUM_NEW
        assert_same_or_near_tie(hf, prompt, exp, got)
