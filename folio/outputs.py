"""What ``folio.LLM`` returns, in vLLM's shapes: one ``RequestOutput`` per prompt, holding a
``CompletionOutput`` per choice (text, token ids, logprobs, finish reason).

``RequestBuilder`` folds the engine's ``TextDelta``s of one prompt's sequences into them, the way
the gateway folds them into one OpenAI response.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from folio.core.input_processor import best_of_order
from folio.shared.messages import TextDelta, TextLogprob


@dataclass
class Logprob:
    """One token's logprob; ``rank`` among the whole vocabulary (1: the most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# a position's alternatives: token id -> its Logprob (the top ones, and always the chosen token)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" (EOS, a stop token or string), "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ScoringOutput:
    score: float  # p(yes) of a yes/no reranker


@dataclass
class PoolingRequestOutput:
    """What ``LLM.embed`` and ``LLM.score`` return per input (vLLM's shape: ``out.outputs.embedding``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ScoringOutput
    finished: bool = True
    num_cached_tokens: int = 0


def position_logprobs(item: TextLogprob) -> PositionLogprobs | None:
    """vLLM's per-position dict; None for the first prompt token, which has no logprob."""
    if item.logprob is None:
        return None
    ranked = {t.token_id: Logprob(t.logprob, rank, t.token) for rank, t in enumerate(item.top, start=1)}
    ranked[item.token_id] = Logprob(item.logprob, item.rank, item.token)
    return ranked


class RequestBuilder:
    """One prompt's sequences (``sequence_ids``, in index order) folded into a ``RequestOutput``;
    ``num_choices`` of them are returned: all, or the best by cumulative logprob (``best_of``)."""

    def __init__(self, request_id: str, sequence_ids: list[str], prompt: str | None, prompt_token_ids: list[int],
                 num_choices: int, want_logprobs: bool):
        self.request_id = request_id
        self.index = {seq_id: i for i, seq_id in enumerate(sequence_ids)}
        self.sequences = [CompletionOutput(index=i) for i in range(len(sequence_ids))]
        self.prompt, self.prompt_token_ids = prompt, prompt_token_ids
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.num_choices, self.want_logprobs = num_choices, want_logprobs
        self.num_cached_tokens = 0
        self.errors: list[str] = []
        self.pooled: bytes | None = None  # a pooling request's vector (little-endian float32)

    @property
    def finished(self) -> bool:
        return all(s.finished() for s in self.sequences)

    def add(self, delta: TextDelta) -> None:
        seq = self.sequences[self.index[delta.req_id]]
        seq.text += delta.text
        seq.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            seq.logprobs = (seq.logprobs or []) + [position_logprobs(x) for x in delta.logprobs]
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + sum(x.logprob or 0.0 for x in delta.logprobs)
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [position_logprobs(x) for x in delta.prompt_logprobs]
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.pooled is not None:
            self.pooled = delta.pooled
        if delta.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = delta.finish_reason, delta.stop_reason
            if delta.error:
                self.errors.append(delta.error)

    def build(self) -> RequestOutput:
        chosen = self.sequences
        if len(chosen) > self.num_choices:  # best_of
            order = best_of_order([s.cumulative_logprob or 0.0 for s in chosen], self.num_choices)
            chosen = [chosen[i] for i in order]
        outputs = []
        for index, seq in enumerate(chosen):
            seq.index = index
            if not self.want_logprobs:
                seq.logprobs = seq.cumulative_logprob = None
            outputs.append(seq)
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             prompt_logprobs=self.prompt_logprobs, outputs=outputs, finished=self.finished,
                             num_cached_tokens=self.num_cached_tokens)
