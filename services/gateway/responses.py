"""OpenAI response objects (completions, chat, their stream chunks, usage, logprobs) built from
the tokenizer's ``TextDelta``s. Pure functions of their arguments; ``routes.py`` and
``streaming.py`` call them. Shapes follow the OpenAI OpenAPI description
(``CreateCompletionResponse``, ``CreateChatCompletionResponse``, ``...StreamResponse``).

A stream's chunks are mostly new text and nothing else; ``TextChunkTemplate`` encodes such a
chunk once and afterwards only the text (``completion_text_template``, ``chat_text_template``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from folio.shared.messages import TextDelta, TextLogprob, TopLogprob

_json = msgspec.json.Encoder()


@dataclass
class ResponseMeta:
    """What every object of one HTTP response shares."""

    id: str
    created: int
    model: str
    n: int  # choices per prompt: usage counts each prompt once
    echo: bool = False


@dataclass
class UsageCounter:
    """Token counts per choice index, summed into OpenAI's ``usage``."""

    n: int
    prompt: dict[int, int] = field(default_factory=dict)
    output: dict[int, int] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)

    def add(self, index: int, delta: TextDelta) -> None:
        self.prompt[index] = max(self.prompt.get(index, 0), delta.num_prompt_tokens)
        self.output[index] = max(self.output.get(index, 0), delta.num_output_tokens)
        self.cached[index] = max(self.cached.get(index, 0), delta.num_cached_tokens)

    def usage(self) -> dict:
        # the n choices of one prompt share it: count the prompt once, as OpenAI bills it
        prompt = sum(v for i, v in self.prompt.items() if i % self.n == 0)
        cached = sum(v for i, v in self.cached.items() if i % self.n == 0)
        completion = sum(self.output.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


class TextChunkTemplate:
    """A stream chunk whose only varying part is one text field, encoded once around a marker:
    ``encode(text)`` gives the same JSON bytes as encoding the whole chunk with that text, at the
    price of encoding the string alone."""

    MARK = "\x00folio:text\x00"  # control characters: no id, model name or fixed field holds it

    def __init__(self, chunk: dict):
        head, mark, tail = _json.encode(chunk).partition(_json.encode(self.MARK))
        if not mark or _json.encode(self.MARK) in tail:
            raise ValueError("a chunk template needs the text marker exactly once")
        self._head, self._tail = head, tail

    def encode(self, text: str) -> bytes:
        return b"".join((self._head, _json.encode(text), self._tail))


# --------------------------------------------------------------------------- logprobs


def completion_logprobs(items: list[TextLogprob]) -> dict:
    """The legacy completions format: parallel lists."""
    return {
        "tokens": [x.token for x in items],
        "token_logprobs": [x.logprob for x in items],
        "top_logprobs": [None if x.logprob is None else {t.token: t.logprob for t in x.top} for x in items],
        "text_offset": [x.text_offset for x in items],
    }


def _token_bytes(item: TextLogprob | TopLogprob) -> list[int]:
    """The tokenizer sends raw bytes only for tokens that hold part of a character."""
    return item.token_bytes if item.token_bytes is not None else list(item.token.encode("utf-8"))


def chat_logprobs(items: list[TextLogprob]) -> dict:
    content = [
        {
            "token": x.token,
            "logprob": x.logprob,
            "bytes": _token_bytes(x),
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": _token_bytes(t)} for t in x.top],
        }
        for x in items
    ]
    return {"content": content, "refusal": None}


# --------------------------------------------------------------------------- completions


def completion_choice(index: int, delta: TextDelta, echo: bool, first: bool = True) -> dict:
    """One choice of a completion (or of one stream chunk, ``first`` on a choice's first chunk)."""
    text, logprobs = delta.text, delta.logprobs
    if echo and first:
        text = (delta.prompt_text or "") + text
        if delta.prompt_logprobs is not None:
            logprobs = delta.prompt_logprobs + (logprobs or [])
    return {
        "index": index,
        "text": text,
        "logprobs": completion_logprobs(logprobs) if logprobs is not None else None,
        "finish_reason": delta.finish_reason,
        "stop_reason": delta.stop_reason,  # vLLM's extension: which stop string or token id
    }


def completion_text_template(meta: ResponseMeta, index: int, with_usage: bool) -> TextChunkTemplate:
    """The stream chunk of choice ``index`` carrying new text only (no logprobs, not finished,
    not the echoed first chunk)."""
    choice = completion_choice(index, TextDelta(req_id="", text=TextChunkTemplate.MARK), echo=False)
    return TextChunkTemplate(completion_chunk(meta, [choice], None, with_usage))


def completion_response(meta: ResponseMeta, deltas: dict[int, TextDelta], usage: dict) -> dict:
    return {
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [completion_choice(i, deltas[i], meta.echo) for i in sorted(deltas)],
        "usage": usage,
    }


def completion_chunk(meta: ResponseMeta, choices: list[dict], usage: dict | None = None,
                     with_usage: bool = False) -> dict:
    chunk = {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
             "choices": choices}
    if with_usage:
        chunk["usage"] = usage
    return chunk


# --------------------------------------------------------------------------- chat


def chat_response(meta: ResponseMeta, deltas: dict[int, TextDelta], usage: dict, reader=None) -> dict:
    """``reader``: a factory of ``chat_output.OutputReader`` (one per choice) when reasoning or
    tools are on."""
    choices = []
    for i, d in sorted(deltas.items()):
        message = {"role": "assistant", "content": d.text, "refusal": None}
        finish_reason = d.finish_reason
        if reader is not None:
            choice_reader = reader()
            reasoning, content, calls = choice_reader.message(d.text)
            message["content"] = content
            if choice_reader.reasoning is not None:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = calls
            finish_reason = choice_reader.finish_reason(finish_reason, calls)
        choices.append({
            "index": i,
            "message": message,
            "logprobs": chat_logprobs(d.logprobs) if d.logprobs is not None else None,
            "finish_reason": finish_reason,
            "stop_reason": d.stop_reason,
        })
    return {"id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
            "choices": choices, "usage": usage}


def chat_chunk(meta: ResponseMeta, choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> dict:
    chunk = {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
             "choices": choices}
    if with_usage:
        chunk["usage"] = usage
    return chunk


def chat_text_template(meta: ResponseMeta, index: int, with_usage: bool) -> TextChunkTemplate:
    """The stream chunk of choice ``index`` carrying new content only (after its role chunk, no
    logprobs, not finished)."""
    choice = chat_chunk_choice(index, TextDelta(req_id="", text=TextChunkTemplate.MARK))
    return TextChunkTemplate(chat_chunk(meta, [choice], None, with_usage))


def chat_chunk_choice(index: int, delta: TextDelta | None, role: bool = False) -> dict:
    """A chunk's choice: the role alone (a stream's first chunk per choice), else new content."""
    if role or delta is None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    choice = {
        "index": index,
        "delta": {"content": delta.text} if delta.text else {},
        "logprobs": chat_logprobs(delta.logprobs) if delta.logprobs is not None else None,
        "finish_reason": delta.finish_reason,
    }
    if delta.finish_reason is not None:
        choice["stop_reason"] = delta.stop_reason
    return choice


def models_response(model_name: str, root: str, created: int, adapters: dict[str, str] | None = None) -> dict:
    """The base model, then each LoRA adapter (name -> folder) with the base model as ``parent``."""
    base = {"id": model_name, "object": "model", "created": created, "owned_by": "folio", "root": root,
            "parent": None}
    return {
        "object": "list",
        "data": [base, *({"id": name, "object": "model", "created": created, "owned_by": "folio", "root": path,
                          "parent": model_name} for name, path in (adapters or {}).items())],
    }
