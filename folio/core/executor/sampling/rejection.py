"""Speculative decoding's verifier: lossless rejection sampling (Leviathan et al. 2023, Chen et al.
2023). The runner calls ``verify`` after the target model has scored each request's k drafts plus
one bonus position in a single forward pass; it returns the tokens to append.

The rule, per draft x at position j, with p the target's distribution (``processed_probs``: the
same penalties, temperature and masks plain sampling uses) and q the proposer's:
- accept x with probability min(1, p(x)/q(x));
- at the first rejection stop and sample from normalize(max(0, p - q)); the drafts after it are
  dropped (they were conditioned on the rejected token);
- when all k are accepted, sample one bonus token from p at position k.
Whatever q is, each output token is distributed exactly as plain sampling from p would have drawn
it, so speculation changes speed, never the output distribution. A deterministic proposer (n-gram
lookup) passes no q: a point mass on x, so x is accepted with probability p(x) and a rejection
samples from p without x. Greedy requests skip the coin: a draft stands while it equals the target
argmax, and the first mismatch (or the bonus position) outputs that argmax, which is exactly the
token plain greedy decoding gives.

Randomness. The accept test draws u ~ U(0, 1] and accepts when u * q(x) < p(x) (that is u <
min(1, p(x)/q(x)); written this way it needs no division, accepts a token q thought impossible,
and never accepts a token p rules out). The resample and the bonus invert the cumulative
distribution of r (the residual, or p) with one uniform, which draws from r / sum(r) without
normalising r. The uniforms are the sampler's (``philox.py``), keyed as plain sampling keys its
draws: for output position j = len(output_token_ids) + the draft's index, the row's seed (a seeded
request's own; the runner's per-request random seed otherwise, ``SamplingRow.seed``) and position
j, draw 0 for the token and draw 1 for the coin. A request's tokens thus do not depend on the batch,
and a verification that starts over draws the same. A seeded draft model must not draw its
proposals from this same stream (``spec_decode`` salts its seed), or q's sample and the verifier's
coin would be correlated and the output no longer exactly p.
"""

from __future__ import annotations

import torch

from folio.core.executor.sampling.philox import uniforms
from folio.core.executor.sampling.sampler import (SamplingBatch, SamplingRow, _argmax, _search, has_penalties,
                                                  process_logits, processed_probs)

__all__ = ["num_accepted", "processed_probs", "verify", "verify_tree"]


def verify(
    target_logits: torch.Tensor,  # [sum(k_i + 1), vocab] fp32, request after request
    draft_token_ids: list[list[int]],  # per request, its k_i drafts
    draft_probs: list[torch.Tensor | None],  # per request, q as [k_i, vocab], or None: point masses
    rows: list[SamplingRow],  # per request, its state BEFORE the drafts
) -> list[list[int]]:
    """Per request, the accepted drafts followed by one more token (1 to k_i + 1 tokens).

    Row j of request i's block of ``target_logits`` scores the position of draft j, row k_i the
    bonus position. The target distribution at position j sees the output history
    ``output_token_ids + drafts[:j]``, just as plain decoding would have seen those tokens had it
    sampled them. ``draft_probs[i]`` must already be processed with the request's sampling params
    (the draft model samples from it); a greedy request ignores it.
    """
    num_reqs = len(rows)
    if not len(draft_token_ids) == len(draft_probs) == num_reqs:
        raise ValueError("one draft list, one draft_probs entry and one SamplingRow per request")
    num_drafts = [len(d) for d in draft_token_ids]
    row_starts = _starts([k + 1 for k in num_drafts])  # request i's first row in target_logits
    draft_starts = _starts(num_drafts)  # request i's first draft in the flat draft order
    if target_logits.shape[0] != sum(num_drafts) + num_reqs:
        needed = sum(num_drafts) + num_reqs
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows, the drafts need {needed}")

    device = target_logits.device
    draft_rows = torch.tensor(
        [row_starts[i] + j for i, k in enumerate(num_drafts) for j in range(k)], dtype=torch.long, device=device
    )
    drafts = torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.long, device=device)
    greedy = [r.params.greedy for r in rows]
    position_rows = _position_rows(rows, draft_token_ids)
    if all(greedy):  # the argmax of the processed logits, as plain greedy sampling takes it: no distributions
        batch = SamplingBatch.from_rows(position_rows, target_logits.shape[1], device)
        target_top = _argmax(process_logits(target_logits, batch))
    else:
        p = processed_probs(target_logits, position_rows)  # [num_rows, vocab]
        p_draft = p[draft_rows]  # [num_drafts, vocab]
        target_top = p.argmax(dim=-1)  # [num_rows]: the greedy rows' token (their p is a one-hot)
    candidates = target_top  # the token each row outputs if the walk stops there
    accepted = drafts == target_top[draft_rows]  # [num_drafts], the greedy rule

    if not all(greedy):
        token_u, uniform = _draws(p, rows, num_drafts)
        q = _draft_q(draft_probs, draft_token_ids, draft_starts, drafts, p_draft)
        p_x = p_draft.gather(1, drafts[:, None]).squeeze(1)
        q_x = q.gather(1, drafts[:, None]).squeeze(1)
        coin = uniform[draft_rows] * q_x < p_x
        residual = (p_draft - q).clamp_(min=0)
        # p == q up to rounding can leave nothing: then p itself is the right distribution
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_draft)
        # in place: p is ours and [num_rows, vocab] is large at a real vocabulary; p_draft is a copy
        dist = p.index_copy_(0, draft_rows, residual)  # bonus rows keep p
        drawn = _search(dist.cumsum_(dim=-1), token_u)
        row_greedy = torch.tensor([g for g, k in zip(greedy, num_drafts) for _ in range(k + 1)], device=device)
        candidates = torch.where(row_greedy, target_top, drawn)
        accepted = torch.where(row_greedy[draft_rows], accepted, coin)

    accepted_list, candidate_list = accepted.tolist(), candidates.tolist()
    out = []
    for i, drafts_i in enumerate(draft_token_ids):
        n = 0
        while n < num_drafts[i] and accepted_list[draft_starts[i] + n]:
            n += 1
        out.append(drafts_i[:n] + [candidate_list[row_starts[i] + n]])
    return out


def verify_tree(
    target_logits: torch.Tensor,  # [n + 1, vocab] fp32: row 0 scores the root's next position, row i node i's
    children: list[list[int]],  # per position (0: the root), its children's positions in rank order
    token_ids: list[int],  # the n nodes' tokens, breadth-first (node i at position i + 1)
    row: SamplingRow,  # the request's state BEFORE the drafts (no penalties: see below)
) -> tuple[list[int], list[int]]:
    """One request's tree of point-mass drafts: the tokens to append (the accepted path and one
    more token) and the accepted nodes' positions along the path.

    The walk starts at the root. Greedy: it moves to the child whose token is the target's argmax
    there and stops at a position without one, outputting that argmax, as ``verify`` does for a
    chain. Sampled: at a position with target distribution p, the children (distinct tokens, the
    proposer's top ones) are tried in rank order; child x is accepted with probability
    r(x) / sum(r), where r is p less the children rejected before it; when none is accepted the
    token is drawn from r. Each token is then output with exactly p's probability (a rejected
    child's mass is taken out and the rest renormalised: sampling without replacement), which for
    one child is ``verify``'s point-mass rule. The coins of position j are draws 1, 2, .. of the
    row's uniforms at output position ``len(output_token_ids) + depth``, the token draw 0, as a
    chain keys its own. Every position's history would be its own path, so a request with
    penalties is verified as a chain (the runner proposes it none)."""
    if has_penalties(row.params):
        raise ValueError("a request with penalties is verified as a chain, not a tree")
    n = len(token_ids)
    if target_logits.shape[0] != n + 1 or len(children) != n + 1:
        raise ValueError(f"a tree of {n} nodes needs {n + 1} target rows and child lists")
    rows = [row] * (n + 1)
    path: list[int] = []
    at, depth = 0, 0
    if row.params.greedy:
        top = _argmax(process_logits(target_logits, SamplingBatch.from_rows(rows, target_logits.shape[1],
                                                                               target_logits.device))).tolist()
        while True:
            nxt = next((c for c in children[at] if token_ids[c - 1] == top[at]), None)
            if nxt is None:
                return [token_ids[c - 1] for c in path] + [top[at]], path
            path.append(nxt)
            at = nxt
    p = processed_probs(target_logits, rows).double()
    key = torch.tensor([row.key()], dtype=torch.int64, device=p.device)
    start = len(row.output_token_ids)
    while True:
        kids = children[at]
        u = uniforms(key, torch.tensor([start + depth], dtype=torch.int64, device=p.device), 0, len(kids) + 1)[0]
        r = p[at].clone()
        nxt = None
        for rank, c in enumerate(kids):
            x = token_ids[c - 1]
            if float(u[rank + 1]) * float(r.sum()) < float(r[x]):
                nxt = c
                break
            r[x] = 0.0
        if nxt is None:
            if float(r.sum()) <= 0.0:  # the children held all of p's mass and were all refused: rounding
                r = p[at].clone()
            token = int(_search(r.cumsum(0)[None, :], u[:1]))
            return [token_ids[c - 1] for c in path] + [token], path
        path.append(nxt)
        at, depth = nxt, depth + 1


def num_accepted(outputs: list[list[int]]) -> list[int]:
    """Accepted drafts per request, for acceptance statistics: ``verify`` appends exactly one
    token after the accepted drafts, so this is each output's length minus one."""
    return [len(tokens) - 1 for tokens in outputs]


def _position_rows(rows: list[SamplingRow], draft_token_ids: list[list[int]]) -> list[SamplingRow]:
    """One SamplingRow per target row: at draft position j the history is output + drafts[:j].
    Only penalties read the history, so a request without them reuses its row instead of copying
    a long output list k + 1 times."""
    positions = []
    for r, drafts in zip(rows, draft_token_ids):
        if not has_penalties(r.params):
            positions += [r] * (len(drafts) + 1)
            continue
        positions += [
            SamplingRow(r.params, r.generator, r.prompt_token_ids, r.output_token_ids + drafts[:j], seed=r.seed)
            for j in range(len(drafts) + 1)
        ]
    return positions


def _starts(sizes: list[int]) -> list[int]:
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return starts


def _draws(p: torch.Tensor, rows: list[SamplingRow], num_drafts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per target row [num_rows], float64 in (0, 1]: the uniform of the token draw (draw 0) and of
    the accept test (draw 1; unused at the bonus rows), keyed by the request's seed and the row's
    output position."""
    keys, positions = [], []
    for r, k in zip(rows, num_drafts):
        key, start = r.key(), len(r.output_token_ids)
        keys += [key] * (k + 1)
        positions += range(start, start + k + 1)
    u = uniforms(torch.tensor(keys, dtype=torch.int64, device=p.device),
                 torch.tensor(positions, dtype=torch.int64, device=p.device), 0, 2)
    return u[:, 0], u[:, 1]


def _draft_q(
    draft_probs: list[torch.Tensor | None],
    draft_token_ids: list[list[int]],
    draft_starts: list[int],
    drafts: torch.Tensor,  # [num_drafts] the flat draft ids
    like: torch.Tensor,  # [num_drafts, vocab] p at the drafts
) -> torch.Tensor:
    """[num_drafts, vocab]: the proposer's q per draft, a one-hot on the draft where it gave none."""
    vocab = like.shape[1]
    q = torch.nn.functional.one_hot(drafts, vocab).to(like.dtype)
    given = [(i, probs) for i, probs in enumerate(draft_probs) if probs is not None and draft_token_ids[i]]
    for i, probs in given:
        if probs.shape != (len(draft_token_ids[i]), vocab):
            raise ValueError(f"draft_probs of shape {tuple(probs.shape)}, expected {(len(draft_token_ids[i]), vocab)}")
    if given:
        rows = [draft_starts[i] + j for i, _ in given for j in range(len(draft_token_ids[i]))]
        values = torch.cat([probs for _, probs in given]).to(device=like.device, dtype=like.dtype)
        q.index_copy_(0, torch.tensor(rows, dtype=torch.long, device=like.device), values)
    return q
