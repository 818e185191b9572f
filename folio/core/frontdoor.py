"""The one front door: what a user asks for becomes an engine request here, for the gateway's
OpenAI routes and for ``folio.LLM`` alike (vLLM shares one ``SamplingParams`` and one input
processor between its server and its offline API the same way).

- ``SamplingParams``: the user's sampling parameters, with vLLM's names and defaults, checked
  against ``RULES`` (the one list of the rules that tie parameters together);
- ``SamplingParams.to_generate_request``: one prompt's ``GenerateRequest``: its ``n`` choices (or
  ``best_of`` sequences) forked from the first, best_of's logprobs, beam-search parameters, stop
  strings, top-k's "off" values;
- ``best_of_order``: which of a prompt's sequences ``best_of`` keeps (vLLM's rule);
- ``ChatMessageIn`` and ``chat_messages``: OpenAI's chat messages, read and checked.

The gateway (``services/gateway/convert.py``) maps an OpenAI body onto these; ``folio.LLM`` takes
them from its caller. A request's sequences have ids ``<req_id>-<index>``, ``index = prompt_index
* num + i``, the first the request's own: the others ride in ``fork_req_ids`` and the scheduler
forks them from the first once the prompt is computed. No torch, no sockets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from folio.shared import messages


class ParamError(ValueError):
    """A parameter the front door refuses; ``param`` names it (the gateway's 400 carries it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _samples(p: "SamplingParams") -> bool:
    """Whether anything but the most likely token could be picked."""
    return bool(p.temperature > 0 or p.top_p < 1 or p.top_k > 0 or p.min_p or p.presence_penalty
                or p.frequency_penalty or p.repetition_penalty != 1.0)


Rule = tuple[str, Callable[["SamplingParams"], bool], str]

# (param, is_bad, message), checked in order; the first that holds is the error
RULES: list[Rule] = [
    ("n", lambda p: p.n < 1, "n must be at least 1"),
    ("best_of", lambda p: p.best_of is not None and p.best_of < p.n, "best_of must be greater than or equal to n"),
    ("temperature", lambda p: p.temperature < 0, "temperature must be non-negative"),
    ("top_p", lambda p: not 0 < p.top_p <= 1, "top_p must be in (0, 1]"),
    ("top_k", lambda p: p.top_k < -1, "top_k must be -1 (off), 0 (off) or positive"),
    ("min_p", lambda p: not 0 <= p.min_p <= 1, "min_p must be in [0, 1]"),
    ("repetition_penalty", lambda p: p.repetition_penalty <= 0, "repetition_penalty must be positive"),
    ("max_tokens", lambda p: p.max_tokens < 1, "max_tokens must be at least 1"),
    ("stop", lambda p: any(not s for s in stop_strings(p.stop)), "stop strings must not be empty"),
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


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """``stop`` as a list: a string is one stop string; None or empty, none."""
    if not stop:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


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
        for param, is_bad, message in RULES:
            if is_bad(self):
                raise ParamError(message, param)

    @property
    def num_sequences(self) -> int:
        """Sequences generated per prompt: ``best_of`` (the best ``n`` are returned) or ``n``."""
        return max(self.n, self.best_of or 1)

    @property
    def ranks_by_logprob(self) -> bool:
        """More sequences than choices, without beam search: the best ``n`` by cumulative logprob."""
        return not self.use_beam_search and self.num_sequences > self.n

    def stop_strings(self) -> list[str]:
        return stop_strings(self.stop)

    def engine_sampling(self) -> messages.WireSampling:
        """The request's ``WireSampling``: the fields both classes name are copied (``WIRE_FIELDS``,
        read from the two classes), but for two that differ: top-k's "off" values (0, -1) are None
        there, and best_of asks for logprobs to rank by. The stop ids get a list of their own; the
        grammar is the tokenizer's to set, once it checked the spec."""
        copied = {name: getattr(self, name) for name in WIRE_FIELDS}
        logprobs = self.logprobs
        if logprobs is None and self.ranks_by_logprob:
            logprobs = 0  # best_of ranks the sequences by their cumulative logprob
        return messages.WireSampling(**copied, top_k=self.top_k if self.top_k > 0 else None, logprobs=logprobs,
                                     stop_token_ids=list(self.stop_token_ids))

    def to_generate_request(self, req_id: str, prompt_index: int = 0, **fields) -> messages.GenerateRequest:
        """The request for one prompt: ``fields`` carry the prompt (``prompt=``,
        ``prompt_token_ids=`` or ``messages=`` with chat options) and any other request field
        (``stream``, ``echo``, ``cache_salt``, ``guided`` ...). Its sequences are ``<req_id>-<i>``
        from ``i = prompt_index * num``, ``num`` the sequences (or, with beam search, the choices)
        of one prompt."""
        num = self.num_sequences
        beam = None
        if self.use_beam_search:
            beam = messages.BeamSearchParams(width=num, length_penalty=self.length_penalty,
                                             early_stopping=self.early_stopping)
            num = self.n  # the choices receive the best beams
        first = prompt_index * num
        return messages.GenerateRequest(
            req_id=f"{req_id}-{first}", fork_req_ids=[f"{req_id}-{first + i}" for i in range(1, num)],
            sampling=self.engine_sampling(), stop=self.stop_strings(), beam_search=beam, **fields)


# the fields ``engine_sampling`` copies as they are, by name
WIRE_FIELDS = tuple(name for name in messages.WireSampling.__struct_fields__
                    if name in SamplingParams.__dataclass_fields__
                    and name not in ("top_k", "logprobs", "stop_token_ids"))


def best_of_order(cumulative_logprobs: list[float], n: int) -> list[int]:
    """The indices of the ``n`` sequences ``best_of`` returns: the highest cumulative logprob
    first (vLLM's rule), ties in index order."""
    return sorted(range(len(cumulative_logprobs)), key=lambda i: -cumulative_logprobs[i])[:n]


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCallIn(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCallIn(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(msgspec.Struct, kw_only=True):
    """One OpenAI chat message as a client sends it."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text or "" for part in self.content)


def chat_message(m: ChatMessageIn) -> messages.ChatMessage:
    calls = [messages.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
             for c in m.tool_calls or []]
    return messages.ChatMessage(role=m.role, content=m.text(), tool_calls=calls, tool_call_id=m.tool_call_id,
                                name=m.name)


def chat_messages(conversation: list[dict]) -> list[messages.ChatMessage]:
    """OpenAI-style message dicts, checked and read as the gateway reads them."""
    try:
        return [chat_message(m) for m in msgspec.convert(conversation, list[ChatMessageIn])]
    except msgspec.ValidationError as exc:
        raise ParamError(f"invalid messages: {exc}", "messages") from None
