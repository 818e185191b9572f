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
tokens tied exactly at the threshold. On the CPU (torch path) a row without top-k skips the window
(torch's CPU ``topk`` costs more than the rest of the step): it draws by rejection against its
nucleus (``_draw_nucleus``), which needs no cut at all.

On the CPU every row is sampled by one call of a C kernel (``cpu_kernels.py``, ``csrc/sampler.c``),
whatever the batch holds: per row, the penalties (bit for bit these), the greedy argmax, or
temperature, min-p, top-k (a quickselect) and top-p by the same rejection as ``_draw_nucleus``, in
a few passes over the row. Rows with a grammar have the tokens it forbids masked in the logits
before the call. The runner calls the same kernel on its persistent rows directly
(``cpu_kernels.TableSampler``: parameters and penalty tables read in place, the drawn tokens
recorded in the same call). What follows is the torch path: the reference, the GPU's path, and
the CPU's when no C compiler is at hand. The CPU path avoids what torch's CPU kernels run slowly:
argmax goes through numpy, masks are 0/1 floats to multiply by (``_above``) rather than booleans,
and the repetition penalty is a select by ``minimum``/``maximum`` over a float table
(``penalties.py``) rather than a ``where``.

Draws. Every row has a 64-bit seed: a seeded request its own, an unseeded one a random seed drawn
once (the runner draws it when the request joins; ``SamplingRow`` callers get a fresh one per call
unless they set ``SamplingRow.seed``). A row's uniforms are a counter-based generator's
(Philox4x32-10, ``philox.py``) keyed by (seed, output position = the number of tokens it has
generated, draw index), computed for the whole batch at once (on a GPU by ``cuda/sampler.cu``):
nothing is kept between steps, so the same seed gives the same tokens whatever else is in the
batch and whatever its size, and a request that starts over (preempted, swapped, its executor
restarted) draws exactly what it would have drawn. Which path a row takes and what it draws
depend only on that row (its probabilities, parameters, seed and position). A row draws by
inverting its cumulative distribution: the C kernel with draw 0, then draw d for the d-th
redraw of the top-p rejection; the torch path with draws 0 and 1 (a block of 64 tokens, then a
token in it, on long CPU rows) inside its exact kept set, and draws 2r, 2r + 1 for round r of
``_draw_nucleus``. Seeded and unseeded rows take the same path. Logprobs are reported from the
model's raw distribution (before penalties and temperature). Speculative verification
(``rejection.py``) draws from ``processed_probs``, built from the same pieces, with uniforms keyed
the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from folio.core.executor.kernels import cpu_kernels
from folio.core.executor.kernels.sampler_columns import (FREQUENCY, MIN_P, NUM_PARAMS, PRESENCE, REPETITION,
                                                         TEMPERATURE, TOP_K, TOP_P, column_values)
from folio.core.executor.sampling.penalties import has_penalties, tensors_from_rows
from folio.core.executor.sampling.philox import draw_seed, seed_words, uniforms
from folio.core.structured.masks import apply_grammar_masks
from folio.shared.messages import TokenLogprobs
from folio.shared.sampling import SamplingParams

__all__ = ["SamplingBatch", "SamplingRow", "SamplerOutput", "has_penalties", "make_generator", "position_seed",
           "process_logits", "processed_probs", "processed_probs_batch", "sample", "sample_batch",
           "token_logprobs"]

WINDOW = 256  # tokens the sorting-free top-k/top-p looks at before sorting a row (CPU)


@dataclass
class SamplingRow:
    """What the sampler needs of one request (for callers that keep token lists)."""

    params: SamplingParams
    generator: torch.Generator | None  # unused by the draws (counter-based: ``seed``); kept for callers
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    matcher: object | None = None  # structured output: the request's xgrammar matcher
    seed: int | None = None  # the row's seed when its params have none (else a fresh one per call)

    def key(self) -> int:
        """The 64-bit key of this row's uniforms (as int64 bits)."""
        if self.params.seed is not None:
            return seed_words(self.params.seed)
        return seed_words(self.seed) if self.seed is not None else draw_seed()


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
    """A 64-bit seed for output token ``position`` (splitmix64 of the pair): the draft model's
    ``torch.Generator`` seeds (``spec_decode``, with a salted seed); the sampler's own draws are
    keyed by ``philox.py`` instead."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass
class SamplingBatch:
    """Sampling parameters of n rows as device tensors, with host summaries so that choosing
    which operations to run never reads the device."""

    params: torch.Tensor  # [n, NUM_PARAMS] fp32, the columns of ``sampler_columns.column_values``
    greedy: np.ndarray  # [n] bool (host)
    host_params: np.ndarray  # [n, NUM_PARAMS] fp32, the same values on the host
    seeds: np.ndarray  # [n] int64: each row's 64-bit seed (its uniforms' key)
    positions: np.ndarray  # [n] int64: each row's output position (tokens it has generated)
    bias: torch.Tensor | None = None  # [n, vocab] additive penalties (presence, frequency)
    rep: torch.Tensor | None = None  # [n, vocab] fp32: the repetition penalty on seen tokens, 1 elsewhere
    matchers: list | None = None  # per row, its grammar matcher or None (None: no row has one)

    @staticmethod
    def from_rows(rows: list[SamplingRow], vocab_size: int, device: torch.device) -> "SamplingBatch":
        host = np.array([column_values(r.params, vocab_size) for r in rows], dtype=np.float32).reshape(-1, NUM_PARAMS)
        seeds = np.array([r.key() for r in rows], dtype=np.int64)
        positions = np.array([len(r.output_token_ids) for r in rows], dtype=np.int64)
        batch = SamplingBatch(torch.from_numpy(host).to(device), np.array([r.params.greedy for r in rows], dtype=bool),
                              host, seeds, positions)
        if any(has_penalties(r.params) for r in rows):
            batch.bias, batch.rep = tensors_from_rows(rows, vocab_size, device)
        if any(r.matcher is not None for r in rows):
            batch.matchers = [r.matcher for r in rows]
        return batch


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The one place where logits change before the draw: penalties, then grammar masks.
    Returns a new tensor when it changes anything: callers' logits stay."""
    if batch.rep is not None:  # repetition: divide positive logits of seen tokens, multiply negative ones
        # a penalty above 1 makes that the smaller of l / rep and l * rep (below 1, the larger), and
        # an unseen token's rep of 1 keeps l exactly: a select without a boolean mask
        if (batch.host_params[:, REPETITION] >= 1.0).all():
            logits = torch.minimum(logits / batch.rep, logits * batch.rep)
        elif (batch.host_params[:, REPETITION] <= 1.0).all():
            logits = torch.maximum(logits / batch.rep, logits * batch.rep)
        else:
            logits = torch.where(logits > 0, logits / batch.rep, logits * batch.rep)
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
        # top-p runs on what min-p and top-k leave, renormalised (a row without min-p gets the same
        # bits either way: times 1 is exact, so no row's cut depends on the others')
        full = (probs * (probs >= min_cut[:, None])).sum(-1) if need_min_p else probs.sum(-1)
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


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[m, n] non-negative weights -> [m] index drawn with probability weight / row sum, by the
    uniforms ``u`` [m, 2] (float64 in (0, 1]); a token of weight 0 is never drawn. A long row on
    the CPU is drawn in two levels: a block of 64 tokens by its sum (``u[:, 0]``), then a token
    inside it (``u[:, 1]``; torch's CPU cumsum over a 49,152-token row costs three times the block
    sums and the short scans). Other rows use ``u[:, 0]`` alone."""
    m, n = weights.shape
    size = 64
    if weights.device.type != "cpu" or n % size or n < size * size:
        return _search(weights.cumsum(-1), u[:, 0])
    blocks = weights.reshape(m, n // size, size)
    block = _search(blocks.sum(-1).cumsum(-1), u[:, 0])  # P(block) = its sum / the row's
    inner = blocks[torch.arange(m, device=weights.device), block]  # [m, size]
    return block * size + _search(inner.cumsum(-1), u[:, 1])  # P(token | block) = its weight / the block's


def _search(cum: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[m, n] cumulative weights -> [m] the first index whose cumulative weight reaches u [m] (in
    (0, 1]) times the total: one of positive weight (u is narrowed to the weights' dtype first, so
    that the target never passes the total)."""
    target = u.to(device=cum.device, dtype=cum.dtype)[:, None] * cum[:, -1:]
    return torch.searchsorted(cum, target).clamp_(max=cum.shape[1] - 1).squeeze(1)


def _above(probs: torch.Tensor, cut: torch.Tensor, strict: bool = True) -> torch.Tensor:
    """``probs > cut`` (``>=`` unless ``strict``) as 0/1 in the probabilities' dtype: a mask to
    multiply by, which torch's CPU kernels write several times faster than a boolean one."""
    compare = torch.gt if strict else torch.ge
    return compare(probs, cut, out=torch.empty_like(probs))


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first index of a tie, as torch's); on the CPU through numpy, many
    times faster than torch's CPU argmax."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(x.numpy().argmax(-1))
    return x.argmax(dim=-1)


def _uniforms(keys: tuple[torch.Tensor, torch.Tensor], first: int, count: int, rows=None) -> torch.Tensor:
    seeds, positions = keys
    if rows is not None:
        seeds, positions = seeds[rows], positions[rows]
    return uniforms(seeds, positions, first, count)


def _draw(probs: torch.Tensor, params: torch.Tensor, host: np.ndarray, tau, closes, vals, idx, keys):
    """Each row's token from its kept set (``tau``), by its draws 0 and 1 (``keys``: the rows'
    seeds and positions, int64 tensors on the probabilities' device); rows whose top-p cut lies
    past the window draw by ``_draw_nucleus``."""
    u = _uniforms(keys, 0, 2)
    if tau is None:
        return _inverse_cdf(probs, u)
    drawn = idx.gather(1, _inverse_cdf(vals * _above(vals, tau[:, None], strict=False), u)[:, None]).squeeze(1)
    if vals.shape[1] < probs.shape[1]:
        vocab = probs.shape[1]
        wide = ~closes  # kept sets wider than the window: the whole row
        cut = wide & ((params[:, TOP_P] < 1.0) | (params[:, TOP_K] < vocab))  # ... and their cut is unknown
        rows = torch.nonzero(wide & ~cut).flatten()
        if rows.numel():  # min-p or nothing: tau is exact
            sub, sub_tau = probs[rows], tau[rows]
            drawn.index_copy_(0, rows, _inverse_cdf(sub * _above(sub, sub_tau[:, None], strict=False), u[rows]))
        rows = torch.nonzero(cut).flatten()
        if rows.numel():
            drawn.index_copy_(0, rows, _draw_nucleus(probs[rows], params[rows], host[rows.cpu().numpy()],
                                                     (keys[0][rows], keys[1][rows])))
    return drawn


def _draw_nucleus(probs: torch.Tensor, params: torch.Tensor, host: np.ndarray, keys, max_rounds: int = 64):
    """Rows drawn without finding their top-p cut (FlashInfer's sorting-free rejection): draw x
    from the tokens above a pivot (min-p's cut at first); keep it when the mass of the tokens more
    likely than x is below top-p (x is in the nucleus), else raise the pivot to x and draw again.
    A kept draw is distributed as p on the nucleus, since every pivot lies below it; each round
    keeps a row with probability at least top-p. ``probs`` may be unnormalised. Rows with a top-k
    cut, or left after ``max_rounds``, are sorted. Round r draws by the rows' draws 2r and 2r + 1
    (``keys``: their seeds and positions; round 0's are those ``_draw`` and ``_draw_quick`` give a
    row without a cut, so that a row draws the same whichever of them takes it), a sorted row by
    draws 2 * max_rounds and the next. CPU only: the rounds' bookkeeping is on the host."""
    m, vocab = probs.shape
    if (host[:, MIN_P] > 0).any():  # what min-p leaves; top-p is taken on it, renormalised
        weights = probs * _above(probs, probs.amax(-1, keepdim=True) * params[:, MIN_P, None], strict=False)
    else:
        weights = probs
    limit = (params[:, TOP_P] * weights.sum(-1)).numpy()
    whole = host[:, TOP_P] >= 1.0  # nothing to cut: the first draw stands
    out = np.empty(m, dtype=np.int64)
    todo = np.flatnonzero(host[:, TOP_K] >= vocab)
    w = weights if len(todo) == m else weights[torch.from_numpy(todo)]
    for r in range(max_rounds):
        if not len(todo):
            break
        x = _inverse_cdf(w, _uniforms(keys, 2 * r, 2, torch.from_numpy(todo)))
        ok = whole[todo]
        if not ok.all():
            px = w.gather(1, x[:, None])
            above = (w * _above(w, px)).sum(-1)  # every token above x lies above the pivot: w holds them all
            ok = ok | (above.numpy() < limit[todo])
        out[todo[ok]] = x.numpy()[ok]
        if ok.all():
            todo = todo[:0]
            break
        redo = torch.from_numpy(np.flatnonzero(~ok))
        w, todo = w[redo], todo[~ok]
        w = w * _above(w, px[redo])
    rest = host[:, TOP_K] < vocab
    rest[todo] = True
    if rest.any():
        rows = torch.from_numpy(np.flatnonzero(rest))
        sub = weights[rows]
        sub_tau, _, _, _ = _keep_threshold(sub, params[rows], host[rest], vocab)
        u = _uniforms(keys, 2 * max_rounds, 2, rows)
        out[rest] = _inverse_cdf(sub * _above(sub, sub_tau[:, None], strict=False), u).numpy()
    return torch.from_numpy(out)


def _masked(x: torch.Tensor, probs: torch.Tensor, tau) -> torch.Tensor:
    return x if tau is None else x.masked_fill(probs < tau[:, None], float("-inf"))


def _window(vocab: int) -> int:
    return min(WINDOW, max(16, vocab // 16))


def _random_rows(logits: torch.Tensor, batch: SamplingBatch, exact_all: bool):
    """Temperature-scaled logits, probabilities and kept-set threshold of the non-greedy rows
    (exact for every row when ``exact_all``; else a row whose cut lies past the window is left to
    ``_draw_nucleus``), and their row indices (None: all rows)."""
    rand = None
    params, host = batch.params, batch.host_params
    if batch.greedy.any():
        keep = np.flatnonzero(~batch.greedy)
        rand = torch.as_tensor(keep, device=logits.device)
        logits, params, host = logits.index_select(0, rand), params.index_select(0, rand), host[keep]
    x = logits / params[:, TEMPERATURE, None]
    probs = x.softmax(dim=-1)
    window = _window(probs.shape[1]) if probs.device.type == "cpu" else probs.shape[1]
    exact = None if exact_all else np.zeros(len(host), dtype=bool)
    return rand, x, probs, params, host, _keep_threshold(probs, params, host, window, exact)


def _keys(batch: SamplingBatch, device: torch.device, idx: np.ndarray | None = None):
    """The rows' (seeds, positions) as int64 tensors on ``device`` (rows ``idx``, or all)."""
    seeds, positions = (batch.seeds, batch.positions) if idx is None else (batch.seeds[idx], batch.positions[idx])
    return (torch.from_numpy(np.ascontiguousarray(seeds, dtype=np.int64)).to(device),
            torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(device))


def sample_batch(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[n, vocab] fp32 logits -> [n] sampled token ids (on the logits' device; on a GPU with no
    host sync)."""
    if _kernel_takes_all(logits, batch):  # the CPU kernel: penalties and draw in one call, every row
        if batch.matchers is not None:  # structured output: forbidden tokens -> -inf first
            logits = apply_grammar_masks(logits, batch.matchers)
        return cpu_kernels.sample(logits, batch.greedy, batch.host_params, batch.bias, batch.rep, batch.seeds,
                                  batch.positions)
    logits = process_logits(logits, batch)
    if batch.greedy.all():
        return _argmax(logits)
    quick = _quick_rows(batch, logits)
    if not quick.any():
        return _sample_processed(logits, batch)
    if quick.all():
        return _draw_quick(logits, batch.params, batch.host_params, _keys(batch, logits.device))
    out = _argmax(logits)  # the greedy rows' tokens; the others are overwritten
    idx = np.flatnonzero(quick)
    sel = torch.as_tensor(idx, device=logits.device)
    out.index_copy_(0, sel, _draw_quick(logits.index_select(0, sel), batch.params.index_select(0, sel),
                                        batch.host_params[idx], _keys(batch, logits.device, idx)))
    idx = np.flatnonzero(~quick & ~batch.greedy)
    if len(idx):
        sel = torch.as_tensor(idx, device=logits.device)
        out.index_copy_(0, sel, _sample_processed(logits.index_select(0, sel), _subset(batch, idx)))
    return out


def _kernel_takes_all(logits: torch.Tensor, batch: SamplingBatch) -> bool:
    """Whether ``cpu_kernels`` samples the batch (every row of it: on the CPU whenever the kernel
    can read these tensors), except a batch of plain greedy rows, which numpy's argmax takes (the
    same tokens: the kernel's argmax is the first index of the maximum too)."""
    if logits.device.type != "cpu":
        return False
    if batch.greedy.all() and batch.bias is None and batch.rep is None and batch.matchers is None:
        return False
    return cpu_kernels.usable(logits, batch.bias, batch.rep)


def _quick_rows(batch: SamplingBatch, logits: torch.Tensor) -> np.ndarray:
    """Host bool [n]: the rows ``_draw_quick`` takes (on the CPU: not greedy, no top-k)."""
    if logits.device.type != "cpu":
        return np.zeros(len(batch.greedy), dtype=bool)
    return ~batch.greedy & (batch.host_params[:, TOP_K] >= logits.shape[1])


def _draw_quick(logits: torch.Tensor, params: torch.Tensor, host: np.ndarray, keys) -> torch.Tensor:
    """Rows without top-k on the CPU (the torch path): temperature, then min-p and top-p by
    rejection (``_draw_nucleus``) over the unnormalised probabilities, with no top-k window and no
    sort: the fewest passes over the rows."""
    x = logits / params[:, TEMPERATURE, None]
    weights = x.sub_(x.amax(-1, keepdim=True)).exp_()  # the best token's weight is 1
    if not ((host[:, TOP_P] < 1.0) | (host[:, MIN_P] > 0)).any():
        return _inverse_cdf(weights, _uniforms(keys, 0, 2))
    return _draw_nucleus(weights, params, host, keys)


def _subset(batch: SamplingBatch, idx: np.ndarray) -> SamplingBatch:
    """Rows ``idx`` of a batch whose logits are processed already (no penalties, no grammar)."""
    sel = torch.as_tensor(idx, device=batch.params.device)
    return SamplingBatch(batch.params.index_select(0, sel), batch.greedy[idx], batch.host_params[idx],
                         batch.seeds[idx], batch.positions[idx])


def _sample_processed(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``sample_batch`` after ``process_logits``, through the top-k window (GPU; top-k rows on the CPU)."""
    rand, x, probs, params, host, (tau, closes, vals, idx) = _random_rows(logits, batch, exact_all=False)
    keys = _keys(batch, logits.device, None if rand is None else np.flatnonzero(~batch.greedy))
    drawn = _draw(probs, params, host, tau, closes, vals, idx, keys)
    if rand is None:
        return drawn
    return _argmax(logits).index_copy_(0, rand, drawn)


def processed_probs_batch(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[n, vocab] fp32 logits -> [n, vocab] the distribution each row is drawn from.

    A greedy row is a one-hot at the argmax of its penalised logits (the token ``sample_batch``
    gives it). Speculative verification needs these rows as explicit distributions (p in
    min(1, p/q)); building them from the same pieces as ``sample_batch`` makes it the same p.
    """
    logits = process_logits(logits, batch)
    one_hot = torch.nn.functional.one_hot(_argmax(logits), logits.shape[1]).to(logits.dtype)
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
    want = [r.params.engine_logprobs for r in rows]
    logprob_rows: list[TokenLogprobs | None] = [None] * len(rows)
    idx = [i for i, n in enumerate(want) if n is not None]
    if idx:
        sel = torch.tensor(idx, device=logits.device)
        reported = token_logprobs(logits[sel].log_softmax(dim=-1), token_ids[sel], [want[i] for i in idx])
        for i, lp in zip(idx, reported):
            logprob_rows[i] = lp
    return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprob_rows)
