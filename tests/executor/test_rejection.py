"""The speculative verifier keeps the target's distribution exactly, matches plain greedy decoding
token for token, and reproduces seeded requests whatever the batch.

The statistical tests use a model that is fixed per position (the same logits at position j
whatever came before) and no penalties, so the target at the second position does not depend on
the first token: plain decoding would draw its first two tokens from p0 x p1. A verification that
stops after one token leaves the second to the next step, so each test runs that next step (a
verification at position 1) for the requests that got one token, then compares the first tokens
with p0 and the pairs with p0 x p1. (Comparing only the pairs that one verification produced would
be wrong: those are the requests whose first draft was accepted, and that event depends on the
first token; given it, the second token follows p1.)

Wrong rules these tests catch, each checked by breaking a scratch copy of rejection.py (or of
processed_probs in sampler.py) and running this module:
- accepting with probability p(x) (ignoring q), or min(1, q(x)/p(x)): the chi-square tests;
- resampling from p, or from max(0, q - p), instead of max(0, p - q): the chi-square tests;
- the target without top_p, or without temperature: the chi-square tests (their expected
  distribution is worked out independently, by ``target_probs``);
- the point-mass case resampling from p with the draft left in: the point-mass tests (this needs
  non-uniform proposals: with uniform ones that wrong rule happens to be exact);
- the bonus token taken from the last draft's row: the k = 1 chi-square tests, the greedy test and
  the seeded bonus test;
- drafts kept after the first rejection: the k = 2 chi-square tests and the greedy test;
- the target at position j not seeing drafts[:j] in its history, or greedy comparing with the raw
  rather than the penalised argmax: the greedy penalty test;
- a seeded position reseeded with the wrong output index, or once per request rather than per
  position: the seeded bonus test; seeded rows drawing from the global RNG: both seeded tests;
- no fallback to p when max(0, p - q) is empty: the fallback test.
Not caught, because not wrong: accepting when u < p/q without the min (the same event as
u < min(1, p/q) for u in [0, 1)), and drawing a seeded draft position's uniform before its noise
rather than after (either order is reproducible; the bonus row draws noise alone either way).
"""

from __future__ import annotations

import math

import pytest
import torch

from folio.core.executor.sampling.rejection import num_accepted, verify
from folio.core.executor.sampling.sampler import SamplingRow, make_generator, processed_probs, sample
from folio.shared.sampling import SamplingParams

VOCAB = 6
NUM_SAMPLES = 20_000
CPU = torch.device("cpu")


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df), exact for integer df (scipy is not installed): the upper
    regularised gamma Q(df/2, x/2), climbed from Q(1, y) = e^-y or Q(1/2, y) = erfc(sqrt(y)) by
    Q(s + 1, y) = Q(s, y) + y^s e^-y / Gamma(s + 1)."""
    if x <= 0:
        return 1.0
    y = x / 2
    s, q = (1.0, math.exp(-y)) if df % 2 == 0 else (0.5, math.erfc(math.sqrt(y)))
    while s < df / 2:
        q += math.exp(s * math.log(y) - y - math.lgamma(s + 1))
        s += 1
    return q


def test_chi2_sf_matches_tables():
    assert chi2_sf(16.266, 3) == pytest.approx(1e-3, rel=1e-3)
    assert chi2_sf(20.515, 5) == pytest.approx(1e-3, rel=1e-3)
    assert chi2_sf(9.488, 4) == pytest.approx(0.05, rel=1e-3)
    assert chi2_sf(66.619, 35) == pytest.approx(1e-3, rel=2e-3)
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, rel=1e-3)


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor):
    """``tokens`` (flat ids) are draws from ``probs`` (flat): nothing outside its support, and a
    chi-square p-value above 1e-3."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token the target rules out was emitted"
    expected = probs[support].double() * tokens.numel()
    assert expected.min() >= 5, "test design: too few expected draws in a cell for the chi-square"
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2_sf(chi2, int(support.sum()) - 1) > 1e-3, f"chi2={chi2:.1f} with {int(support.sum()) - 1} dof"


# the position-wise model: target logits per position, and a draft that prefers the reverse order
TARGET = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3)) * 0.8
DRAFT = -TARGET + 0.3 * torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4))


def step(params: SamplingParams, k: int, start: int, n: int, point_mass: bool) -> list[list[int]]:
    """One verification of k drafts at positions start .. start + k - 1 for n requests at once."""
    rows = [SamplingRow(params, None, [], []) for _ in range(n)]
    target = TARGET[start : start + k + 1].repeat(n, 1)
    q = processed_probs(DRAFT[start : start + k], rows[:1] * k)  # [k, vocab]
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True) for j in range(k)], dim=1).tolist()
    # an n-gram proposer says nothing of q; its tokens still come from somewhere, and not uniformly:
    # from uniform proposals even "resample from p with the draft left in" would come out exact
    return verify(target, drafts, [None if point_mass else q] * n, rows)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target distribution worked out here rather than with ``processed_probs``, so that a
    verifier (or a processed_probs) that drops temperature or top_p cannot agree with itself."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order] = mass_before < params.top_p
    probs = probs * keep
    return (probs / probs.sum()).float()


def first_two_tokens(params: SamplingParams, k: int, point_mass: bool) -> tuple[torch.Tensor, torch.Tensor]:
    outputs = step(params, k, 0, NUM_SAMPLES, point_mass)
    short = [i for i, out in enumerate(outputs) if len(out) == 1]
    for i, out in zip(short, step(params, k, 1, len(short), point_mass)):
        outputs[i] = outputs[i] + out
    first = torch.tensor([out[0] for out in outputs])
    second = torch.tensor([out[1] for out in outputs])
    return first, second


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft_model", "point_mass"])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.8)],
    ids=["t1", "t0.7", "top_p0.8"],
)
@pytest.mark.parametrize("k", [1, 2])
def test_output_follows_the_target_distribution(k, params, point_mass):
    torch.manual_seed(100 * k + int(params.temperature * 10) + int(point_mass))
    first, second = first_two_tokens(params, k, point_mass)
    p = [target_probs(TARGET[j], params) for j in range(2)]
    assert (p[0] == 0).any() == (params.top_p < 1)  # the nucleus cut does cut here
    assert_follows(first, p[0])
    assert_follows(first * VOCAB + second, (p[0][:, None] * p[1][None, :]).flatten())


def test_the_draft_model_case_is_not_trivially_accepted():
    """The chi-square tests mean something only if drafts are rejected often and accepted often."""
    torch.manual_seed(0)
    outputs = step(SamplingParams(temperature=1.0), 2, 0, 2000, point_mass=False)
    accepted = torch.tensor(num_accepted(outputs))
    assert 0.2 < (accepted == 0).float().mean() < 0.8
    assert (accepted == 2).float().mean() > 0.05


# greedy: exactly plain greedy decoding


def greedy_walk(logits: torch.Tensor, row: SamplingRow) -> list[int]:
    """Plain decoding with ``sample``: one token per position, each seeing the ones before."""
    out: list[int] = []
    for j in range(logits.shape[0]):
        step_row = SamplingRow(row.params, None, row.prompt_token_ids, row.output_token_ids + out)
        out += sample(logits[j : j + 1], [step_row]).token_ids
    return out


def random_logits(num_positions: int, seed: int) -> torch.Tensor:
    return torch.randn(num_positions, 50, generator=torch.Generator().manual_seed(seed)) * 3


def competing_logits(num_positions: int, seed: int) -> torch.Tensor:
    """Three tokens well ahead of the rest at every position: penalties on the ones already
    emitted decide which of them wins, so a verifier blind to the drafts gets them wrong."""
    logits = torch.randn(num_positions, 50, generator=torch.Generator().manual_seed(seed)) * 0.1
    logits[:, 5] += 3.0
    logits[:, 9] += 2.6
    logits[:, 2] += 2.2
    return logits


def test_greedy_equals_plain_greedy_decoding_with_and_without_penalties():
    k = 4
    cases = [  # (params, prompt, output so far, logits)
        (SamplingParams(temperature=0.0), [1, 2], [], random_logits(k + 1, seed=1)),
        (SamplingParams(temperature=0.0, frequency_penalty=0.5), [1], [9], competing_logits(k + 1, 2)),
        (SamplingParams(temperature=0.0, repetition_penalty=1.5), [2, 30], [], competing_logits(k + 1, 3)),
    ]
    for params, prompt, output, logits in cases[1:]:
        unpenalised = greedy_walk(logits, SamplingRow(SamplingParams(temperature=0.0), None, prompt, output))
        assert greedy_walk(logits, SamplingRow(params, None, prompt, output)) != unpenalised  # penalties matter
    rows, logits_rows, drafts, expected = [], [], [], []
    for params, prompt, output, logits in cases:
        row = SamplingRow(params, None, prompt, output)
        walk = greedy_walk(logits, row)  # k + 1 tokens
        for wrong in range(k + 1):  # the first wrong draft; k: all k drafts right, then the bonus
            d = walk[:wrong]
            if wrong < k:  # sometimes a draft after the wrong one, which must be dropped
                d = d + [(walk[wrong] + 1) % 50] + walk[wrong + 1 : min(wrong + 1 + wrong % 2, k)]
            rows.append(row)
            logits_rows.append(logits[: len(d) + 1])
            drafts.append(d)
            expected.append(walk[: wrong + 1])
    probs = [None if i % 2 else torch.full((len(d), 50), 1 / 50) for i, d in enumerate(drafts)]  # q is ignored
    got = verify(torch.cat(logits_rows), drafts, probs, rows)
    assert got == expected
    assert num_accepted(got) == [len(e) - 1 for e in expected]


def test_greedy_rows_are_exact_inside_a_sampled_batch():
    logits = random_logits(3, seed=7)
    walk = greedy_walk(logits, SamplingRow(SamplingParams(temperature=0.0), None, [], []))
    sampled = SamplingRow(SamplingParams(temperature=1.0), None, [], [])
    greedy = SamplingRow(SamplingParams(temperature=0.0), None, [], [])
    batch = torch.cat([logits[:2], logits, logits[:1]])
    got = verify(batch, [[3], [walk[0], (walk[1] + 1) % 50], []], [None, None, None], [sampled, greedy, sampled])
    assert got[1] == walk[:2]
    assert len(got[0]) in (1, 2) and len(got[2]) == 1


# seeds


def seeded_case(trial: int, seed: int, generator: torch.Generator | None = None):
    """A seeded request at output position ``trial`` with 3 drafts sampled from q."""
    g = torch.Generator().manual_seed(trial)
    logits = torch.randn(4, 30, generator=g) * 2
    params = SamplingParams(temperature=1.0, top_k=20, seed=seed)
    row = SamplingRow(params, generator or make_generator(seed, CPU), [7], [1] * trial)
    q = torch.softmax(torch.randn(3, 30, generator=g) * 2, dim=-1)
    drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(3)]
    return logits, drafts, q, row


def test_a_seeded_request_draws_the_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    others = [(torch.randn(k + 1, 30), torch.randint(0, 30, (k,)).tolist()) for k in (0, 2, 5, 1)]
    other_row = SamplingRow(SamplingParams(temperature=1.0), None, [], [])
    shared_gen = make_generator(1234, CPU)
    alone, crowded = [], []
    for trial in range(30):
        logits, drafts, q, row = seeded_case(trial, 1234, shared_gen)
        alone.append(verify(logits, [drafts], [q], [row])[0])
        at = trial % (len(others) + 1)
        batch = others[:at] + [(logits, drafts)] + others[at:]
        probs = [None] * at + [q] + [None] * (len(others) - at)
        rows = [other_row] * at + [row] + [other_row] * (len(others) - at)
        out = verify(torch.cat([b[0] for b in batch]), [b[1] for b in batch], probs, rows)
        crowded.append(out[at])
    assert alone == crowded
    assert len({len(a) for a in alone}) > 1  # both early rejections and long acceptances happened
    restarted = []
    for trial in range(30):
        logits, drafts, q, row = seeded_case(trial, 1234)  # a fresh generator each time
        restarted += verify(logits, [drafts], [q], [row])
    assert restarted == alone  # a fresh generator (preempted, restarted executor) draws the same
    other_seed = []
    for trial in range(30):
        logits, drafts, q, row = seeded_case(trial, 99)
        other_seed += verify(logits, [drafts], [q], [row])
    assert other_seed != alone


def test_the_bonus_token_of_a_seeded_request_is_the_one_sample_draws():
    """With q = p every draft is accepted (u * p(x) < p(x)), so the output is drafts + the token
    ``sample`` draws at the bonus position with the same seed and history; with no drafts it is
    ``sample``'s token outright."""
    for trial in range(10):
        logits, _, _, row = seeded_case(trial, 55)
        k = trial % 4
        drafts = logits[:k].argmax(dim=-1).tolist()  # inside top_k, so p > 0 there
        q = processed_probs(logits[:k], [row] * k) if k else None  # no penalties: p at each draft
        out = verify(logits[: k + 1], [drafts], [q], [row])[0]
        history = SamplingRow(row.params, make_generator(55, CPU), row.prompt_token_ids, row.output_token_ids + drafts)
        assert out == drafts + sample(logits[k : k + 1], [history]).token_ids


def test_a_residual_with_no_mass_left_falls_back_to_p():
    """q at or above p everywhere (rounding, or a proposer whose rows do not quite sum to 1)
    leaves max(0, p - q) empty after a rejection; the token must still come from p, not be
    argmax over zeros (token 0, which p rules out here)."""
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 0.0, 3.0, 2.0, 0.0, 0.0]]).repeat(2, 1)
    params = SamplingParams(temperature=1.0, top_k=2)
    q = processed_probs(logits[:1], [SamplingRow(params, None, [], [])]) * 1.5  # [1, vocab], > p on {2, 3}
    rows = [SamplingRow(params, None, [], [])] * 400
    out = verify(logits.repeat(400, 1), [[2]] * 400, [q] * 400, rows)
    assert any(len(o) == 1 for o in out)  # rejections happened (u * 1.5 p(2) >= p(2) a third of the time)
    assert {o[-1] for o in out} <= {2, 3}


def test_shapes_are_checked():
    row = SamplingRow(SamplingParams(), None, [], [])
    with pytest.raises(ValueError):
        verify(torch.zeros(2, VOCAB), [[1, 2]], [None], [row])  # three rows needed
    with pytest.raises(ValueError):
        verify(torch.zeros(3, VOCAB), [[1, 2]], [torch.full((1, VOCAB), 1 / VOCAB)], [row])
