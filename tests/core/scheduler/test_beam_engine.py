"""Beam search through the scheduler, the allocator's forks and the executor, against
``transformers`` ``generate(num_beams=...)``: the same beams come back, best first.

The engine (``engine.LocalEngine``) runs the real policy, allocator and model runner; beams are
sequences whose blocks are forked (copy-on-write) when a beam has several children and freed when
it has none."""

from __future__ import annotations

import pytest
import torch

from folio.testing.models import write_tiny_model
from tests.core.engine import LocalEngine, engine_request, make_runner

VOCAB, EOS = 48, 24  # a tiny model whose beams do end on EOS now and then


def hf_beam_search(model, prompt, width, n, length_penalty, early_stopping, max_new_tokens, eos):
    """The ``n`` best sequences of HF's beam search, generated tokens only (EOS kept, padding cut)."""
    from transformers import GenerationConfig

    config = GenerationConfig(num_beams=width, num_return_sequences=n, do_sample=False, length_penalty=length_penalty,
                              early_stopping=early_stopping, max_new_tokens=max_new_tokens, eos_token_id=eos,
                              pad_token_id=eos, return_dict_in_generate=True, output_scores=True)
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    return [out.sequences[i, len(prompt):len(prompt) + lengths[i]].tolist() for i in range(n)]


def folio_beam_search(runner, prompts, width, n, length_penalty, early_stopping, max_new_tokens, eos):
    engine = LocalEngine(runner)
    beam = {"use_beam_search": True, "n": n, "best_of": width, "length_penalty": length_penalty,
            "early_stopping": early_stopping}
    for p, prompt in enumerate(prompts):
        engine.add(engine_request(f"p{p}-0", prompt, max_new_tokens, eos_token_id=eos,
                                  fork_req_ids=[f"p{p}-{i}" for i in range(1, n)], **beam))
    outputs = engine.run()
    assert engine.alloc.num_used_blocks == 0  # dead beams and finished searches gave every block back
    return engine, [[outputs[f"p{p}-{i}"].token_ids for i in range(n)] for p in range(len(prompts))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = write_tiny_model(tmp_path_factory.mktemp("beam-engine"), vocab_size=VOCAB)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig()
    return model, make_runner(path, num_kv_blocks=128, block_size=4), path


@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (0.5, True), (2.0, "never"), (-0.5, False)])
def test_beams_equal_transformers_on_a_tiny_model(tiny, length_penalty, early_stopping):
    model, runner, _ = tiny
    prompts = [[1, 5, 9], [7, 3, 3, 30, 12, 40, 2], [11] * 9, [4, 8, 15, 16, 23, 42 % VOCAB]]
    engine, got = folio_beam_search(runner, prompts, 4, 3, length_penalty, early_stopping, 14, EOS)
    for prompt, beams in zip(prompts, got):
        assert beams == hf_beam_search(model, prompt, 4, 3, length_penalty, early_stopping, 14, EOS)
    assert engine.sched.counters["num_forks"] > 0  # beams did branch through forks
    assert engine.alloc.counters["num_cow_copies"] > 0  # block size 4: shared last blocks were copied


def test_beams_survive_preemption(tiny):
    """A pool too small for every beam at once: beams are preempted and recomputed, same beams."""
    model, _, path = tiny
    prompts = [[1, 5, 9, 13, 2, 2], [7, 3, 3, 30]]
    engine = LocalEngine(make_runner(path, num_kv_blocks=14, block_size=4), max_num_seqs=8)
    for p, prompt in enumerate(prompts):
        engine.add(engine_request(f"p{p}-0", prompt, 14, eos_token_id=EOS, fork_req_ids=[f"p{p}-1"],
                                  use_beam_search=True, n=2, best_of=4))
    outputs = engine.run()
    assert engine.sched.counters["num_preemptions"] > 0
    for p, prompt in enumerate(prompts):
        want = hf_beam_search(model, prompt, 4, 2, 1.0, False, 14, EOS)
        assert [outputs[f"p{p}-{i}"].token_ids for i in range(2)] == want


SMOLLM_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to code.",
    "Explain what a black hole is in one sentence.",
    "Translate 'good morning' into Spanish.",
]


@pytest.mark.slow
def test_beams_equal_transformers_on_smollm2(smollm_dir):
    """The issue's check: width 4 on SmolLM2-135M-Instruct, five chat prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    prompts = []
    for q in SMOLLM_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    model = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig()
    runner = make_runner(smollm_dir, num_kv_blocks=256)
    settings = [(1.0, False), (1.0, True), (0.6, "never"), (1.0, False), (2.0, True)]
    for prompt, (lp, es) in zip(prompts, settings):
        _, (got,) = folio_beam_search(runner, [prompt], 4, 4, lp, es, 20, tok.eos_token_id)
        assert got == hf_beam_search(model, prompt, 4, 4, lp, es, 20, tok.eos_token_id), tok.decode(prompt)
