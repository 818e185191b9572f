"""``SamplingParams`` of the offline API, with vLLM's names and defaults.

``folio.LLM`` turns each prompt and its params into the ``GenerateRequest`` the gateway would
send the tokenizer for the same OpenAI request (``to_generate_request``): ``n`` choices forked
from the first, ``best_of`` sequences of which the ``n`` with the highest cumulative logprob are
kept, or beam search (``use_beam_search``: ``best_of`` or ``n`` beams, the best ``n`` returned).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from folio.shared import messages


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per output token; the chosen one always comes too
    prompt_logprobs: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self):
        for bad, message in (
            (self.n < 1, "n must be at least 1"),
            (self.best_of is not None and self.best_of < self.n, "best_of must be at least n"),
            (self.temperature < 0, "temperature must be non-negative"),
            (not 0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k < -1, "top_k must be -1 (off), 0 (off) or positive"),
            (not 0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty <= 0, "repetition_penalty must be positive"),
            (self.max_tokens < 1, "max_tokens must be at least 1"),
            (self.logprobs is not None and self.logprobs < 0, "logprobs must be non-negative"),
            (self.prompt_logprobs is not None and self.prompt_logprobs < 0, "prompt_logprobs must be non-negative"),
            (self.use_beam_search and self.temperature > 0,
             "beam search is deterministic: set temperature=0"),
            (self.use_beam_search and (self.stop or self.logprobs is not None),
             "stop strings and logprobs are not supported with use_beam_search"),
            (self.early_stopping not in (True, False, "never"), "early_stopping must be True, False or 'never'"),
        ):
            if bad:
                raise ValueError(message)

    @property
    def num_sequences(self) -> int:
        """Sequences generated per prompt: ``best_of`` (the best ``n`` are returned) or ``n``."""
        return max(self.n, self.best_of or 1)

    @property
    def ranks_by_logprob(self) -> bool:
        """More sequences than choices, without beam search: the best ``n`` by cumulative logprob."""
        return not self.use_beam_search and self.num_sequences > self.n

    def stop_strings(self) -> list[str]:
        if not self.stop:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def engine_sampling(self) -> messages.SamplingParams:
        logprobs = self.logprobs
        if logprobs is None and self.ranks_by_logprob:
            logprobs = 0  # best_of ranks the sequences by their cumulative logprob
        return messages.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k if self.top_k > 0 else None,
            min_p=self.min_p, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, max_tokens=self.max_tokens,
            stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs)

    def to_generate_request(self, req_id: str, **prompt) -> messages.GenerateRequest:
        """The request for one prompt (``prompt``: ``prompt=``, ``prompt_token_ids=`` or
        ``messages=`` with chat options); its sequences are ``<req_id>-<i>``."""
        num = self.num_sequences
        beam = None
        if self.use_beam_search:
            beam = messages.BeamSearchParams(width=num, length_penalty=self.length_penalty,
                                             early_stopping=self.early_stopping)
            num = self.n  # the choices receive the best beams
        return messages.GenerateRequest(
            req_id=f"{req_id}-0", fork_req_ids=[f"{req_id}-{i}" for i in range(1, num)],
            sampling=self.engine_sampling(), stop=self.stop_strings(), beam_search=beam, **prompt)
