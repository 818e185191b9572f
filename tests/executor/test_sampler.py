"""Each sampler option does what it says, on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from folio.core.executor.sampling.sampler import SamplingRow, make_generator, sample
from folio.shared.sampling import SamplingParams

VOCAB = 50


def rows_of(params: SamplingParams, n: int, seed_each: bool = False, prompt=(), output=()):
    return [
        SamplingRow(params, make_generator(params.seed, torch.device("cpu")) if seed_each else None, list(prompt), list(output))
        for _ in range(n)
    ]


def logits_batch(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = logits_batch(8)
    out = sample(logits, rows_of(SamplingParams(temperature=0.0), 8))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_never_leaves_the_k_best():
    logits = logits_batch(1).repeat(400, 1)
    out = sample(logits, rows_of(SamplingParams(temperature=5.0, top_k=3), 400))
    best = set(logits[0].topk(3).indices.tolist())
    assert set(out.token_ids) <= best
    assert len(set(out.token_ids)) == 3  # at this temperature all three turn up


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, :4] = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)])
    out = sample(logits.repeat(500, 1), rows_of(SamplingParams(temperature=1.0, top_p=0.75), 500))
    assert set(out.token_ids) == {0, 1}  # 0.5 + 0.3 passes 0.75: token 2 is outside


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    logits = torch.full((1, VOCAB), -20.0)
    logits[0, :3] = torch.tensor([math.log(0.6), math.log(0.3), math.log(0.1)])
    out = sample(logits.repeat(500, 1), rows_of(SamplingParams(temperature=1.0, min_p=0.4), 500))
    assert set(out.token_ids) == {0, 1}  # 0.1 < 0.4 * 0.6


def test_temperature_sharpens_and_flattens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 2.0
    cold = sample(logits.repeat(1000, 1), rows_of(SamplingParams(temperature=0.1), 1000)).token_ids
    hot = sample(logits.repeat(1000, 1), rows_of(SamplingParams(temperature=10.0), 1000)).token_ids
    assert cold.count(0) > 990
    assert hot.count(0) < 100


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, :4] = probs.log()
    n = 8000
    drawn = sample(logits.repeat(n, 1), rows_of(SamplingParams(), n)).token_ids
    got = torch.bincount(torch.tensor(drawn), minlength=4)[:4]
    expected = probs * n
    chi2 = float(((got - expected) ** 2 / expected).sum())
    assert chi2 < 16.27  # p = 0.001 with 3 degrees of freedom


def test_seed_reproduces_whatever_else_is_in_the_batch():
    logits = logits_batch(6, seed=1)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    outputs = [[3] * n for n in range(12)]  # the draw depends on the output position
    gen = make_generator(1234, torch.device("cpu"))
    alone = [sample(logits[:1], [SamplingRow(seeded, gen, [], out)]).token_ids[0] for out in outputs]
    assert len(set(alone)) > 1
    crowded = []
    for step, out in enumerate(outputs):
        others = rows_of(SamplingParams(temperature=1.0), 5)
        mixed = others[:step % 5] + [SamplingRow(seeded, gen, [], out)] + others[step % 5 :]
        batch = torch.cat([logits[1 : 1 + step % 5], logits[:1], logits[1 + step % 5 :]])
        crowded.append(sample(batch, mixed).token_ids[step % 5])
    assert alone == crowded
    other = SamplingParams(temperature=1.0, seed=99)
    different = [sample(logits[:1], [SamplingRow(other, make_generator(99, torch.device("cpu")), [], out)]).token_ids[0]
                 for out in outputs]
    assert different != alone


def test_a_seeded_request_that_starts_over_draws_what_it_would_have_drawn():
    """Preemption, swapping and forks hand the request to a new generator mid-way."""
    logits = logits_batch(1, seed=2)
    seeded = SamplingParams(temperature=1.0, seed=7)
    gen = make_generator(7, torch.device("cpu"))
    straight = [sample(logits, [SamplingRow(seeded, gen, [], [0] * n)]).token_ids[0] for n in range(10)]
    resumed = [sample(logits, [SamplingRow(seeded, make_generator(7, torch.device("cpu")), [], [0] * n)]).token_ids[0]
               for n in range(10)]
    assert resumed == straight


def test_presence_and_frequency_penalties_push_repeated_tokens_down():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 1.0
    logits[0, 8] = 0.9
    plain = sample(logits, rows_of(SamplingParams(temperature=0.0), 1, output=[7])).token_ids
    presence = sample(logits, rows_of(SamplingParams(temperature=0.0, presence_penalty=0.5), 1, output=[7])).token_ids
    frequency = SamplingParams(temperature=0.0, frequency_penalty=0.05)
    freq_once = sample(logits, rows_of(frequency, 1, output=[7])).token_ids
    freq_thrice = sample(logits, rows_of(frequency, 1, output=[7, 7, 7])).token_ids
    assert plain == [7] and presence == [8]
    assert freq_once == [7] and freq_thrice == [8]  # 1.0 - 3*0.05 < 0.9


def test_repetition_penalty_covers_prompt_tokens_and_both_signs():
    logits = torch.zeros(1, VOCAB) - 5
    logits[0, 3], logits[0, 4] = 2.0, 1.5
    logits[0, 5], logits[0, 6] = -0.2, -0.3
    rp = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample(logits, rows_of(rp, 1, prompt=[3])).token_ids == [4]  # 2.0/2 < 1.5
    only_neg = logits.clone()
    only_neg[0, 3] = only_neg[0, 4] = -5
    # -0.2 * 2 = -0.4 falls below -0.3
    assert sample(only_neg, rows_of(rp, 1, prompt=[5])).token_ids == [6]


def test_logprobs_report_the_raw_distribution_with_ranks_and_top_n():
    logits = logits_batch(3, seed=5)
    params = SamplingParams(temperature=0.0, logprobs=4, presence_penalty=1.0)
    out = sample(logits, rows_of(params, 3))
    raw = logits.log_softmax(-1)
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(float(raw[i, lp.token_id]), abs=1e-6)
        assert lp.rank == 1
        assert lp.top_token_ids == raw[i].topk(4).indices.tolist()
        assert lp.top_logprobs == pytest.approx(raw[i].topk(4).values.tolist(), abs=1e-6)


def test_logprobs_only_for_rows_that_ask():
    logits = logits_batch(2)
    rows = rows_of(SamplingParams(temperature=0.0), 1) + rows_of(SamplingParams(temperature=0.0, logprobs=0), 1)
    out = sample(logits, rows)
    assert out.logprobs[0] is None
    assert out.logprobs[1].top_token_ids == [] and out.logprobs[1].rank == 1
