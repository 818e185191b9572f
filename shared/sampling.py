"""The sampling parameters: ``SamplingParams``, one msgspec Struct with vLLM's names and defaults.

The gateway's request models and ``folio.LLM`` build it; it is checked when built (``RULES``: a
bad value is a ``ParamError`` naming the parameter, which the gateway answers with a 400) and then
travels unchanged in the wire messages, gateway -> tokenizer -> scheduler -> executor, where the
sampler's columns are made of it (``folio/core/executor/kernels/sampler_columns.py``). The design,
and what each "off" value is: docs/architecture.md, "The sampling parameters".
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

GREEDY_TEMPERATURE = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS)


class ParamError(ValueError):
    """A parameter refused where the request is built; ``param`` names it (the gateway's 400 carries it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


POOLING_KINDS = ("embed", "score")
# encoder-only models (bidirectional attention): they pool, whole prompts, and never generate
ENCODER_ONLY_MODEL_TYPES = ("bert",)


class PoolingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A request that pools instead of generating: its prompt is computed (prefill only, under the
    same token budget, through the prefix cache) and its answer is one vector, never a token.

    ``embed``: the final hidden state (after the final norm) at the last prompt position, its first
    ``dimensions`` values kept (Matryoshka models: the leading values are an embedding of their own)
    and then L2-normalised when ``normalize``. ``score``: the logits of ``tokens`` at the last
    position (a yes/no reranker's: the client takes their softmax). ``tokens`` are vocabulary
    strings, resolved to ``token_ids`` by the tokenizer, which owns the vocabulary.
    ``bidirectional`` (set by the tokenizer for an encoder-only model, ``ENCODER_ONLY_MODEL_TYPES``):
    every prompt token sees every other, so the prompt is scheduled whole in one step and never
    through the prefix cache (a block's K/V depends on the tokens after it)."""

    kind: str = "embed"
    dimensions: int | None = None
    normalize: bool = True
    tokens: list[str] = []
    token_ids: list[int] = []
    bidirectional: bool = False

    def __post_init__(self):
        if self.kind not in POOLING_KINDS:
            raise ParamError(f"pooling kind must be one of {', '.join(POOLING_KINDS)}, not {self.kind!r}", "pooling")
        if self.dimensions is not None and self.dimensions < 1:
            raise ParamError("dimensions must be at least 1", "dimensions")
        if self.kind == "score" and not (self.tokens or self.token_ids):
            raise ParamError("a score names the tokens whose logits it returns", "pooling")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How the tokens of one request are picked, and how many. Each parameter's "off" value is its
    default. ``stop`` given as one string is that one stop string; ``top_k`` -1 (vLLM's older
    "off") is read as 0."""

    n: int = 1  # choices returned per prompt
    best_of: int | None = None  # sequences generated per prompt, the best n returned (None: n)
    temperature: float = 1.0  # below GREEDY_TEMPERATURE: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # None: a random seed per sequence
    max_tokens: int | None = 16  # None: as many as the context leaves after the prompt
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives reported per output token (0: the chosen token's only)
    prompt_logprobs: int | None = None  # the same for prompt tokens
    use_beam_search: bool = False  # best_of (or n) beams, the best n returned
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"
    # set: the request pools its prompt into a vector and generates nothing (``max_tokens`` unused)
    pooling: PoolingParams | None = None

    def __post_init__(self):
        # msgspec runs this on decoding too: a struct from a peer that breaks a rule is a
        # malformed message (a ValidationError), as any other
        if not isinstance(self.stop, list):  # a string is one stop string ("" or None: none)
            stop = ([self.stop] if self.stop else []) if isinstance(self.stop, str) else list(self.stop or ())
            msgspec.structs.force_setattr(self, "stop", stop)
        if not isinstance(self.stop_token_ids, list):
            msgspec.structs.force_setattr(self, "stop_token_ids", list(self.stop_token_ids or ()))
        if self.top_k == -1:
            msgspec.structs.force_setattr(self, "top_k", 0)
        for param, is_bad, message in RULES:
            if is_bad(self):
                raise ParamError(message, param)

    @property
    def pools(self) -> bool:
        """Whether the request is prefill only: its answer is a pooled vector, not tokens."""
        return self.pooling is not None

    @property
    def greedy(self) -> bool:
        """Whether each token is the most likely one (after penalties): decided here only."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def num_sequences(self) -> int:
        """Sequences generated per prompt: ``best_of`` (the best ``n`` are returned) or ``n``."""
        return max(self.n, self.best_of or 1)

    @property
    def ranks_by_logprob(self) -> bool:
        """More sequences than choices, without beam search: the best ``n`` by cumulative logprob."""
        return not self.use_beam_search and self.num_sequences > self.n

    @property
    def engine_logprobs(self) -> int | None:
        """The alternatives the engine reports per sampled token: ``logprobs``, or 0 (the chosen
        token's own) where best_of ranks sequences by their cumulative logprob; None: none."""
        if self.logprobs is None and self.ranks_by_logprob:
            return 0
        return self.logprobs

    def with_seed_offset(self, offset: int) -> "SamplingParams":
        """The params of choice ``offset`` of a seeded request with several choices: ``seed +
        offset`` (stepping down where that would leave the int64 range), so that choices differ
        yet each is reproducible."""
        if self.seed is None or offset == 0:
            return self
        seed = self.seed + offset if self.seed + offset < 2**63 else self.seed - offset
        return msgspec.structs.replace(self, seed=seed)


def _samples(p: SamplingParams) -> bool:
    """Whether anything but the most likely token could be picked."""
    return bool(not p.greedy or p.top_p < 1 or p.top_k > 0 or p.min_p or p.presence_penalty or p.frequency_penalty
                or p.repetition_penalty != 1.0)


Rule = tuple[str, Callable[[SamplingParams], bool], str]

# (param, is_bad, message), checked in order; the first that holds is the error. The HTTP APIs'
# own narrower ranges (OpenAI's temperature up to 2, Anthropic's up to 1) are their request models'
RULES: list[Rule] = [
    ("n", lambda p: p.n < 1, "n must be at least 1"),
    ("best_of", lambda p: p.best_of is not None and p.best_of < p.n, "best_of must be greater than or equal to n"),
    ("temperature", lambda p: p.temperature < 0, "temperature must be non-negative"),
    ("top_p", lambda p: not 0 < p.top_p <= 1, "top_p must be in (0, 1]"),
    ("top_k", lambda p: p.top_k < 0, "top_k must be 0 or -1 (off) or positive"),
    ("min_p", lambda p: not 0 <= p.min_p <= 1, "min_p must be in [0, 1]"),
    ("repetition_penalty", lambda p: p.repetition_penalty <= 0, "repetition_penalty must be positive"),
    ("max_tokens", lambda p: p.max_tokens is not None and p.max_tokens < 1, "max_tokens must be at least 1"),
    ("stop", lambda p: any(not s for s in p.stop), "stop strings must not be empty"),
    ("logprobs", lambda p: p.logprobs is not None and p.logprobs < 0, "logprobs must be non-negative"),
    ("prompt_logprobs", lambda p: p.prompt_logprobs is not None and p.prompt_logprobs < 0,
     "prompt_logprobs must be non-negative"),
    ("use_beam_search", lambda p: p.use_beam_search and _samples(p),
     "beam search is deterministic: temperature (other than 0), top_p, top_k, min_p and penalties are not allowed"),
    ("use_beam_search", lambda p: p.use_beam_search and (bool(p.stop) or p.logprobs is not None),
     "stop strings and logprobs are not supported with use_beam_search"),
    ("early_stopping", lambda p: p.early_stopping not in (True, False, "never"),
     "early_stopping must be True, False or 'never'"),
]
