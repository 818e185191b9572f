"""The input processor: a request's ``SamplingParams`` (``shared/sampling.py``) and prompt become
the engine's ``GenerateRequest`` here, for the gateway's OpenAI routes and for ``folio.LLM`` alike
(vLLM shares one input processor between its server and its offline API the same way).

- ``generate_request``: one prompt's ``GenerateRequest``: its ``n`` choices (or ``best_of``
  sequences) forked from the first, or with beam search its ``n`` choices of the best beams; the
  params travel in it unchanged;
- ``best_of_order``: which of a prompt's sequences ``best_of`` keeps (vLLM's rule);
- ``ChatMessageIn`` and ``chat_messages``: OpenAI's chat messages, read and checked (``read_chat``
  with their ``image_url`` parts' URLs; ``decode_data_url`` reads a data URL's image file);
- ``embed_params`` and ``RerankFormat``: the pooling requests of ``/v1/embeddings``, ``/v1/rerank``
  and ``/v1/score`` (and ``LLM.embed``/``LLM.score``): a yes/no reranker reads a query and a
  document in the prompt format it was trained on, and scores p(yes) from two logits.

A request's sequences have ids ``<req_id>-<index>``, ``index = prompt_index * num + i``, the first
the request's own: the others ride in ``fork_req_ids`` and the scheduler forks them from the first
once the prompt is computed. No torch, no sockets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import msgspec

from folio.shared import messages
from folio.shared.sampling import ParamError, PoolingParams, SamplingParams

# Qwen3-Reranker's prompt (its model card): a system turn that asks for "yes" or "no", the pair in
# the user turn, and an assistant turn opened after an empty think block; the score is p("yes")
QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
QWEN3_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def embed_params(dimensions: int | None = None) -> SamplingParams:
    """An embedding request's params: last-token pooling, L2-normalised (after truncation to
    ``dimensions``)."""
    return SamplingParams(max_tokens=None, pooling=PoolingParams(kind="embed", dimensions=dimensions))


@dataclass(frozen=True)
class RerankFormat:
    """How a yes/no cross-encoder reads a (query, document) pair: ``template`` with ``{query}``,
    ``{document}`` and ``{instruction}``, tokenized without added special tokens (the template
    holds them), and the two tokens whose logits at the last position give the score."""

    template: str = QWEN3_RERANK_TEMPLATE
    instruction: str = QWEN3_RERANK_INSTRUCTION
    yes_token: str = "yes"
    no_token: str = "no"

    def __post_init__(self):
        try:
            self.template.format(query="", document="", instruction="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"a rerank template may name only {{query}}, {{document}} and {{instruction}}: {exc}") from None

    def prompt(self, query: str, document: str) -> str:
        return self.template.format(query=query, document=document, instruction=self.instruction)

    def params(self) -> SamplingParams:
        """The logits of [no, yes] at the pair's last position."""
        return SamplingParams(max_tokens=None, pooling=PoolingParams(kind="score", normalize=False,
                                                                     tokens=[self.no_token, self.yes_token]))

    @staticmethod
    def score(logits: list[float]) -> float:
        """p(yes): the softmax over the [no, yes] logits."""
        no, yes = logits
        return 1.0 / (1.0 + math.exp(no - yes)) if no - yes < 700 else 0.0


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


class ImageURL(msgspec.Struct, kw_only=True):
    url: str
    detail: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None  # type image_url: a data URL, or http(s) where allowed

    def url(self) -> str:
        if self.image_url is None:
            raise ParamError("an image_url part needs its image_url", "messages")
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


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
    parts = []
    if isinstance(m.content, list) and any(p.type == "image_url" for p in m.content):
        parts = [{"type": "image"} if p.type == "image_url" else {"type": "text", "text": p.text or ""}
                 for p in m.content if p.type == "image_url" or p.text is not None]
    return messages.ChatMessage(role=m.role, content=m.text(), parts=parts, tool_calls=calls,
                                tool_call_id=m.tool_call_id, name=m.name)


def chat_image_urls(conversation: list[ChatMessageIn]) -> list[str]:
    """The URLs of a conversation's ``image_url`` parts, in the order the prompt names them."""
    return [p.url() for m in conversation if isinstance(m.content, list) for p in m.content if p.type == "image_url"]


def read_chat(conversation: list[dict]) -> tuple[list[messages.ChatMessage], list[str]]:
    """OpenAI-style message dicts, checked and read as the gateway reads them, and their image URLs."""
    try:
        parsed = msgspec.convert(conversation, list[ChatMessageIn])
    except msgspec.ValidationError as exc:
        raise ParamError(f"invalid messages: {exc}", "messages") from None
    return [chat_message(m) for m in parsed], chat_image_urls(parsed)


def chat_messages(conversation: list[dict]) -> list[messages.ChatMessage]:
    """OpenAI-style message dicts, checked and read as the gateway reads them."""
    return read_chat(conversation)[0]


def decode_data_url(url: str, max_bytes: int, index: int = 0) -> bytes:
    """The image file of a ``data:`` URL (base64), or ParamError: not a data URL, broken base64,
    larger than ``max_bytes``. Whether the bytes are an image the tokenizer's decoder says."""
    import base64
    import binascii

    head, sep, payload = url.partition(",")
    if not url.startswith("data:") or not sep or ";base64" not in head:
        raise ParamError(f"image {index}: expected a data URL (data:image/png;base64,...) or an http(s) URL", "messages")
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise ParamError(f"image {index} is larger than the {max_bytes} bytes allowed (--max-image-bytes)", "messages")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ParamError(f"image {index}: the data URL's base64 is broken", "messages") from None
    if len(data) > max_bytes:
        raise ParamError(f"image {index} is larger than the {max_bytes} bytes allowed (--max-image-bytes)", "messages")
    if not data:
        raise ParamError(f"image {index} is empty", "messages")
    return data
