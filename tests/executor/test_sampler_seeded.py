"""Seeded sampling on the batched path: counter-based uniforms (Philox4x32-10, sampling/philox.py)
keyed by (seed, output position, draw index). The generator against Random123's known answers, the
C kernel's and torch's uniforms bit for bit (the CUDA kernel's: tests/cuda/test_sampler_kernel.py),
a seeded row's tokens alone and in batches of 1, 7 and 64 beside other kinds of rows (greedy,
unseeded, top-k, min-p, penalties), its draws against the target distribution (chi-square), and a
seeded request through ``EngineCore`` alone, among 32 concurrent ones (a pool small enough to
preempt) and with async scheduling on and off."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from folio.core.executor.kernels import cpu_kernels
from folio.core.executor.sampling import sampler
from folio.core.executor.sampling.philox import philox4x32_10, seed_words, uniforms
from folio.core.executor.sampling.sampler import SamplingRow, processed_probs, sample
from folio.shared.sampling import SamplingParams
from tests.executor import reference_sampler as ref
from tests.executor.test_sampler_batched import check_draws

CPU = torch.device("cpu")
VOCAB = 600
PATHS = pytest.mark.parametrize("path", ["kernel", "torch"])  # the CPU kernel, or torch ops alone (the GPU's)


def use(monkeypatch, path: str) -> None:
    assert cpu_kernels.library() is not None
    if path == "torch":
        monkeypatch.setattr(sampler.cpu_kernels, "usable", lambda *args: False)


@pytest.mark.parametrize("counter,key,want", [  # Random123's kat_vectors for philox4x32_10
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
])
def test_philox_gives_the_published_answers(counter, key, want):
    out = philox4x32_10([torch.tensor([c]) for c in counter], torch.tensor([key[0]]), torch.tensor([key[1]]))
    assert [int(x) for x in out] == want


def test_the_c_kernel_and_torch_give_the_same_uniforms_bit_for_bit():
    rng = np.random.default_rng(0)
    seeds = np.concatenate([[0, 1, -1, 2**63 - 1, -(2**63)], rng.integers(-2**63, 2**63 - 1, 200)]).astype(np.int64)
    positions = np.concatenate([[0, 2**32 - 1, 2**32, 5, 2**40 + 3], rng.integers(0, 5000, 200)]).astype(np.int64)
    want = uniforms(torch.from_numpy(seeds), torch.from_numpy(positions), 0, 70).numpy()
    assert np.array_equal(cpu_kernels.philox_uniforms(seeds, positions, 0, 70), want)
    assert np.array_equal(cpu_kernels.philox_uniforms(seeds, positions, 64, 6), want[:, 64:])
    assert (want > 0).all() and (want <= 1).all()
    assert len(np.unique(want)) == want.size  # 53-bit draws: no repeats among 14,350
    # any Python int is a key modulo 2**64
    assert seed_words(2**64 + 5) == seed_words(5) and seed_words(2**64 - 1) == -1


SEEDED = SamplingParams(temperature=0.8, top_p=0.95, presence_penalty=0.6, seed=1234)
OTHERS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=20, seed=99),
    SamplingParams(temperature=1.1, min_p=0.05, top_p=0.9),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.8, frequency_penalty=0.4),
    SamplingParams(temperature=0.8, top_p=0.95, presence_penalty=0.6, seed=1234),  # the same params, other logits
]


def seeded_tokens(size: int, where: int, steps: int, case: int, params: SamplingParams = SEEDED) -> list[int]:
    """The seeded row's tokens over ``steps`` output positions, at row ``where`` of batches of
    ``size`` whose other rows (random kinds, logits and histories) change from step to step."""
    gen = torch.Generator().manual_seed(17)
    target = torch.randn(steps, VOCAB, generator=gen) * 2.5
    rng = random.Random(1000 * size + where + case)
    history, out = [5, 9], []
    for step in range(steps):
        logits = torch.randn(size, VOCAB, generator=torch.Generator().manual_seed(rng.randrange(2**31))) * 3
        logits[where] = target[step]
        rows = [SamplingRow(rng.choice(OTHERS), None, [1, 2], [rng.randrange(VOCAB) for _ in range(rng.randrange(6))])
                for _ in range(size)]
        rows[where] = SamplingRow(params, None, [1, 2], list(history))
        token = sample(logits, rows).token_ids[where]
        out.append(token)
        history.append(token)
    return out


@PATHS
@pytest.mark.parametrize("params", [SEEDED, SamplingParams(temperature=1.2, seed=5),
                                    SamplingParams(temperature=0.9, top_k=30, min_p=0.01, seed=6)],
                         ids=["top-p+presence", "temperature", "top-k+min-p"])
def test_a_seeded_row_draws_the_same_alone_and_in_batches_of_7_and_64(monkeypatch, path, params):
    use(monkeypatch, path)
    alone = seeded_tokens(1, 0, 10, 0, params)
    assert len(set(alone)) > 3  # it does draw
    for size, where in ((7, 0), (7, 6), (64, 31), (64, 63)):
        assert seeded_tokens(size, where, 10, size, params) == alone, (size, where)


def test_an_unseeded_row_with_a_seed_of_its_own_draws_as_a_seeded_one():
    """The runner's per-request random seed (``SamplingRow.seed``) keys the draws as a request's own."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    plain = SamplingParams(temperature=1.0)
    seeded = [SamplingRow(SamplingParams(temperature=1.0, seed=77), None, [], [0] * 3)] * 4
    keyed = [SamplingRow(plain, None, [], [0] * 3, seed=77)] * 4
    assert sample(logits, keyed).token_ids == sample(logits, seeded).token_ids
    draws = {tuple(sample(logits, [SamplingRow(plain, None, [], [0] * 3)] * 4).token_ids) for _ in range(8)}
    assert len(draws) > 1  # without a seed, each call draws afresh


@PATHS
@pytest.mark.parametrize("vary", ["seed", "position"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.95, presence_penalty=0.6),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=1.0, top_k=6, top_p=0.8, min_p=0.05),
])
def test_seeded_draws_follow_the_target_distribution(monkeypatch, path, vary, params):
    """n draws, one per row: each row its own seed at one position, or one seed at n positions."""
    use(monkeypatch, path)
    base = torch.full((1, VOCAB), -30.0)
    base[0, :8] = torch.tensor([2.0, 1.6, 1.3, 1.0, 0.7, 0.5, 0.2, 0.0])
    n = 3000
    rows = [SamplingRow(params, None, [], [3] * (2 + i if vary == "position" else 2),  # the same penalty
                        seed=42 if vary == "position" else i) for i in range(n)]
    p = processed_probs(base, rows[:1])[0]
    torch.testing.assert_close(p, ref.processed_probs(base, [ref.SamplingRow(params, None, [], [3, 3])])[0])
    check_draws(base, rows, p)


# ---------------------------------------------------------------------------- through EngineCore
@pytest.fixture(scope="module")
def small_pool_runner(tiny_model_dir):
    from tests.core.engine import make_runner

    return make_runner(tiny_model_dir, num_kv_blocks=24)  # 32 requests preempt (recompute) in it


def crowd(n: int, vocab: int = 128) -> list:
    from tests.core.engine import engine_request

    rng = random.Random(4)
    kinds = [{}, dict(temperature=1.0), dict(temperature=0.7, top_k=8, seed=5), dict(temperature=0.9, top_p=0.9),
             dict(temperature=0.8, top_p=0.95, presence_penalty=0.5, seed=11)]
    return [engine_request(f"o{i}", [rng.randrange(1, vocab) for _ in range(rng.randint(3, 40))], rng.randint(4, 24),
                           ignore_eos=True, **kinds[i % len(kinds)]) for i in range(n)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_seeded_request_gives_the_same_output_alone_and_among_32(small_pool_runner, async_scheduling):
    """Among 31 others, in chunks of a 128-token budget, in a pool that preempts requests (they
    start over: recompute): the same tokens as alone."""
    from tests.core.engine import LocalEngine, alone, engine_request

    target = engine_request("seeded", [7, 3, 99, 12, 40, 8], 24, ignore_eos=True, temperature=0.8, top_p=0.95,
                            presence_penalty=0.5, seed=2026)
    solo = alone(small_pool_runner, target).token_ids
    assert len(solo) == 24 and len(set(solo)) > 4
    engine = LocalEngine(small_pool_runner, max_num_batched_tokens=128, async_scheduling=async_scheduling)
    others = crowd(31)
    for msg in others[:15] + [target] + others[15:]:
        engine.add(msg)
    assert engine.run()["seeded"].token_ids == solo
    assert engine.sched.counters["num_preemptions"] > 0


def test_an_avx2_build_gives_the_same_uniforms_and_keeps_its_draws_in_the_kept_set(monkeypatch):
    """The kernels compiled for x86-64-v3 (AVX2, no AVX-512): the same uniforms bit for bit, the
    same greedy tokens, every draw (top-k, top-p, min-p, penalties) inside its kept set."""
    native = cpu_kernels.library()
    try:
        avx2 = cpu_kernels.library_for("x86-64-v3")
    except RuntimeError as exc:
        pytest.skip(f"no AVX2 build here: {exc}")
    seeds, positions = np.arange(-50, 50, dtype=np.int64) * 977, np.arange(100, dtype=np.int64) * 31
    want = cpu_kernels.philox_uniforms(seeds, positions, 0, 5)
    monkeypatch.setattr(cpu_kernels, "_library", avx2)
    assert cpu_kernels.library() is avx2 and native is not avx2
    assert np.array_equal(cpu_kernels.philox_uniforms(seeds, positions, 0, 5), want)
    rng = random.Random(8)
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(8)) * 3
    rows = [SamplingRow(rng.choice(OTHERS + [SEEDED]), None, [1], [rng.randrange(VOCAB) for _ in range(4)])
            for _ in range(64)]
    got = sample(logits, rows).token_ids
    p = ref.processed_probs(logits, [ref.SamplingRow(r.params, None, r.prompt_token_ids, r.output_token_ids)
                                     for r in rows])
    assert all(p[i, t] > 0 for i, t in enumerate(got))
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    assert greedy and all(p[i, got[i]] == 1 for i in greedy)  # greedy rows: the one-hot's token
