"""Anthropic's Messages API: ``POST /v1/messages``, which coding agents speak to local models.

A body becomes a chat request (``to_chat``: ``system``, text, ``tool_use`` and ``tool_result``
blocks, ``tools`` with their ``input_schema``, ``tool_choice``, ``stop_sequences``, ``max_tokens``)
and runs through chat's own path (``api_bridge.run_chat``); ``/v1/messages/count_tokens`` counts
its prompt through the chat template. The answer's content is a list of
blocks: ``thinking`` (``--reasoning-parser``), ``text``, ``tool_use``; streamed, the API's named
events (``message_start``, per block ``content_block_start``/``_delta``/``_stop``,
``message_delta``, ``message_stop``). Errors come in the API's own shape
(``{"type": "error", "error": {"type", "message"}}``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated

import msgspec
from aiohttp import web
from msgspec import Meta

from folio.core.input_processor import chat_message
from folio.services.gateway.api_bridge import chat_request, error_shaped, read_delta, reader_for, run_chat, \
    stream_events
from folio.services.gateway.protocol import ApiError, PosInt, parse
from folio.services.gateway.responses import ResponseMeta
from folio.services.gateway.routes import SERVICE
from folio.shared.messages import TokenizeRequest


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: PosInt
    messages: Annotated[list[dict], Meta(min_length=1)]
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    metadata: dict | None = None


_EXTRAS = ("seed", "min_p", "repetition_penalty", "ignore_eos", "guided_regex", "guided_grammar", "guided_choice",
           "guided_json", "chat_template_kwargs", "cache_salt", "priority")
_RENAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(exc: ApiError) -> dict:
    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def _text(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError("content must be a string or a list of blocks", param=param)
    if any(not isinstance(b, dict) or b.get("type") != "text" for b in content):
        raise ApiError("only text blocks are supported here", param=param)
    return "".join(str(b.get("text", "")) for b in content)


def _message(m: dict, out: list[dict]) -> None:
    """One Anthropic message onto the chat messages ``out``."""
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant"):
        raise ApiError("a message's role must be user or assistant", param="messages")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise ApiError("a message's content must be a string or a list of blocks", param="messages")
    texts, calls, parts = [], [], []  # parts: the text and image blocks, in order, once an image comes
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
            parts.append({"type": "text", "text": texts[-1]})
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"))}})
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": str(block.get("name", "")),
                                       "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            result = _text(block.get("content", ""), "messages")
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                        "content": ("Error: " + result) if block.get("is_error") else result})
        elif kind not in ("thinking", "redacted_thinking"):  # past reasoning: templates drop it
            raise ApiError(f"content blocks of type {kind!r} are not supported in a {role} message",
                           param="messages")
    if any(p["type"] == "image_url" for p in parts):
        out.append({"role": role, "content": parts})
    elif texts or calls:
        out.append({"role": role, "content": "".join(texts) or None, **({"tool_calls": calls} if calls else {})})


def _image_url(source) -> str:
    """An image block's source as the URL chat's ``image_url`` takes: base64 data as a data URL, or
    its ``url`` (fetched as chat's are: only from ``--allowed-media-domains``)."""
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        media_type = source.get("media_type")
        if not isinstance(media_type, str) or not media_type.startswith("image/"):
            raise ApiError("an image block's source.media_type must be image/jpeg, image/png, image/gif or "
                           "image/webp", param="messages")
        return f"data:{media_type};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ApiError("an image block's source must be {type: base64, media_type, data} or {type: url, url}",
                   param="messages")


def _tool_choice(choice: dict | None):
    if choice is None:
        return None, True
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "tool" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel
    raise ApiError("tool_choice.type must be auto, any, tool or none", param="tool_choice")


def to_chat(req: MessagesRequest, extras: dict) -> dict:
    messages: list[dict] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system, "system")})
    for m in req.messages:
        if not isinstance(m, dict):
            raise ApiError("each message must be an object", param="messages")
        _message(m, messages)
    tools = None
    if req.tools is not None:
        if any(not isinstance(t, dict) or "name" not in t or t.get("type", "custom") != "custom" for t in req.tools):
            raise ApiError("each tool needs a name (server tools are not supported)", param="tools")
        tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description"),
                                                   "parameters": t.get("input_schema")}} for t in req.tools]
    tool_choice, parallel = _tool_choice(req.tool_choice)
    kwargs = dict(extras.get("chat_template_kwargs") or {})
    if (req.thinking or {}).get("type") == "disabled":
        kwargs["enable_thinking"] = False
    body = {"model": req.model, "messages": messages, "max_completion_tokens": req.max_tokens,
            "stop": req.stop_sequences or None, "temperature": req.temperature, "top_p": req.top_p,
            "top_k": req.top_k, "stream": req.stream, "tools": tools, "tool_choice": tool_choice,
            "parallel_tool_calls": parallel, **{k: extras[k] for k in _EXTRAS if k in extras},
            "chat_template_kwargs": kwargs or None}
    return {k: v for k, v in body.items() if v is not None}


def _tool_use(call: dict) -> dict:
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": args if isinstance(args, dict) else {"value": args}}


def stop_of(finish_reason: str | None, stop_reason, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) in the API's terms."""
    if called:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def message_object(meta: ResponseMeta, content: list[dict], stop: tuple[str | None, str | None],
                   usage: dict) -> dict:
    return {"id": meta.id, "type": "message", "role": "assistant", "model": meta.model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": _usage(usage)}


def _usage(usage: dict) -> dict:
    """Anthropic counts the prompt's tokens read from the cache apart: input + cache reads = the prompt."""
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": usage.get("prompt_tokens", 0) - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": usage.get("completion_tokens", 0)}


class MessageEvents:
    """One message's named events from chat-chunk deltas: a block opens when its first text comes
    and stops when another begins or the message ends."""

    def __init__(self, meta: ResponseMeta, reader):
        self.meta, self.reader = meta, reader
        self.index = -1  # the open block's index
        self.open: str | None = None  # its type
        self.called = False
        self.ended: tuple[str | None, object] = (None, None)  # (finish_reason, stop_reason)

    def start(self, first=None) -> list:
        # the prompt's tokens are known from the first output on (the clients read them here)
        usage = {} if first is None else {"prompt_tokens": first.num_prompt_tokens, "completion_tokens": 0,
                                          "prompt_tokens_details": {"cached_tokens": first.num_cached_tokens}}
        message = message_object(self.meta, [], (None, None), usage)
        return [("message_start", {"type": "message_start", "message": message})]

    def _block(self, kind: str, block: dict) -> list:
        events = self._stop()
        self.index, self.open = self.index + 1, kind
        return events + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})]

    def _stop(self) -> list:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}

    def feed(self, delta) -> list:
        events = []
        if delta.finish_reason is not None:
            self.ended = (delta.finish_reason, delta.stop_reason)
        for d in read_delta(self.reader, delta):
            if d.get("reasoning_content"):
                if self.open != "thinking":
                    events += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                events.append(self._delta({"type": "thinking_delta", "thinking": d["reasoning_content"]}))
            if d.get("content"):
                if self.open != "text":
                    events += self._block("text", {"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": d["content"]}))
            for call in d.get("tool_calls", []):
                if "id" in call:
                    self.called = True
                    block = {**_tool_use({**call, "function": {**call["function"], "arguments": ""}}), "input": {}}
                    events += self._block("tool_use", block)
                if call["function"].get("arguments"):
                    events.append(self._delta({"type": "input_json_delta",
                                               "partial_json": call["function"]["arguments"]}))
        return events

    def error(self, message: str) -> list:
        return [("error", {"type": "error", "error": {"type": "api_error", "message": message}})]

    def finish(self, usage: dict) -> list:
        stop = stop_of(self.ended[0], self.ended[1], self.called)
        return self._stop() + [
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                               "usage": _usage(usage)}),
            ("message_stop", {"type": "message_stop"})]


async def create_message(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    body = await request.read()
    req = parse(body, MessagesRequest)
    chat = chat_request(to_chat(req, msgspec.json.decode(body)), _RENAMES)
    model, _ = await service.resolve_model(chat.model)
    meta = ResponseMeta(id=f"msg_{uuid.uuid4().hex}", created=int(time.time()), model=model, n=1)

    def respond(meta, deltas, usage):
        d = deltas[0]
        reasoning, content, calls = reader_for(request, chat).message(d.text)
        blocks = ([{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []) + \
                 ([{"type": "text", "text": content}] if content else []) + [_tool_use(c) for c in calls]
        return message_object(meta, blocks, stop_of(d.finish_reason, d.stop_reason, bool(calls)), usage)

    async def stream_fn(request, mailbox, meta, _req):
        return await stream_events(request, mailbox, MessageEvents(meta, reader_for(request, chat)))

    return await run_chat(request, chat, meta, stream_fn, respond)


async def count_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``: the prompt's tokens through the chat template, tools included."""
    service = request.app[SERVICE]
    raw = await request.read()
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        body = None  # parse() says what is wrong with it
    if isinstance(body, dict) and "max_tokens" not in body:  # counting needs none; the rest is a message's body
        raw = msgspec.json.encode({**body, "max_tokens": 1})
    req = parse(raw, MessagesRequest)
    chat = chat_request(to_chat(req, body), _RENAMES)
    await service.resolve_model(chat.model)
    tools = [msgspec.to_builtins(t) for t in chat.tools] if chat.tools else None
    reply = await service.tokenize(TokenizeRequest(
        req_id=f"count-{uuid.uuid4().hex}", messages=[chat_message(m) for m in chat.messages],
        add_generation_prompt=True, add_special_tokens=False, tools=tools))
    if reply.error is not None:
        raise ApiError(reply.error, reply.error_code, param=reply.error_param)
    return web.json_response({"input_tokens": len(reply.token_ids)})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", error_shaped(create_message, error_body))
    app.router.add_post("/v1/messages/count_tokens", error_shaped(count_tokens, error_body))
