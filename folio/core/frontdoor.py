"""The front door: a request's ``SamplingParams`` (``shared/sampling.py``) and prompt become
the engine's ``GenerateRequest`` here, for the gateway's OpenAI routes and for ``folio.LLM`` alike
(vLLM shares one input processor between its server and its offline API the same way).

- ``generate_request``: one prompt's ``GenerateRequest``: its ``n`` choices (or ``best_of``
  sequences) forked from the first, or with beam search its ``n`` choices of the best beams; the
  params travel in it unchanged;
- ``best_of_order``: which of a prompt's sequences ``best_of`` keeps (vLLM's rule);
- ``ChatMessageIn`` and ``chat_messages``: OpenAI's chat messages, read and checked.

A request's sequences have ids ``<req_id>-<index>``, ``index = prompt_index * num + i``, the first
the request's own: the others ride in ``fork_req_ids`` and the scheduler forks them from the first
once the prompt is computed. No torch, no sockets.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from folio.shared import messages
from folio.shared.sampling import ParamError, SamplingParams


def generate_request(params: SamplingParams, req_id: str, prompt_index: int = 0, **fields) -> messages.GenerateRequest:
    """The request for one prompt: ``fields`` carry the prompt (``prompt=``, ``prompt_token_ids=``
    or ``messages=`` with chat options) and any other request field (``stream``, ``echo``,
    ``cache_salt``, ``guided`` ...). Its sequences are ``<req_id>-<i>`` from ``i = prompt_index *
    num``, ``num`` the sequences (or, with beam search, the choices) of one prompt."""
    # with beam search the n choices receive the best of num_sequences beams
    num = params.n if params.use_beam_search else params.num_sequences
    first = prompt_index * num
    return messages.GenerateRequest(
        req_id=f"{req_id}-{first}", fork_req_ids=[f"{req_id}-{first + i}" for i in range(1, num)],
        sampling=params, **fields)


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
