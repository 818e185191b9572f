"""The batched sampler against the per-row sampler it replaced (tests/executor/reference_sampler.py):
the same greedy tokens, the same processed distributions, draws (seeded or not) inside the kept
set, and draws that follow the distribution (chi-square), through the kernel, the window, the
full-row and the sorted-row paths. (Seeded draws no longer equal the reference's exponential race:
they come from counter-based uniforms, ``philox.py``; tests/executor/test_sampler_seeded.py checks them.)"""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch

from folio.core.executor.kernels.sampler_columns import column_values
from folio.core.executor.sampling import sampler
from folio.core.executor.sampling.penalties import PenaltyState
from folio.core.executor.sampling.sampler import SamplingBatch, SamplingRow, make_generator, processed_probs, sample
from folio.shared.sampling import SamplingParams
from tests.executor import reference_sampler as ref

CPU = torch.device("cpu")
VOCAB = 600


def random_params(rng: random.Random, seeded: bool) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.5, 0.8, 1.0, 1.7]),
        top_p=rng.choice([1.0, 1.0, 0.95, 0.6, 0.3]),
        top_k=rng.choice([0, 0, 1, 5, 40, 400]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        presence_penalty=rng.choice([0.0, 0.0, 0.7]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3]),
        seed=rng.randrange(2**40) if seeded else None,
    )


def random_case(seed: int, n: int, seeded: bool):
    rng = random.Random(seed)
    params = [random_params(rng, seeded) for _ in range(n)]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))] for _ in range(n)]
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))] for _ in range(n)]
    # peaked rows (a nucleus inside the window) and flat ones (past it)
    scale = torch.tensor([rng.choice([0.5, 3.0, 8.0]) for _ in range(n)])[:, None]
    logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale
    return logits, params, prompts, outputs


def rows_for(module, params, prompts, outputs):
    return [module.SamplingRow(p, make_generator(p.seed, CPU), pr, out) for p, pr, out in zip(params, prompts, outputs)]


def test_splitmix64_mix_gives_the_published_stream():
    """The oracle's mix is splitmix64's: seeded with 1234567, the generator's first five outputs
    (state += GAMMA, then mix) are the published ones."""
    states = np.uint64(1234567) + ref.GAMMA * np.arange(1, 6, dtype=np.uint64)
    assert ref.splitmix64_mix(states).tolist() == [6457827717110365317, 3203168211198807973, 9817491932198370423,
                                                   4593380528125082431, 16408922859458223821]


@pytest.mark.parametrize("seed", [0, 1, 7, 2**40 + 3, 2**63 - 1, 2**64 - 1, -5])
def test_draw_seeds_equal_the_oracles_keys(seed):
    positions = np.array([0, 1, 2, 3, 17, 255, 4096, 2**31 + 1])
    keys = ref.draw_keys(seed, positions).tolist()
    assert [sampler.position_seed(seed, int(p)) for p in positions] == keys
    assert len(set(keys)) == len(keys)


def assert_greedy_equal_and_draws_kept(logits, params, prompts, outputs, ours):
    theirs = ref.sample(logits, rows_for(ref, params, prompts, outputs)).token_ids
    greedy = [i for i, p in enumerate(params) if p.greedy]
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    assert greedy and drawn
    assert [ours[i] for i in greedy] == [theirs[i] for i in greedy]
    p = ref.processed_probs(logits, rows_for(ref, params, prompts, outputs))
    assert all(p[i, ours[i]] > 0 for i in drawn)  # each drawn from its kept set


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("seed", range(3))
def test_greedy_tokens_equal_the_per_row_sampler_and_seeded_draws_stay_in_the_kept_set(monkeypatch, seed, path):
    if path == "torch":
        monkeypatch.setattr(sampler.cpu_kernels, "usable", lambda *args: False)
    logits, params, prompts, outputs = random_case(seed, 48, seeded=True)
    ours = sample(logits, rows_for(sampler, params, prompts, outputs)).token_ids
    assert_greedy_equal_and_draws_kept(logits, params, prompts, outputs, ours)
    assert ours == sample(logits, rows_for(sampler, params, prompts, outputs)).token_ids  # seeded: the same again


def test_seeded_draws_through_the_sorted_fallback(monkeypatch):
    monkeypatch.setattr(sampler, "WINDOW", 4)  # nearly every top-p row goes past the window
    monkeypatch.setattr(sampler.cpu_kernels, "usable", lambda *args: False)
    for seed in range(3):
        logits, params, prompts, outputs = random_case(100 + seed, 32, seeded=True)
        ours = sample(logits, rows_for(sampler, params, prompts, outputs)).token_ids
        assert_greedy_equal_and_draws_kept(logits, params, prompts, outputs, ours)


@pytest.mark.parametrize("window", [4, 256])
def test_processed_probs_equal_the_per_row_sampler(monkeypatch, window):
    monkeypatch.setattr(sampler, "WINDOW", window)
    logits, params, prompts, outputs = random_case(7, 64, seeded=False)
    ours = processed_probs(logits, rows_for(sampler, params, prompts, outputs))
    theirs = ref.processed_probs(logits, rows_for(ref, params, prompts, outputs))
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


CHI2_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


@pytest.mark.parametrize("path", ["kernel", "torch"])  # the CPU kernel (cpu_kernels.py), or torch ops alone
@pytest.mark.parametrize("window", [3, 256])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8),  # the whole row
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, min_p=0.1, top_p=0.97),
])
def test_unseeded_draws_follow_the_processed_distribution(monkeypatch, window, params, path):
    monkeypatch.setattr(sampler, "WINDOW", window)
    if path == "torch":
        monkeypatch.setattr(sampler.cpu_kernels, "usable", lambda *args: False)
    base = torch.full((1, VOCAB), -30.0)
    base[0, :8] = torch.tensor([2.0, 1.6, 1.3, 1.0, 0.7, 0.5, 0.2, 0.0])
    n = 6000
    rows = [SamplingRow(params, None, [], [])] * n
    p = processed_probs(base, rows[:1])[0]
    torch.testing.assert_close(p, ref.processed_probs(base, [ref.SamplingRow(params, None, [], [])])[0])
    check_draws(base, rows, p)


def check_draws(base: torch.Tensor, rows: list, p: torch.Tensor) -> None:
    """``sample`` of ``base`` once per row (a row each) lands only where ``p`` is, and a chi-square
    test at p = 0.001 finds the counts consistent with ``p``."""
    n = len(rows)
    got = torch.bincount(torch.tensor(sample(base.repeat(n, 1), rows).token_ids), minlength=VOCAB).double()
    support = p > 1e-4
    assert got[~support].sum() == 0
    expected = p[support].double() * n
    chi2 = float(((got[support] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_P001[int(support.sum()) - 1]


def test_a_mixed_batch_keeps_each_rows_rule():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.0, presence_penalty=50.0), SamplingParams(temperature=1.0, top_p=1e-6),
              SamplingParams(temperature=0.7, min_p=0.999), SamplingParams(temperature=0.0)]
    outputs = [[], [], [int(logits[2].argmax())], [], [], []]
    out = sample(logits, [SamplingRow(p, None, [], o) for p, o in zip(params, outputs)]).token_ids
    best = logits.argmax(-1).tolist()
    assert out[:2] == best[:2] and out[3:] == best[3:]  # greedy, top-k 1, a tiny top-p, min-p near 1
    assert out[2] == int(logits[2].topk(2).indices[1])  # the penalised best gives way


def test_incremental_penalties_equal_the_ones_rebuilt_from_the_history():
    rng = random.Random(5)
    params = [random_params(rng, seeded=False) for _ in range(8)]
    prompts = [[rng.randrange(VOCAB) for _ in range(5)] for _ in range(8)]
    outputs = [[rng.randrange(VOCAB) for _ in range(3)] for _ in range(8)]
    state = PenaltyState(num_rows=10, vocab_size=VOCAB, device=CPU)
    rows = torch.tensor([9, 0, 3, 2, 1, 4, 5, 8])  # persistent rows in any order
    for row, p, pr, out in zip(rows.tolist(), params, prompts, outputs):
        state.set_row(row, p, pr, out)
    table = torch.tensor([column_values(p, VOCAB) for p in params])
    for _ in range(20):  # tokens generated one step at a time, repeats included
        new = torch.tensor([rng.randrange(40) for _ in range(8)])
        state.record(rows, new, table[:, sampler.FREQUENCY], table[:, sampler.PRESENCE], table[:, sampler.REPETITION])
        for out, t in zip(outputs, new.tolist()):
            out.append(t)
    bias, rep = state.gather(rows, want_rep=True, host_rows=rows.numpy())
    rebuilt = SamplingBatch.from_rows([SamplingRow(p, None, pr, o) for p, pr, o in zip(params, prompts, outputs)],
                                      VOCAB, CPU)
    torch.testing.assert_close(bias, rebuilt.bias)
    assert any(p.repetition_penalty != 1.0 for p in params) and torch.equal(rep, rebuilt.rep)
    # a run of consecutive rows is read in place, the same values
    run_bias, run_rep = state.gather(torch.arange(2, 6), want_rep=True, host_rows=np.arange(2, 6))
    assert run_bias.data_ptr() == state.bias[2].data_ptr()
    assert torch.equal(run_bias, state.bias[2:6]) and torch.equal(run_rep, state.rep[2:6])
    logits = torch.randn(8, VOCAB)
    keys = np.zeros(8, dtype=np.int64)
    greedy = SamplingBatch(table, np.ones(8, dtype=bool), table.numpy(), keys, keys, bias, rep)
    assert torch.equal(sampler.sample_batch(logits, greedy),
                       torch.tensor(ref.sample(logits, [ref.SamplingRow(
                           SamplingParams(temperature=0.0, presence_penalty=p.presence_penalty,
                                          frequency_penalty=p.frequency_penalty,
                                          repetition_penalty=p.repetition_penalty), None, pr, o)
                           for p, pr, o in zip(params, prompts, outputs)]).token_ids))


def test_unseeded_rows_beside_seeded_greedy_and_top_k_rows():
    """Unseeded rows among seeded, greedy and top-k ones: greedy rows keep the per-row sampler's
    tokens, every draw stays in its kept set."""
    for seed in range(4):
        logits, params, prompts, outputs = random_case(200 + seed, 40, seeded=True)
        rng = random.Random(seed)
        params = [msgspec.structs.replace(p, seed=None, top_k=0) if rng.random() < 0.5 else p for p in params]
        ours = sample(logits, rows_for(sampler, params, prompts, outputs)).token_ids
        assert_greedy_equal_and_draws_kept(logits, params, prompts, outputs, ours)


@pytest.mark.parametrize("repetition", [[0.8, 0.8], [1.3, 1.3], [0.8, 1.3]])
def test_repetition_penalties_above_and_below_one_equal_the_per_row_sampler(repetition):
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(11)) * 3
    params = [SamplingParams(temperature=0.0, repetition_penalty=repetition[i % 2]) for i in range(8)]
    prompts = [[i, 50 + i, 300] for i in range(8)]
    outputs = [[int(logits[i].argmax()), int(logits[i].argmin()), 7] for i in range(8)]  # both signs penalised
    ours = processed_probs(logits, rows_for(sampler, params, prompts, outputs))
    assert torch.equal(ours, ref.processed_probs(logits, rows_for(ref, params, prompts, outputs)))
    batch = SamplingBatch.from_rows(rows_for(sampler, params, prompts, outputs), VOCAB, CPU)
    penalised = sampler.process_logits(logits, batch)
    expected = ref.apply_penalties(logits, rows_for(ref, params, prompts, outputs))
    assert torch.equal(penalised, expected)


@pytest.mark.parametrize("vocab", [600, 4096])  # one scan; blocks of 64 tokens
def test_inverse_cdf_draws_follow_the_weights_and_never_a_zero(vocab):
    torch.manual_seed(3)
    weights = torch.zeros(vocab)
    support = torch.tensor([0, 1, 63, 64, 65, 300, vocab - 2])  # block edges, not the row's ends
    weights[support] = torch.tensor([0.5, 2.0, 1.0, 0.25, 3.0, 1.5, 0.75])
    n = 20000
    u = sampler.uniforms(torch.arange(n, dtype=torch.int64) * 7919 + 5, torch.zeros(n, dtype=torch.int64), 0, 2)
    drawn = sampler._inverse_cdf(weights.repeat(n, 1), u)
    got = torch.bincount(drawn, minlength=vocab).double()
    assert got.sum() == got[support].sum() == n  # no token of weight 0, the first and last included
    expected = weights[support].double() / weights.sum() * n
    chi2 = float(((got[support] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_P001[len(support) - 1]
