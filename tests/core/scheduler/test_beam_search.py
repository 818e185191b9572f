"""folio.core.scheduler.beam against transformers' own beam search.

A tiny random Llama with a 16-token vocabulary, whose EOS is one of its frequent tokens made a
little likelier still (its lm_head row scaled), so that beams end by EOS at various lengths, others
run to ``max_new_tokens``, and W hypotheses often finish early enough for the early-stopping rules
to change the outcome (the prompts were picked so that breaking any one rule fails some case).
``BeamSearch`` is driven by a plain loop (a full forward pass per step over the live beams, fp32
log_softmax, the top ``top_k`` per beam) and must return the same sequences, token for token, and
the same scores as ``model.generate(num_beams=...)``, over widths, length penalties and
early-stopping modes.
"""

from __future__ import annotations

import pytest
import torch

from folio.core.scheduler.beam import Beam, BeamSearch
from folio.testing.models import write_tiny_model

VOCAB = 16
EOS = 7  # among the tokens this model ranks high most often
EOS_BOOST = 1.6  # its lm_head row is scaled by this
EOS2 = 10  # a second EOS id for the multi-EOS case
MAX_NEW = 10
PROMPTS = [[15, 9, 11], [5, 15, 0, 0, 1, 12], [2, 4], [14, 5, 2, 4, 11, 12], [12, 13, 14, 2]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = write_tiny_model(tmp_path_factory.mktemp("beam-llama"), vocab_size=VOCAB)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    m.generation_config = GenerationConfig()  # inherit nothing (eos, processors) from the checkpoint
    with torch.no_grad():
        m.lm_head.weight[EOS] *= EOS_BOOST
    # one thread: for a model this small, intra-op threads only wait on each other (on a busy
    # machine a call took seconds instead of milliseconds)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield m
    torch.set_num_threads(threads)


def folio_beam_search(model, prompt, width, n, length_penalty, early_stopping, eos=(EOS,)):
    bs = BeamSearch(
        width,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        max_tokens=MAX_NEW,
        eos_token_ids=eos,
    )
    drive(model, prompt, bs)
    return bs.results(n)


def drive(model, prompt, bs: BeamSearch) -> int:
    """Run ``bs`` to the end; the number of steps it took."""
    steps = 0
    while not bs.done:
        steps += 1
        live = bs.beams
        ids = torch.tensor([prompt + b.output_token_ids for b in live])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids, use_cache=False).logits[:, -1, :].float(), dim=-1)
        top = logprobs.topk(bs.top_k, dim=-1)
        bs.step({b.beam_id: (top.indices[i].tolist(), top.values[i].tolist()) for i, b in enumerate(live)})
    return steps


def hf_beam_search(model, prompt, width, n, length_penalty, early_stopping, eos=(EOS,)):
    """(generated tokens, score) best first, as ``generate`` returns them."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        num_beams=width,
        num_return_sequences=n,
        do_sample=False,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        max_new_tokens=MAX_NEW,
        eos_token_id=list(eos),
        pad_token_id=eos[0],
        return_dict_in_generate=True,
        output_scores=True,
    )
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()  # each sequence's generated length
    generated = out.sequences[:, len(prompt) :].tolist()
    return [(row[:length], score) for row, length, score in zip(generated, lengths, out.sequences_scores.tolist())]


def assert_same(ours, theirs):
    assert len(ours) == len(theirs)
    for i, (hyp, (tokens, score)) in enumerate(zip(ours, theirs)):
        assert hyp.output_token_ids == tokens, f"hypothesis {i}: {ours} vs {theirs}"
        assert hyp.score == pytest.approx(score, rel=1e-6, abs=1e-5), f"hypothesis {i}: {ours} vs {theirs}"


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0, -0.5])
@pytest.mark.parametrize("width", [2, 4])
def test_matches_transformers(model, width, length_penalty, early_stopping):
    for i, prompt in enumerate(PROMPTS):
        n = [width, 1, width - 1][i % 3]
        ours = folio_beam_search(model, prompt, width, n, length_penalty, early_stopping)
        theirs = hf_beam_search(model, prompt, width, n, length_penalty, early_stopping)
        assert_same(ours, theirs)


@pytest.mark.parametrize("early_stopping", [False, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, -0.5])
@pytest.mark.parametrize("width", [2, 4])
def test_matches_transformers_with_two_eos_ids(model, width, length_penalty, early_stopping):
    eos = (EOS, EOS2)  # K = 3 * width candidates per step
    for prompt in PROMPTS[:3]:
        ours = folio_beam_search(model, prompt, width, width, length_penalty, early_stopping, eos=eos)
        theirs = hf_beam_search(model, prompt, width, width, length_penalty, early_stopping, eos=eos)
        assert_same(ours, theirs)


def test_the_sweep_ends_beams_both_by_eos_and_by_length(model):
    """Guards the comparison above: with this model and EOS, some returned hypotheses end on EOS
    before the limit and some run to it, and early stopping cuts some searches short."""
    reasons = set()
    for width in (2, 4):
        for prompt in PROMPTS:
            for hyp in folio_beam_search(model, prompt, width, width, 1.0, "never"):
                if hyp.finish_reason == "stop":
                    assert hyp.output_token_ids[-1] == EOS
                    reasons.add("stop early" if len(hyp.output_token_ids) < MAX_NEW else "stop")
                else:
                    assert len(hyp.output_token_ids) == MAX_NEW and EOS not in hyp.output_token_ids
                    reasons.add("length")
    assert {"stop early", "length"} <= reasons
    for early_stopping in (True, False):
        searches = [BeamSearch(4, early_stopping=early_stopping, max_tokens=MAX_NEW, eos_token_ids={EOS}) for _ in PROMPTS]
        steps = [drive(model, prompt, bs) for prompt, bs in zip(PROMPTS, searches)]
        assert min(steps) < MAX_NEW, early_stopping


def step(bs: BeamSearch, top: dict[int, list[tuple[int, float]]]):
    return bs.step({beam_id: ([t for t, _ in pairs], [lp for _, lp in pairs]) for beam_id, pairs in top.items()})


def test_eos_ranked_beyond_width_is_dropped_and_a_parent_without_child_is_freed():
    bs = BeamSearch(2, length_penalty=1.0, early_stopping=False, max_tokens=5, eos_token_ids={0})
    assert bs.top_k == 4
    # EOS (0) is the third candidate: beyond the width, it neither finishes nor continues
    d1 = step(bs, {0: [(5, -0.25), (6, -0.5), (0, -1.0), (7, -2.0)]})
    assert [(b.output_token_ids, b.cum_logprob, b.parent_beam_id) for b in d1.beams] == [
        ([5], -0.25, 0),
        ([6], -0.5, 0),
    ]
    assert d1.freed_beam_ids == [] and bs.finished == [] and not bs.done
    a, b = d1.beams
    # all four best candidates extend beam a: b gets no child; EOS ranked second finishes with
    # score (-0.25 - 0.5) / 2 generated tokens
    d2 = step(
        bs,
        {
            a.beam_id: [(1, -0.25), (0, -0.5), (2, -0.75), (3, -1.0)],
            b.beam_id: [(1, -1.5), (2, -2.0), (3, -2.5), (4, -3.0)],
        },
    )
    assert [(x.output_token_ids, x.cum_logprob, x.parent_beam_id) for x in d2.beams] == [
        ([5, 1], -0.5, a.beam_id),
        ([5, 2], -1.0, a.beam_id),
    ]
    assert d2.freed_beam_ids == [b.beam_id]
    assert len({x.beam_id for x in d2.beams} | {a.beam_id, b.beam_id}) == 4  # fresh ids
    assert bs.finished == [([5, 0], -0.375, "stop")]
    assert not bs.done  # one finished hypothesis, width two


def test_length_limit_finishes_the_first_width_candidates_and_ends():
    bs = BeamSearch(2, length_penalty=1.0, early_stopping=True, max_tokens=2, eos_token_ids={0})
    (root,) = bs.beams
    assert root == Beam(beam_id=0, output_token_ids=[], cum_logprob=0.0)
    d1 = step(bs, {0: [(3, -1.0), (0, -1.5), (4, -2.0), (5, -3.0)]})  # EOS finishes at -1.5 / 1
    x, y = d1.beams
    assert [b.output_token_ids for b in d1.beams] == [[3], [4]]
    d2 = step(
        bs,
        {
            x.beam_id: [(6, -0.5), (7, -2.5), (0, -3.0), (8, -4.0)],
            y.beam_id: [(9, -1.25), (6, -2.0), (0, -2.5), (8, -3.0)],
        },
    )
    assert bs.done and d2.beams == [] and sorted(d2.freed_beam_ids) == sorted([x.beam_id, y.beam_id])
    # candidates: [3,6] -1.5, [4,9] -3.25, [3,7] -3.5 ...: the first two finish by length at
    # cum / 2 (-0.75, -1.625); the EOS hypothesis from step one (-1.5 / 1) beats the second
    assert bs.results() == [([3, 6], -0.75, "length"), ([0], -1.5, "stop")]
    assert bs.results(1) == [([3, 6], -0.75, "length")]
    with pytest.raises(RuntimeError):
        bs.step({})
