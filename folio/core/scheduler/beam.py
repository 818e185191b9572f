"""Beam search bookkeeping that makes the same choices as transformers' ``_beam_search`` (5.x).

Pure Python, no torch: the executor runs every live beam through the model and hands back, per
beam, its best ``top_k`` token ids with their raw log-softmax logprobs; this module picks the
next live beams, collects finished hypotheses and says when the search is over. The scheduler
forks the KV blocks of a parent for each child (``Beam.parent_beam_id``) and frees the blocks of
parents that got no child (``StepDecision.freed_beam_ids``).

The algorithm, as HF runs it for a decoder-only model with ``do_sample=False`` and no logits
processors (W = ``width``, E = number of EOS ids, K = ``max(2, 1 + E) * W``):

1. Candidates. Every live beam extends by every token; a candidate's score is the beam's
   cumulative logprob plus the token's logprob. The best K candidates over all beams are kept, in
   rank order. K exceeds W so that at least W non-EOS candidates survive even when the best ones
   all end in EOS (each beam offers at most E EOS candidates). Each beam's own top K tokens are
   therefore enough to find the global top K.
2. Finished hypotheses. Only candidates ranked among the first W can finish; an EOS candidate
   ranked W+1..K is simply dropped (it neither finishes nor continues). A finished candidate is
   scored ``cum_logprob / L ** length_penalty`` where L is the number of GENERATED tokens including
   the one just chosen (the EOS token counts; the prompt does not). At most W finished hypotheses
   are kept: the new ones are merged with the old and the best W stay.
3. Running beams. The best W candidates that did not finish (non-EOS, from anywhere in the top K)
   become the next live beams, ranked best first, with their raw (unpenalised) cumulative logprob.
4. The length limit. At the step whose token makes L == ``max_tokens`` every candidate counts as
   finished, so the first W candidates all enter the finished pool (finish reason "length", or
   "stop" if the token is an EOS) and compete with the hypotheses that ended by EOS earlier; the
   search ends. So there are always W finished hypotheses at the end, even if none hit EOS.
5. Stopping early, checked after each step once W hypotheses have finished:
   - ``early_stopping=True``: stop as soon as W hypotheses have finished.
   - ``early_stopping=False``: stop when the best live beam, scored as if it finished now
     (``cum / L ** length_penalty``, L = current generated length), is not better than the worst
     finished hypothesis. With a positive length penalty a longer beam could still win; HF accepts
     that heuristic.
   - ``early_stopping="never"``: as False, but with ``length_penalty > 0`` the best live beam is
     scored at L = ``max_tokens`` (the most a longer sequence could gain); with a penalty <= 0 the
     current length is already the best case.

HF starts with W copies of the prompt scored ``[0, -1e9, ...]`` so that only the first copy's
tokens are candidates at step one; here one live beam gives the same candidates, provided the
vocabulary holds at least K tokens.

Arithmetic is float32, as in HF: sums and penalised scores are rounded to float32 after each
operation (the penalty ``L ** length_penalty`` is a Python float that torch casts to float32
before dividing), so that near-ties rank the same way. Exact ties: HF uses ``torch.topk``, whose
order among equal values is implementation-defined (on CPU it is not lowest-index-first). We break
ties by the lowest flattened index, i.e. earlier live beam (in rank order) first, then smaller
token id; in the finished pool an older hypothesis wins a tie over a newer one. With real
float32 logprobs exact ties are rare; this is the only place we may differ.

Output token ids include the EOS token that ended a hypothesis, as HF's ``sequences`` do.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

EarlyStopping = bool | Literal["never"]


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (HF keeps beam scores in float32)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass
class Beam:
    """A live beam: its generated tokens and their summed logprob (float32, not length-penalised)."""

    beam_id: int
    output_token_ids: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0
    parent_beam_id: int | None = None


@dataclass
class StepDecision:
    """What one step decided. ``beams``: the live beams for the next step, best first (empty once
    the search is done). ``freed_beam_ids``: previous live beams that got no child."""

    beams: list[Beam]
    freed_beam_ids: list[int]


class Hypothesis(NamedTuple):
    """A finished sequence: generated tokens, length-penalised score, "stop" (EOS) or "length"."""

    output_token_ids: list[int]
    score: float
    finish_reason: str


class _Candidate(NamedTuple):
    score: float  # parent's cum_logprob + token logprob, float32
    slot: int  # the parent's rank among the live beams
    token_id: int


class BeamSearch:
    """One request's beam search. Drive it with ``step`` until ``done``, then read ``results``."""

    def __init__(
        self,
        width: int,
        *,
        length_penalty: float = 1.0,
        early_stopping: EarlyStopping = False,
        max_tokens: int,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not (early_stopping is True or early_stopping is False or early_stopping == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
        self.width = width
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        # HF: beams_to_keep = max(2, 1 + n_eos) * num_beams
        self.top_k = max(2, 1 + len(self.eos_token_ids)) * width
        self._ids = itertools.count(1)
        self._live: list[Beam] = [Beam(beam_id=0)]
        self._finished: list[Hypothesis] = []  # best first, at most `width`
        self._num_generated = 0
        self._done = False

    @property
    def beams(self) -> list[Beam]:
        """The live beams, best first (the order HF keeps them in, which tie-breaking follows)."""
        return list(self._live)

    @property
    def finished(self) -> list[Hypothesis]:
        """The hypotheses finished so far, best first (at most ``width``; ``results`` once done)."""
        return list(self._finished)

    @property
    def done(self) -> bool:
        return self._done

    def _penalised(self, cum_logprob: float, length: int) -> float:
        return _f32(cum_logprob / _f32(length**self.length_penalty))

    def step(self, top: Mapping[int, tuple[Sequence[int], Sequence[float]]]) -> StepDecision:
        """Advance by one token. ``top`` maps every live beam id to its best ``top_k`` token ids
        and their raw log-softmax logprobs (more are harmless; fewer can change the outcome).

        Once the search is done the decision has no beams: the beams still running are dropped
        (HF returns only finished hypotheses) and every previous live beam is freed."""
        if self._done:
            raise RuntimeError("beam search is already done")
        if set(top) != {b.beam_id for b in self._live}:
            raise ValueError(f"expected logprobs for beams {[b.beam_id for b in self._live]}, got {sorted(top)}")
        length = self._num_generated + 1  # generated tokens once this step's token is appended
        candidates = self._top_candidates(top)
        at_limit = length >= self.max_tokens
        self._add_finished(candidates[: self.width], length, at_limit)
        running = [] if at_limit else [c for c in candidates if c.token_id not in self.eos_token_ids][: self.width]
        children = [
            Beam(
                beam_id=next(self._ids),
                output_token_ids=self._live[c.slot].output_token_ids + [c.token_id],
                cum_logprob=c.score,
                parent_beam_id=self._live[c.slot].beam_id,
            )
            for c in running
        ]
        self._num_generated = length
        self._done = not children or self._should_stop(children[0], length)
        if self._done:
            children = []
        parents = {c.parent_beam_id for c in children}
        freed = [b.beam_id for b in self._live if b.beam_id not in parents]
        self._live = children
        return StepDecision(beams=children, freed_beam_ids=freed)

    def _top_candidates(self, top: Mapping[int, tuple[Sequence[int], Sequence[float]]]) -> list[_Candidate]:
        """The best ``top_k`` extensions over all live beams, best first (ties: lower slot, then token)."""
        candidates = []
        for slot, beam in enumerate(self._live):
            token_ids, logprobs = top[beam.beam_id]
            if len(token_ids) != len(logprobs):
                raise ValueError(f"beam {beam.beam_id}: {len(token_ids)} token ids but {len(logprobs)} logprobs")
            for token_id, logprob in zip(token_ids, logprobs):
                candidates.append(_Candidate(_f32(beam.cum_logprob + logprob), slot, int(token_id)))
        candidates.sort(key=lambda c: (-c.score, c.slot, c.token_id))
        return candidates[: self.top_k]

    def _add_finished(self, first: list[_Candidate], length: int, at_limit: bool) -> None:
        """Merge the candidates among the first W that finish (EOS, or any at the length limit)
        into the finished pool, keeping the best W (an older hypothesis wins a tie)."""
        new = []
        for c in first:
            is_eos = c.token_id in self.eos_token_ids
            if is_eos or at_limit:
                tokens = self._live[c.slot].output_token_ids + [c.token_id]
                new.append(Hypothesis(tokens, self._penalised(c.score, length), "stop" if is_eos else "length"))
        merged = self._finished + new
        merged.sort(key=lambda h: -h.score)  # stable: older first among equals
        self._finished = merged[: self.width]

    def _should_stop(self, best_running: Beam, length: int) -> bool:
        """HF's end-of-step test (the length limit is handled by the caller)."""
        if len(self._finished) < self.width:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = length
        best_possible = self._penalised(best_running.cum_logprob, best_length)
        return not best_possible > self._finished[-1].score

    def results(self, n: int | None = None) -> list[Hypothesis]:
        """The best ``n`` (default: ``width``) finished hypotheses, best first."""
        if not self._done:
            raise RuntimeError("beam search is not done yet")
        n = self.width if n is None else n
        if not 1 <= n <= self.width:
            raise ValueError(f"n must be in 1..{self.width}, got {n}")
        return list(self._finished[:n])
