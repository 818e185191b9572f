"""Which proposer the config names (``make_proposer``), and when to use it: the runner asks
``SpecController`` each step whether drafting pays.

More in docs/modules.md (folio/core/executor/runtime/spec_control.py).
"""

from __future__ import annotations

import torch

from folio.core.executor.runtime.spec_decode import DraftModelProposer, NgramProposer
from folio.core.executor.runtime.spec_suffix import SuffixProposer
from folio.core.executor.runtime.spec_config import PAYOFFS, speculative_settings

PLAIN, SPEC = 0, 1


class _Bucket:
    __slots__ = ("rate", "num_samples", "num_decisions", "since_explore", "inherited")

    def __init__(self, prior: "_Bucket | None" = None):
        self.rate = [0.0, 0.0]  # tokens per second, decaying mean, per arm
        self.num_samples = [0, 0]
        self.inherited = [False, False]
        if prior is not None:  # a larger batch's clear verdict, replaced by this bucket's first samples
            self.rate, self.num_samples, self.inherited = list(prior.rate), [1, 1], [True, True]
        self.num_decisions = 0
        self.since_explore = 0  # decisions since the slower arm was last tried


class SpecController:
    """Per batch-size bucket, the decaying tokens/s of steps with and without drafts; the faster
    arm is taken, the slower tried again now and then. What counts as a step's tokens is the
    ``payoff``: "served" (a server's stack, where a row that finishes early is refilled by the next
    request, so every token a step gains is real: the step's tokens) or "closed" (a batch that runs
    until its last row ends and is not refilled, ``LLM.generate`` on a fixed set: the batch's end
    moves only with the row furthest behind, so a step counts that row's tokens once per row)."""

    def __init__(self, explore_every: int = 16, min_samples: int = 3, decay: float = 0.8,
                 max_explore_every: int = 256, clear_ratio: float = 1.5, payoff: str = "served"):
        if payoff not in PAYOFFS:
            raise ValueError(f"payoff must be one of {', '.join(PAYOFFS)}, not {payoff!r}")
        self.payoff = payoff
        self.progress: dict[str, int] = {}  # closed: each running request's tokens so far
        self.explore_every, self.min_samples, self.decay = explore_every, min_samples, decay
        self.clear_ratio = clear_ratio  # one arm this much faster after one try each: no more tries yet
        self.max_explore_every = max_explore_every
        self.buckets: dict[int, _Bucket] = {}
        self.pending: tuple[int, int, float] | None = None  # (bucket, arm, seconds spent proposing)
        self.num_steps = [0, 0]  # decisions per arm
        self.last: tuple[int | None, int] | None = None  # (bucket, arm) of the latest decision

    @staticmethod
    def bucket_of(num_rows: int) -> int:
        return max(1, num_rows).bit_length()

    def choose(self, num_rows: int) -> bool:
        """Whether the next step of these ``num_rows`` sampling rows should carry drafts."""
        key = self.bucket_of(num_rows)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(self._prior(key))
        b.num_decisions += 1
        num_plain, num_spec = b.num_samples
        settled = min(num_spec, num_plain) >= self.min_samples or (min(num_spec, num_plain) >= 1 and self._clear(b))
        if not settled:  # one try each, then more only while they are close
            # the decision before this one is measured only after this one is made: count it as made
            tries = [num_plain, num_spec]
            if self.last is not None and self.last[0] in (key, None):
                tries[self.last[1]] += 1
            arm = SPEC if tries[SPEC] <= tries[PLAIN] else PLAIN
            if arm == SPEC and num_plain == 0 and tries[PLAIN]:  # a first comparison is on its way
                arm = PLAIN
        else:
            best = SPEC if b.rate[SPEC] >= b.rate[PLAIN] else PLAIN
            b.since_explore += 1
            arm = best
            if b.since_explore >= self.explore_interval(b.rate[best], b.rate[1 - best]):
                arm, b.since_explore = 1 - best, 0
        self.num_steps[arm] += 1
        self.last = (key, arm)
        return arm == SPEC

    def first_decision(self, speculate: bool) -> None:
        """The decision the runner starts with, before any ``choose`` (its bucket is not known yet)."""
        self.last = (None, SPEC if speculate else PLAIN)

    def _prior(self, key: int) -> _Bucket | None:
        """The nearest larger bucket measured on both arms, when drafting clearly lost there: a batch
        shrinks through the buckets as its requests finish, and drafting costs more the larger
        the batch, so its first steps here need not pay for a try that a larger batch already made."""
        larger = [k for k, b in self.buckets.items() if k > key and min(b.num_samples) >= 1]
        if not larger:
            return None
        near = self.buckets[min(larger)]
        return near if self._clear(near) and near.rate[PLAIN] > near.rate[SPEC] else None

    def _clear(self, b: _Bucket) -> bool:
        """One arm is at least ``clear_ratio`` times faster than the other."""
        return max(b.rate) >= self.clear_ratio * min(b.rate)

    def explore_interval(self, best_rate: float, other_rate: float) -> int:
        """Decisions between two tries of the slower arm: longer the more it loses."""
        ratio = best_rate / max(other_rate, 1e-9)
        return int(min(self.max_explore_every, self.explore_every * ratio * ratio))

    def proposed(self, num_rows: int, speculate: bool, seconds: float) -> None:
        """The decision for the next step, and what its proposing cost."""
        self.pending = (self.bucket_of(num_rows), SPEC if speculate else PLAIN, seconds)

    def observe(self, seconds: float, num_tokens: int, decode_only: bool,
                per_request: dict[str, int] | None = None) -> None:
        """The step that the pending decision was for ran: ``num_tokens`` sampled in ``seconds``
        (``per_request``: each sampling request's share, which the closed payoff needs)."""
        if self.payoff == "closed" and per_request:
            num_tokens = self._laggard_tokens(per_request)
        pending, self.pending = self.pending, None
        if pending is None or not decode_only or num_tokens <= 0:
            return
        bucket, arm, propose_s = pending
        b = self.buckets.setdefault(bucket, _Bucket())
        rate = num_tokens / max(seconds + propose_s, 1e-9)
        if b.inherited[arm]:  # the first sample here: the other arm's inherited rate keeps its ratio to it
            if b.inherited[1 - arm]:
                b.rate[1 - arm] *= rate / max(b.rate[arm], 1e-9)
            b.rate[arm], b.inherited[arm] = rate, False
        else:
            b.rate[arm] = rate if b.num_samples[arm] == 0 else self.decay * b.rate[arm] + (1 - self.decay) * rate
        b.num_samples[arm] += 1

    def _laggard_tokens(self, per_request: dict[str, int]) -> int:
        """The closed payoff's tokens of a step: how far it moved the fewest tokens any request
        has so far, once per request (requests absent from the step have finished: forgotten)."""
        before = [self.progress.get(r, 0) for r in per_request]
        self.progress = {r: b + n for (r, n), b in zip(per_request.items(), before)}
        return len(per_request) * (min(self.progress.values()) - min(before))

    def stats(self) -> dict:
        return {"spec_payoff": self.payoff,
                "spec_steps_speculated": self.num_steps[SPEC], "spec_steps_plain": self.num_steps[PLAIN],
                "spec_rates_by_batch": {f"{1 << (k - 1)}+": [round(r, 1) for r in b.rate]
                                        for k, b in sorted(self.buckets.items())}}


def make_proposer(config, target_model, device: torch.device, dtype: torch.dtype, backend, num_target_blocks: int):
    """The proposer ``--speculative-config`` (or its older flags) asks for, or None."""
    target_spec = target_model.spec
    settings = speculative_settings(config)
    if settings is None:
        return None
    k = settings.num_speculative_tokens
    if settings.method == "ngram":
        return NgramProposer(k, settings.prompt_lookup_min, settings.prompt_lookup_max)
    if settings.method == "suffix":
        return SuffixProposer(k, settings.suffix_max_depth, settings.suffix_max_cached_requests,
                              settings.suffix_max_spec_factor, settings.suffix_min_token_prob,
                              settings.prompt_lookup_min, settings.prompt_lookup_max)
    if settings.method == "eagle3":
        return make_eagle_proposer(settings.model, target_model, k, device, dtype)
    from folio.core.model_files import resolve_model

    num_blocks = config.num_draft_kv_blocks or num_target_blocks
    if backend.name == "cpu":  # its layer ops are shaped for the target's (quantized) layers
        from folio.core.executor.kernels.attention import TorchAttentionBackend

        backend = TorchAttentionBackend()
    return DraftModelProposer(str(resolve_model(settings.model)), k, target_spec.vocab_size, config.block_size,
                              num_blocks, device, dtype, backend)


def make_eagle_proposer(folder: str | None, target_model, k: int, device: torch.device, dtype: torch.dtype):
    """The eagle3 head in ``folder`` (or the one shipped for this model), checked against the target."""
    from pathlib import Path

    from folio.core.executor.runtime.spec_eagle import EagleProposer, load_head, shipped_head

    if folder is not None and not Path(folder).is_dir():
        raise ValueError(f"eagle3 draft head folder {folder} does not exist")
    path = Path(folder) if folder is not None else shipped_head(target_model)
    head_dtype = torch.float32 if device.type == "cpu" else dtype
    return EagleProposer(load_head(path, target_model, head_dtype, device), target_model, k, device)
