"""The CPU sampler kernel (folio/core/executor/kernels/csrc/sampler.c) against the torch path it stands in
for: its exp, its greedy tokens under penalties (bit for bit), its draws (chi-square against
``processed_probs``, never outside the kept set), its penalty bookkeeping (bit for bit), and which
batches take it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from folio.core.executor.kernels import cpu_kernels
from folio.core.executor.sampling import sampler
from folio.core.executor.sampling.penalties import PenaltyState
from folio.core.executor.sampling.sampler import SamplingBatch, SamplingRow, make_generator, processed_probs_batch
from folio.shared.sampling import SamplingParams

CPU = torch.device("cpu")
CHI2_P001 = {3: 16.27, 5: 20.52, 7: 24.32, 9: 27.88, 11: 31.26, 13: 34.53, 15: 37.70}


def test_the_kernel_builds_on_this_machine():
    assert cpu_kernels.library() is not None  # else every CPU step silently takes the slow path


def test_exp_is_within_two_ulp_and_exactly_zero_below_the_float_range():
    x = np.concatenate([np.linspace(-87.3, 0.0, 200_001, dtype=np.float32), np.float32([-0.0, -1e-30, -1e-7])])
    got = cpu_kernels.exp_nonpositive(x).astype(np.float64)
    exact = np.exp(x.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert (np.abs(got - exact) <= 2 * ulp).all()
    below = cpu_kernels.exp_nonpositive(np.float32([-87.4, -100.0, -1e30, -np.inf]))
    assert (below == 0).all()


def batch_of(params: list[SamplingParams], logits: torch.Tensor, outputs: list[list[int]]) -> SamplingBatch:
    return SamplingBatch.from_rows([SamplingRow(p, make_generator(p.seed, CPU), [1, 2], o)
                                    for p, o in zip(params, outputs)],
                                   logits.shape[1], CPU)


def test_greedy_rows_under_penalties_take_the_torch_paths_tokens_bit_for_bit(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=gen) * 3
    logits[:8, 10] = logits[:8, 20] = logits[:8].amax(-1) + 1  # ties: the first index wins
    params = [SamplingParams(temperature=0.0, repetition_penalty=[1.0, 1.3, 0.7][i % 3],
                             presence_penalty=[0.0, 0.5][i % 2], frequency_penalty=0.2 * (i % 4)) for i in range(64)]
    outputs = [[int(logits[i].argmax()), int(logits[i].argmin()), 20, 20] for i in range(64)]
    batch = batch_of(params, logits, outputs)
    assert sampler._kernel_takes_all(logits, batch)
    ours = sampler.sample_batch(logits, batch)
    monkeypatch.setattr(cpu_kernels, "usable", lambda *args: False)
    assert torch.equal(ours, sampler.sample_batch(logits, batch))
    assert ours[:8].tolist().count(10) + ours[:8].tolist().count(20) >= 1


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.2, min_p=0.05, top_p=0.9),
    SamplingParams(temperature=0.9, top_p=0.95, presence_penalty=0.6, frequency_penalty=0.3, repetition_penalty=1.2),
])
@pytest.mark.parametrize("vocab", [16, 4096])  # within one block of 64 tokens, and many blocks
def test_draws_follow_the_processed_distribution_and_never_leave_the_kept_set(params, vocab):
    torch.manual_seed(1)
    base = torch.full((vocab,), -40.0)
    support_ids = torch.tensor([0, 3, 5, 9, 12, 15, vocab - 1])[: 7 if vocab > 16 else 6]
    base[support_ids[:6]] = torch.tensor([2.0, 1.7, 1.4, 1.0, 0.6, 0.1])
    if vocab > 16:
        base[vocab - 1] = 1.2  # the last token of the last block
    n = 20000
    logits = base.repeat(n, 1)
    outputs = [[3, 3, 9]] * n  # penalised tokens (for the params with penalties)
    batch = batch_of([params] * n, logits, outputs)
    assert sampler._kernel_takes_all(logits, batch)
    p = processed_probs_batch(logits[:1], batch_of([params], logits[:1], outputs[:1]))[0].double()
    got = torch.bincount(sampler.sample_batch(logits, batch), minlength=vocab).double()
    kept = p > 0
    assert got[~kept].sum() == 0
    expected = p[kept] * n
    big = expected > 5  # chi-square over the cells it can judge; the rare ones must still be allowed
    chi2 = float(((got[kept][big] - expected[big]) ** 2 / expected[big]).sum())
    assert chi2 < CHI2_P001.get(int(big.sum()) - 1, 40.0)


def test_a_tiny_top_p_and_a_min_p_near_one_leave_the_best_token():
    logits = torch.randn(32, 1000, generator=torch.Generator().manual_seed(2)) * 2
    for params in (SamplingParams(temperature=1.0, top_p=1e-6), SamplingParams(temperature=0.7, min_p=0.999)):
        out = sampler.sample_batch(logits, batch_of([params] * 32, logits, [[]] * 32))
        assert torch.equal(out, logits.argmax(-1))


def test_recorded_penalties_equal_the_torch_bookkeeping_bit_for_bit(monkeypatch):
    rng = np.random.default_rng(4)
    kernel, torch_ops = (PenaltyState(12, 500, CPU) for _ in range(2))
    for state in (kernel, torch_ops):
        state.set_row(0, SamplingParams(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.1), [5], [])
    for _ in range(30):
        rows = torch.as_tensor(rng.integers(0, 12, 9))  # repeats: a verification appends several tokens to a row
        tokens = torch.as_tensor(rng.integers(0, 40, 9))
        freq, pres, rep = (torch.as_tensor(rng.random(9), dtype=torch.float32) for _ in range(3))
        kernel.record(rows, tokens, freq, pres, rep)
        with monkeypatch.context() as m:
            m.setattr(cpu_kernels, "library", lambda: None)
            torch_ops.record(rows, tokens, freq, pres, rep)
    assert torch.equal(kernel.counts, torch_ops.counts) and kernel.counts.sum() == 30 * 9
    assert torch.equal(kernel.bias, torch_ops.bias) and torch.equal(kernel.rep, torch_ops.rep)


def test_which_batches_the_kernel_takes():
    logits = torch.randn(4, 100)
    plain = SamplingParams(temperature=0.8, top_p=0.9)
    assert sampler._kernel_takes_all(logits, batch_of([plain, SamplingParams(temperature=0.0)] * 2, logits, [[]] * 4))
    for other in (SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0.8, top_k=5)):
        assert sampler._kernel_takes_all(logits, batch_of([plain, other] * 2, logits, [[]] * 4))  # every row
    greedy = [SamplingParams(temperature=0.0)] * 4
    assert not sampler._kernel_takes_all(logits, batch_of(greedy, logits, [[]] * 4))  # numpy's argmax does it
    assert not sampler._kernel_takes_all(logits.to(torch.float64), batch_of([plain] * 4, logits, [[]] * 4))


def test_the_kernels_keep_the_gil():
    """They are short: a call that released the GIL would have to win it back from the executor
    service's event loop (with async scheduling that cost served throughput 0.97 -> 0.77 of the
    in-process figure in bench_serving)."""
    import ctypes

    assert isinstance(cpu_kernels.library(), ctypes.PyDLL)


def test_table_sampling_reads_the_persistent_rows_and_records_as_the_per_call_path():
    """``TableSampler`` (parameters and penalties read in place from scattered rows, the drawn
    tokens recorded in the same call) against ``sample`` over the gathered rows followed by
    ``PenaltyState.record``: the same seeds and positions give the same tokens, greedy under penalties included,
    and the same counts, bias and repetition tables."""
    from folio.core.executor.runtime.input_batch import InputBatch

    vocab, rng = 300, np.random.default_rng(7)
    batches = [InputBatch(64, vocab, 16, CPU) for _ in range(2)]
    kinds = [SamplingParams(temperature=0.0, presence_penalty=0.5, repetition_penalty=1.3),
             SamplingParams(temperature=0.9, top_p=0.9, frequency_penalty=0.4, repetition_penalty=0.8),
             SamplingParams(temperature=0.7),  # no penalties: its rows are never read or recorded
             SamplingParams(temperature=0.0)]
    histories = [rng.integers(0, vocab, 6 + i % 5).tolist() for i in range(40)]  # 3 prompt tokens each
    for batch in batches:
        for i, tokens in enumerate(histories):
            batch.add(f"r{i}", tokens, 3, 0, [i], kinds[i % 4])
    rows = torch.as_tensor(rng.permutation(40)[:25])  # scattered, out of order
    table = cpu_kernels.TableSampler(vocab)
    counted_before = int(batches[0].penalties.counts.sum())
    for step in range(12):
        logits = torch.randn(25, vocab, generator=torch.Generator().manual_seed(step)) * 2
        seeds, positions = rng.integers(-2**63, 2**63 - 1, 25), rng.integers(0, 1000, 25)
        ours = table.sample(logits, rows, batches[0].greedy, batches[0].params, batches[0].penalties, seeds, positions)
        ref_batch = batches[1]
        host_rows = rows.numpy()
        bias, rep = ref_batch.penalties.gather(rows, True, host_rows)
        theirs = cpu_kernels.sample(logits, ref_batch.greedy[host_rows], ref_batch.params[host_rows], bias, rep,
                                    seeds, positions)
        assert torch.equal(ours, theirs)
        params = torch.from_numpy(ref_batch.params[host_rows])
        ref_batch.penalties.record(rows, theirs, params[:, sampler.FREQUENCY], params[:, sampler.PRESENCE],
                                   params[:, sampler.REPETITION])
    neutral = [int(r) for r in rows if kinds[int(r) % 4] == kinds[2] or kinds[int(r) % 4] == kinds[3]]
    penalised = [int(r) for r in rows if int(r) not in neutral]
    mine, ref = batches[0].penalties, batches[1].penalties
    assert torch.equal(mine.bias[penalised], ref.bias[penalised]) and torch.equal(mine.rep[penalised], ref.rep[penalised])
    assert torch.equal(mine.counts[penalised], ref.counts[penalised])
    assert int(mine.counts.sum()) - counted_before == 12 * len(penalised)
    assert (mine.bias[neutral] == 0).all() and (mine.rep[neutral] == 1).all()

