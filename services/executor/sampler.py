"""The sampler: the whole batch in a fixed number of tensor operations.

Order (vLLM's): penalties on the raw logits -> grammar masks -> greedy rows take the argmax ->
temperature -> min-p, top-k, top-p -> a draw. ``process_logits`` is the one place where logits
change before the draw (penalties, then rows with a grammar have the tokens it forbids masked:
``structured.apply_grammar_masks``); everything after it reads probabilities.

Top-k/top-p/min-p without sorting the vocabulary: each row's kept set is ``{p >= tau}``, and
``tau`` is found in a window of the row's ``WINDOW`` most likely tokens (one ``topk``), where the
nucleus of a real model almost always ends. A row whose kept set goes past the window is sorted
alone (on the CPU, where that check is free); on a GPU the window is the whole vocabulary, so the
step never waits on the device. The kept set is the one the sorting rule gives (vLLM's: drop a
token once the mass before it reaches top-p, on the distribution left by min-p and top-k), up to
tokens tied exactly at the threshold.

Draws. An unseeded row draws by inverting its cumulative distribution with one uniform (inside
the window when its kept set fits there). A seeded row keeps the exponential race
(``argmax(p / E)``, ``E ~ Exp(1)``), with its noise from its own ``torch.Generator`` seeded afresh
for every draw from (seed, output position): the same seed gives the same tokens whatever else is
in the batch, and a request that starts over (preempted, swapped, its executor restarted) or is
forked draws exactly what it would have drawn. Logprobs are reported from the model's raw
distribution (before penalties and temperature). Speculative verification (``rejection.py``)
draws from ``processed_probs``, built from the same pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from folio.services.executor.penalties import has_penalties, tensors_from_rows
from folio.services.executor.structured import apply_grammar_masks
from folio.shared.messages import SamplingParams, TokenLogprobs

__all__ = ["SamplingBatch", "SamplingRow", "SamplerOutput", "has_penalties", "make_generator", "position_seed",
           "process_logits", "processed_probs", "processed_probs_batch", "sample", "sample_batch",
           "token_logprobs"]

# columns of SamplingBatch.params, one row per sampling row
TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION, TOP_K = range(7)
NUM_PARAMS = 7
WINDOW = 256  # tokens the sorting-free top-k/top-p looks at before sorting a row (CPU)


@dataclass
class SamplingRow:
    """What the sampler needs of one request (for callers that keep token lists)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    matcher: object | None = None  # structured output: the request's xgrammar matcher


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 64-bit seed for the draw of output token ``position`` (splitmix64 of the pair)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def param_row(params: SamplingParams, vocab_size: int) -> list[float]:
    """One row of ``SamplingBatch.params``; a greedy row keeps temperature 1 (it never divides)."""
    top_k = vocab_size if params.top_k is None else min(params.top_k, vocab_size)
    temperature = 1.0 if params.greedy else params.temperature
    return [temperature, params.top_p, params.min_p, params.presence_penalty, params.frequency_penalty,
            params.repetition_penalty, float(top_k)]


@dataclass
class SamplingBatch:
    """Sampling parameters of n rows as device tensors, with host summaries so that choosing
    which operations to run never reads the device."""

    params: torch.Tensor  # [n, NUM_PARAMS] fp32, columns TEMPERATURE ... TOP_K
    greedy: np.ndarray  # [n] bool (host)
    host_params: np.ndarray  # [n, NUM_PARAMS] fp32, the same values on the host
    seeded: list[tuple[int, torch.Generator, int]]  # (row, its generator, the seed of this draw)
    bias: torch.Tensor | None = None  # [n, vocab] additive penalties (presence, frequency)
    seen: torch.Tensor | None = None  # [n, vocab] bool: tokens the repetition penalty divides
    matchers: list | None = None  # per row, its grammar matcher or None (None: no row has one)

    @staticmethod
    def from_rows(rows: list[SamplingRow], vocab_size: int, device: torch.device) -> "SamplingBatch":
        host = np.array([param_row(r.params, vocab_size) for r in rows], dtype=np.float32).reshape(-1, NUM_PARAMS)
        seeded = [(i, r.generator, position_seed(r.params.seed, len(r.output_token_ids)))
                  for i, r in enumerate(rows) if r.generator is not None and not r.params.greedy]
        batch = SamplingBatch(torch.from_numpy(host).to(device), np.array([r.params.greedy for r in rows], dtype=bool),
                              host, seeded)
        if any(has_penalties(r.params) for r in rows):
            batch.bias, batch.seen = tensors_from_rows(rows, vocab_size, device)
        if any(r.matcher is not None for r in rows):
            batch.matchers = [r.matcher for r in rows]
        return batch


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The one place where logits change before the draw: penalties, then grammar masks.
    Returns a new tensor when it changes anything: callers' logits stay."""
    if batch.seen is not None:  # repetition: divide positive logits of seen tokens, multiply negative ones
        rep = batch.params[:, REPETITION, None]
        logits = torch.where(batch.seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if batch.bias is not None:
        logits = logits + batch.bias
    if batch.matchers is not None:  # structured output: forbidden tokens -> -inf
        logits = apply_grammar_masks(logits, batch.matchers)
    return logits


# ---------------------------------------------------------------------------------------- top-k/p
def _keep_threshold(probs: torch.Tensor, params: torch.Tensor, host: np.ndarray, window: int,
                    exact: np.ndarray | None = None):
    """Per row, ``tau`` such that the kept tokens are ``probs >= tau`` (None: keep all), and
    ``closes`` [m]: whether the kept set lies within the window (``vals``, ``idx``: its sorted top).
    A row whose top-p or top-k cut lies past the window gets its exact ``tau`` from a sort of its
    own when ``exact`` (host bool [m]) marks it or is None; otherwise its ``tau`` is left to the
    caller (``_draw_past_window`` draws such rows without it)."""
    m, vocab = probs.shape
    need_k = bool((host[:, TOP_K] < vocab).any())
    need_p = bool((host[:, TOP_P] < 1.0).any())
    need_min_p = bool((host[:, MIN_P] > 0).any())
    if not (need_k or need_p or need_min_p):
        return None, None, None, None
    k = min(vocab, window)
    vals, idx = probs.topk(k, dim=-1)  # [m, k], sorted descending
    top_k, top_p = params[:, TOP_K], params[:, TOP_P]
    keep = torch.arange(k, device=probs.device)[None, :] < top_k[:, None]
    min_cut = vals[:, 0] * params[:, MIN_P]  # 0 on rows without min-p
    if need_min_p:
        keep &= vals >= min_cut[:, None]
    closes = (top_k <= k) | (vals[:, -1] < min_cut)  # top-k and min-p end inside the window
    if need_p:
        # top-p runs on what min-p and top-k leave, renormalised
        full = (probs * (probs >= min_cut[:, None])).sum(-1) if need_min_p else torch.ones_like(top_p)
        mass = torch.where(closes, (vals * keep).sum(-1), full)
        q = vals * keep / mass[:, None]
        cum = q.cumsum(-1)
        # drop a token once the mass of the tokens before it already reaches top_p
        keep &= ((cum - q) < top_p[:, None]) | (top_p[:, None] >= 1.0)
        closes = closes | ((top_p < 1.0) & (cum[:, -1] >= top_p))
    num_kept = keep.sum(-1).clamp_(min=1)  # the best token always survives
    tau = torch.where(closes, vals.gather(1, (num_kept - 1)[:, None]).squeeze(1), min_cut)
    if k < vocab:  # rows whose cut lies past the window are sorted alone (CPU only: this reads the device)
        lost = ~closes & ((top_p < 1.0) | (top_k < vocab))
        if exact is not None:
            lost &= torch.as_tensor(exact, device=lost.device)
        rows = torch.nonzero(lost).flatten()
        if rows.numel():
            sub_tau, _, _, _ = _keep_threshold(probs[rows], params[rows], host[rows.cpu().numpy()], vocab)
            tau.index_copy_(0, rows, sub_tau)
    return tau, closes, vals, idx


def _inverse_cdf(weights: torch.Tensor) -> torch.Tensor:
    """[m, n] non-negative weights -> [m] index drawn with probability weight / row sum."""
    cum = weights.cumsum(-1)
    u = torch.rand((weights.shape[0], 1), device=weights.device) * cum[:, -1:]
    return torch.searchsorted(cum, u, right=True).clamp_(max=weights.shape[1] - 1).squeeze(1)


def _draw_unseeded(probs: torch.Tensor, params: torch.Tensor, host: np.ndarray, tau, closes, vals, idx):
    if tau is None:
        return _inverse_cdf(probs)
    drawn = idx.gather(1, _inverse_cdf(vals * (vals >= tau[:, None]))[:, None]).squeeze(1)
    if vals.shape[1] < probs.shape[1]:
        vocab = probs.shape[1]
        wide = ~closes  # kept sets wider than the window: the whole row
        cut = wide & ((params[:, TOP_P] < 1.0) | (params[:, TOP_K] < vocab))  # ... and their cut is unknown
        rows = torch.nonzero(wide & ~cut).flatten()
        if rows.numel():  # min-p or nothing: tau is exact
            sub, sub_tau = probs[rows], tau[rows]
            drawn.index_copy_(0, rows, _inverse_cdf(sub * (sub >= sub_tau[:, None])))
        rows = torch.nonzero(cut).flatten()
        if rows.numel():
            drawn.index_copy_(0, rows, _draw_past_window(probs[rows], params[rows], host[rows.cpu().numpy()]))
    return drawn


def _draw_past_window(probs: torch.Tensor, params: torch.Tensor, host: np.ndarray, max_rounds: int = 64):
    """Rows whose top-p cut lies past the window, drawn without finding the cut (FlashInfer's
    sorting-free rejection): draw x from the tokens above a pivot; keep it when the mass of the
    tokens more likely than x is below top-p (x is in the nucleus), else raise the pivot to x and
    draw again. A kept draw is distributed as p on the nucleus, since every pivot lies below it;
    each round keeps a row with probability at least top-p. Rows with a top-k past the window, or
    left after ``max_rounds``, are sorted."""
    m, vocab = probs.shape
    min_cut = probs.amax(-1) * params[:, MIN_P]
    region = probs >= min_cut[:, None]  # what min-p leaves; top-p is taken on it, renormalised
    mass = (probs * region).sum(-1)
    limit = params[:, TOP_P] * mass
    lower = torch.where(min_cut > 0, min_cut, torch.zeros_like(min_cut))
    strict = torch.zeros(m, dtype=torch.bool, device=probs.device)  # the pivot itself is out
    out = torch.empty(m, dtype=torch.long, device=probs.device)
    todo = torch.nonzero(params[:, TOP_K] >= vocab).flatten()
    for _ in range(max_rounds):
        if not todo.numel():
            break
        p, lo, st = probs[todo], lower[todo], strict[todo]
        x = _inverse_cdf(p * torch.where(st[:, None], p > lo[:, None], p >= lo[:, None]))
        px = p.gather(1, x[:, None])
        above = (p * (p > px)).sum(-1)
        ok = above < limit[todo]
        out.index_copy_(0, todo[ok], x[ok])
        redo = todo[~ok]
        lower.index_copy_(0, redo, px.squeeze(1)[~ok])
        strict.index_fill_(0, redo, True)
        todo = redo
    rest = torch.ones(m, dtype=torch.bool, device=probs.device)
    rest[params[:, TOP_K] >= vocab] = False
    rest[todo] = True
    rows = torch.nonzero(rest).flatten()
    if rows.numel():
        sub = probs[rows]
        sub_tau, _, _, _ = _keep_threshold(sub, params[rows], host[rows.cpu().numpy()], vocab)
        out.index_copy_(0, rows, _inverse_cdf(sub * (sub >= sub_tau[:, None])))
    return out


def _masked(x: torch.Tensor, probs: torch.Tensor, tau) -> torch.Tensor:
    return x if tau is None else x.masked_fill(probs < tau[:, None], float("-inf"))


def _window(vocab: int) -> int:
    return min(WINDOW, max(16, vocab // 16))


def _random_rows(logits: torch.Tensor, batch: SamplingBatch, exact_all: bool):
    """Temperature-scaled logits, probabilities and kept-set threshold of the non-greedy rows
    (exact for every row when ``exact_all``, else for the seeded ones)."""
    rand = None
    params, host = batch.params, batch.host_params
    if batch.greedy.any():
        keep = np.flatnonzero(~batch.greedy)
        rand = torch.as_tensor(keep, device=logits.device)
        logits, params, host = logits.index_select(0, rand), params.index_select(0, rand), host[keep]
    x = logits / params[:, TEMPERATURE, None]
    probs = x.softmax(dim=-1)
    window = _window(probs.shape[1]) if probs.device.type == "cpu" else probs.shape[1]
    exact = None
    if not exact_all:
        exact = np.zeros(len(host), dtype=bool)
        where = np.cumsum(~batch.greedy) - 1
        exact[[int(where[i]) for i, _, _ in batch.seeded]] = True
    return rand, x, probs, params, host, _keep_threshold(probs, params, host, window, exact)


def sample_batch(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[n, vocab] fp32 logits -> [n] sampled token ids (on the logits' device, no host sync)."""
    logits = process_logits(logits, batch)
    if batch.greedy.all():
        return logits.argmax(dim=-1)
    rand, x, probs, params, host, (tau, closes, vals, idx) = _random_rows(logits, batch, exact_all=False)
    drawn = _draw_unseeded(probs, params, host, tau, closes, vals, idx)
    if batch.seeded:
        # rows of the seeded requests inside the random subset
        where = np.cumsum(~batch.greedy) - 1
        sub = [int(where[i]) for i, _, _ in batch.seeded]
        noise = torch.empty((len(sub), x.shape[1]), device=x.device)
        for j, (_, gen, seed) in enumerate(batch.seeded):
            gen.manual_seed(seed)
            noise[j].exponential_(generator=gen)
        rows = torch.as_tensor(sub, device=x.device)
        seeded_tau = None if tau is None else tau[rows]
        race = _masked(x[rows], probs[rows], seeded_tau).softmax(dim=-1) / noise
        drawn.index_copy_(0, rows, race.argmax(dim=-1))
    if rand is None:
        return drawn
    return logits.argmax(dim=-1).index_copy_(0, rand, drawn)


def processed_probs_batch(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[n, vocab] fp32 logits -> [n, vocab] the distribution each row is drawn from.

    A greedy row is a one-hot at the argmax of its penalised logits (the token ``sample_batch``
    gives it). Speculative verification needs these rows as explicit distributions (p in
    min(1, p/q)); building them from the same pieces as ``sample_batch`` makes it the same p.
    """
    logits = process_logits(logits, batch)
    one_hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[1]).to(logits.dtype)
    if batch.greedy.all():
        return one_hot
    rand, x, probs, _, _, (tau, _, _, _) = _random_rows(logits, batch, exact_all=True)
    out = _masked(x, probs, tau).softmax(dim=-1)
    if rand is None:
        return out
    return one_hot.index_copy_(0, rand, out)


# ---------------------------------------------------------------------------------------- rows API
def token_logprobs(
    logprobs: torch.Tensor,  # [n, vocab_size] log-softmax of the raw logits
    token_ids: torch.Tensor,  # [n] the tokens chosen at those positions
    num_top: list[int],  # per row, how many alternatives to report
) -> list[TokenLogprobs]:
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [n]
    ranks = (logprobs > chosen[:, None]).sum(dim=1) + 1
    k = max(num_top, default=0)
    top_vals, top_ids = logprobs.topk(k, dim=1) if k else (None, None)
    chosen_l, ranks_l, ids_l = chosen.tolist(), ranks.tolist(), token_ids.tolist()
    top_ids_l = top_ids.tolist() if k else None
    top_vals_l = top_vals.tolist() if k else None
    return [
        TokenLogprobs(token_id=ids_l[i], logprob=chosen_l[i], rank=ranks_l[i],
                      top_token_ids=top_ids_l[i][:n] if n else [], top_logprobs=top_vals_l[i][:n] if n else [])
        for i, n in enumerate(num_top)
    ]


def processed_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``processed_probs_batch`` for rows given with their token lists."""
    return processed_probs_batch(logits, SamplingBatch.from_rows(rows, logits.shape[1], logits.device))


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    """``logits``: [num_rows, vocab_size] fp32, one row per request given with its token lists."""
    token_ids = sample_batch(logits, SamplingBatch.from_rows(rows, logits.shape[1], logits.device))
    want = [r.params.logprobs for r in rows]
    logprob_rows: list[TokenLogprobs | None] = [None] * len(rows)
    idx = [i for i, n in enumerate(want) if n is not None]
    if idx:
        sel = torch.tensor(idx, device=logits.device)
        reported = token_logprobs(logits[sel].log_softmax(dim=-1), token_ids[sel], [want[i] for i in idx])
        for i, lp in zip(idx, reported):
            logprob_rows[i] = lp
    return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprob_rows)
