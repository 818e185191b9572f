"""The sampler as it was before the batched one: one row's Python at a time, histories rebuilt
from whole token lists every step. Kept for the tests only, as the reference the batched sampler
(folio/core/executor/sampling/sampler.py) must reproduce: the same greedy tokens, the same seeded draws.

Order (vLLM's): penalties on the raw logits -> greedy rows take the argmax -> temperature ->
min-p, top-k, top-p masks -> a draw. The draw is the exponential race (``argmax(p / E)`` with
``E ~ Exp(1)``), which samples exactly from ``p``; each seeded request draws its noise from its
own ``torch.Generator``, seeded afresh for every draw from (seed, output position) by
``draw_keys`` below: the same seed gives the same tokens whatever else is in the batch, and a
request that starts over (preempted, swapped, its executor restarted) or is forked draws exactly
what it would have drawn.
Logprobs are reported from the model's raw distribution (before penalties and temperature).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from folio.shared.messages import TokenLogprobs
from folio.shared.sampling import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs of one request."""

    params: SamplingParams
    generator: torch.Generator | None  # not read: a row is seeded when params.seed is set (see seeded_noise)
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


# The seeded draw's key, written from its definition rather than from the sampler's code: the
# splitmix64 finalizer ("mix") of the 64-bit counter  seed * GAMMA + position + 1  (mod 2**64), where
# GAMMA is splitmix64's increment (the odd integer nearest 2**64 / golden ratio). Here the arithmetic
# is numpy's wrapping uint64 on arrays (the sampler masks Python integers), and ``draw_keys`` takes
# a whole array of positions. ``test_splitmix64_mix_gives_the_published_stream`` checks
# ``splitmix64_mix`` against splitmix64's published outputs, so the oracle rests on the algorithm,
# not on the sampler.
GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX = ((30, np.uint64(0xBF58476D1CE4E5B9)), (27, np.uint64(0x94D049BB133111EB)))


def splitmix64_mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's output function on uint64 values (multiplications wrap mod 2**64)."""
    z = np.asarray(z, dtype=np.uint64)
    for shift, mult in _MIX:
        z = (z ^ (z >> np.uint64(shift))) * mult
    return z ^ (z >> np.uint64(31))


def draw_keys(seed: int, positions: np.ndarray) -> np.ndarray:
    """The generator seeds of a request's draws at output ``positions`` (uint64 array)."""
    counter = np.full(len(positions), seed % 2**64, dtype=np.uint64) * GAMMA
    counter = counter + np.asarray(positions, dtype=np.uint64) + np.uint64(1)
    return splitmix64_mix(counter)


def seeded_noise(seed: int, position: int, vocab: int, device: torch.device) -> torch.Tensor:
    """The Exp(1) noise of the draw at output ``position``: a fresh generator, keyed by (seed, position)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(draw_keys(seed, np.array([position]))[0]))
    return torch.empty(vocab, device=device).exponential_(generator=gen)


def token_logprobs(
    logprobs: torch.Tensor,  # [n, vocab_size] log-softmax of the raw logits
    token_ids: torch.Tensor,  # [n] the tokens chosen at those positions
    num_top: list[int],  # per row, how many alternatives to report
) -> list[TokenLogprobs]:
    """Row by row in numpy: the chosen token's logprob, its rank (1 + how many tokens are more
    likely) and the ``n`` most likely tokens by a full stable sort (not torch's top-k)."""
    out = []
    for row, token_id, n in zip(logprobs.double().cpu().numpy(), token_ids.tolist(), num_top):
        order = np.argsort(-row, kind="stable")[:n]
        out.append(TokenLogprobs(token_id=int(token_id), logprob=float(row[token_id]),
                                 rank=int(np.count_nonzero(row > row[token_id])) + 1,
                                 top_token_ids=[int(t) for t in order], top_logprobs=[float(row[t]) for t in order]))
    return out


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Presence/frequency penalties count generated tokens; repetition covers prompt + output."""
    batch, vocab = logits.shape
    device = logits.device
    presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)
    frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device)
    repetition = torch.tensor([r.params.repetition_penalty for r in rows], device=device)
    counts = torch.zeros((batch, vocab), dtype=logits.dtype, device=device)
    seen = torch.zeros((batch, vocab), dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        if r.output_token_ids:
            out_ids = torch.tensor(r.output_token_ids, dtype=torch.long, device=device)
            counts[i].index_add_(0, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
        if r.params.repetition_penalty != 1.0 and r.prompt_token_ids:
            seen[i, torch.tensor(r.prompt_token_ids, dtype=torch.long, device=device)] = True
    seen |= counts > 0
    rep = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask (to -inf) every token outside each row's min-p, top-k and top-p sets."""
    device = logits.device
    vocab = logits.shape[1]
    if any(r.params.min_p > 0 for r in rows):
        min_p = torch.tensor([r.params.min_p for r in rows], device=device)
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    need_k = any(0 < r.params.top_k < vocab for r in rows)  # 0: off
    need_p = any(r.params.top_p < 1.0 for r in rows)
    if not (need_k or need_p):
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if need_k:
        k = torch.tensor([min(r.params.top_k or vocab, vocab) for r in rows], device=device)
        remove |= torch.arange(vocab, device=device)[None, :] >= k[:, None]
    if need_p:
        top_p = torch.tensor([r.params.top_p for r in rows], device=device)
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # drop a token once the mass of the tokens before it already reaches top_p
        before = probs.cumsum(dim=-1) - probs
        remove |= (before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # rows without top-p keep every token
    remove[:, 0] = False  # the best token always survives
    return logits.scatter(1, sorted_idx, sorted_logits.masked_fill(remove, float("-inf")))


def has_penalties(params: SamplingParams) -> bool:
    """Whether the token history changes this request's distribution (only penalties read it)."""
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)


def penalised_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``apply_penalties`` where some row asks for a penalty (it builds per-row history tensors,
    which a batch without penalties should not pay for)."""
    if any(has_penalties(r.params) for r in rows):
        return apply_penalties(logits, rows)
    return logits


def _sampled_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then the min-p/top-k/top-p masks, then softmax, on penalised logits. Greedy
    rows are scaled at temperature 1 only so that the batch stays one tensor; callers ignore them."""
    temps = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in rows], device=logits.device)
    return apply_top_k_top_p_min_p(logits / temps[:, None], rows).softmax(dim=-1)


def processed_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """[n, vocab] fp32 logits -> [n, vocab] the distribution ``sample`` draws each row from.

    Penalties (with the row's own output history), temperature, min-p/top-k/top-p, softmax; a
    greedy row becomes a one-hot at the argmax of its penalised logits, which is the token
    ``sample`` picks for it. Speculative verification needs these rows as explicit distributions
    (p in min(1, p/q)); keeping them here, built from the same pieces as ``sample``, is what makes
    it the same p.
    """
    logits = penalised_logits(logits, rows)
    greedy = torch.tensor([r.params.greedy for r in rows], device=logits.device)
    one_hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[1]).to(logits.dtype)
    if bool(greedy.all()):
        return one_hot
    return torch.where(greedy[:, None], one_hot, _sampled_probs(logits, rows))


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    """``logits``: [num_rows, vocab_size] fp32, one row per request that samples this step."""
    raw_logprobs = None
    want_logprobs = [r.params.logprobs for r in rows]
    if any(n is not None for n in want_logprobs):
        raw_logprobs = logits.log_softmax(dim=-1)
    logits = penalised_logits(logits, rows)
    greedy = [r.params.greedy for r in rows]
    token_ids = logits.argmax(dim=-1)
    if not all(greedy):
        probs = _sampled_probs(logits, rows)
        noise = torch.empty_like(probs).exponential_()
        for i, r in enumerate(rows):
            if r.params.seed is not None and not greedy[i]:
                noise[i] = seeded_noise(r.params.seed, len(r.output_token_ids), probs.shape[1], probs.device)
        drawn = (probs / noise).argmax(dim=-1)
        token_ids = torch.where(torch.tensor(greedy, device=logits.device), token_ids, drawn)
    logprob_rows: list[TokenLogprobs | None] = [None] * len(rows)
    if raw_logprobs is not None:
        idx = [i for i, n in enumerate(want_logprobs) if n is not None]
        sel = torch.tensor(idx, device=logits.device)
        reported = token_logprobs(raw_logprobs[sel], token_ids[sel], [want_logprobs[i] for i in idx])
        for i, lp in zip(idx, reported):
            logprob_rows[i] = lp
    return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprob_rows)
