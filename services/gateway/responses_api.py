"""OpenAI's Responses API: ``POST /v1/responses`` and ``GET /v1/responses/{id}``.

A body becomes a chat request (``to_chat``: ``instructions`` the system message, the stored turns
of ``previous_response_id``, the ``input`` items, tools, ``text.format``, ``max_output_tokens``)
and runs through chat's own path (``api_bridge.run_chat``). The output is a list of items: the
reasoning (``--reasoning-parser``), the message, the function calls. Streamed, it is the API's
typed events in order: ``response.created``, ``response.in_progress``, per item
``response.output_item.added``, its part's added, deltas and done events, ``response.output_item.done``,
then ``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` cut it (the status
the same request gets unstreamed, as OpenAI's API ends such a stream).

Responses are kept (unless ``store`` is false) in a ``ResponseStore``: bounded
(``--response-store-size``, oldest out first) and with a time to live (``--response-store-ttl``).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Annotated, Literal

import msgspec
from aiohttp import web
from msgspec import Meta

from folio.services.gateway.api_bridge import chat_request, read_delta, reader_for, run_chat, stream_events
from folio.services.gateway.protocol import ApiError, PosInt, parse
from folio.services.gateway.responses import ResponseMeta
from folio.services.gateway.routes import SERVICE


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: Annotated[str, Meta(min_length=1)] | Annotated[list[dict], Meta(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool = True
    text: dict | None = None
    max_output_tokens: PosInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    metadata: dict | None = None
    reasoning: dict | None = None
    user: str | None = None


# vLLM's extra parameters, passed on to chat as they are
_EXTRAS = ("seed", "top_k", "min_p", "stop", "repetition_penalty", "presence_penalty", "frequency_penalty",
           "ignore_eos", "guided_regex", "guided_grammar", "guided_choice", "guided_json", "chat_template_kwargs",
           "cache_salt", "priority")
_RENAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
            "tools": "tools", "tool_choice": "tool_choice"}


class ResponseStore:
    """Responses by id, for ``previous_response_id`` and ``GET``: each with the conversation so far
    (chat messages, without ``instructions``, which do not carry over)."""

    def __init__(self, max_size: int, ttl_s: float):
        self.max_size, self.ttl_s = max_size, ttl_s
        self._items: OrderedDict[str, tuple[float, dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._items[response["id"]] = (time.monotonic() + self.ttl_s, response, conversation)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        item = self._items.get(response_id)
        if item is None or item[0] < time.monotonic():
            self._items.pop(response_id, None)
            return None
        return item[1], item[2]


STORE = web.AppKey("response_store", ResponseStore)


# --------------------------------------------------------------------------- request -> chat


def _text_of(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError("content must be a string or a list of parts", param=param)
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            raise ApiError("only text content parts (input_text, output_text) are supported", param=param)
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _content(content, param: str):
    """A message's content for chat: its text, or chat's parts when it holds an ``input_image``
    (its ``image_url``: a data URL or an http(s) URL, read as chat's ``image_url`` parts are)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text_of(content, param)
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise ApiError("an input_image needs image_url: a data URL or an http(s) URL (file_id is not "
                               "supported)", param=param)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _text_of([part], param)})
    return parts


def input_messages(items: str | list[dict]) -> list[dict]:
    """The ``input`` as chat messages: messages, function calls (assistant ``tool_calls``) and their
    outputs (``tool`` messages); reasoning items are dropped (templates drop past reasoning)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for item in items:
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            if item.get("role") not in ("user", "assistant", "system", "developer"):
                raise ApiError("a message's role must be user, assistant, system or developer", param="input")
            out.append({"role": item["role"], "content": _content(item.get("content", ""), "input")})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", "{}"))}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": _text_of(item.get("output", ""), "input")})
        elif kind != "reasoning":
            raise ApiError(f"input items of type {kind!r} are not supported", param="input")
    return out


def _chat_tools(req: ResponsesRequest) -> tuple[list[dict] | None, object]:
    tools = None
    if req.tools is not None:
        tools = []
        for t in req.tools:
            if t.get("type") != "function":
                raise ApiError(f"tools of type {t.get('type')!r} are not supported (only function)", param="tools")
            tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                              "strict") if k in t}})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or "name" not in choice:
            raise ApiError("tool_choice must be none, auto, required or {type: function, name}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError("text.format.type must be text, json_object or json_schema", param="text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                   if k in fmt}}


def to_chat(req: ResponsesRequest, extras: dict, history: list[dict]) -> tuple[dict, list[dict]]:
    """(the chat body, the conversation to store: history and this input, without instructions)."""
    conversation = history + input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    tools, tool_choice = _chat_tools(req)
    body = {"model": req.model, "messages": messages, "tools": tools, "tool_choice": tool_choice,
            "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req.text),
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "stream": req.stream, **{k: extras[k] for k in _EXTRAS if k in extras}}
    return {k: v for k, v in body.items() if v is not None}, conversation


# --------------------------------------------------------------------------- output items


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"id": _id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, status: str = "completed") -> dict:
    return {"id": _id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: dict, status: str = "completed") -> dict:
    return {"id": _id("fc"), "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def response_object(meta: ResponseMeta, req: ResponsesRequest, output: list[dict], usage: dict | None,
                    status: str) -> dict:
    details = {"reason": "max_output_tokens"} if status == "incomplete" else None
    usage_out = None if usage is None else {
        "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
        "total_tokens": usage["total_tokens"], "input_tokens_details": usage["prompt_tokens_details"],
        "output_tokens_details": {"reasoning_tokens": 0}}
    return {"id": meta.id, "object": "response", "created_at": meta.created, "status": status, "error": None,
            "incomplete_details": details, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": meta.model, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "truncation": "disabled", "usage": usage_out, "metadata": req.metadata or {},
            "user": req.user}


def assistant_turn(output: list[dict]) -> dict:
    """The response's output as the chat message a next turn sees."""
    text = "".join(p["text"] for i in output if i["type"] == "message" for p in i["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


# --------------------------------------------------------------------------- streamed events


class ResponseEvents:
    """One response's typed events, from chat-chunk deltas: each item opens when its first text
    comes and closes, with its done events, when another item begins or the response ends."""

    def __init__(self, meta: ResponseMeta, req: ResponsesRequest, reader, on_done):
        self.meta, self.req, self.reader, self.on_done = meta, req, reader, on_done
        self.seq = 0
        self.output: list[dict] = []  # the items done
        self.item: dict | None = None  # the item open
        self.finish_reason: str | None = None

    def _event(self, kind: str, **fields) -> tuple[str, dict]:
        self.seq += 1
        return kind, {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _at(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def start(self, first=None) -> list:
        shell = response_object(self.meta, self.req, [], None, "in_progress")
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def _open(self, item: dict, part: dict | None) -> list:
        events = self._close()
        self.item = item
        events.append(self._event("response.output_item.added", output_index=len(self.output),
                                  item={**item, "status": "in_progress",
                                        **({"content": []} if "content" in item else {})}))
        if part is not None:
            events.append(self._event("response.content_part.added", **self._at(), content_index=0, part=part))
        return events

    def _close(self, status: str = "completed") -> list:
        item, events = self.item, []
        if item is None:
            return events
        at = self._at()
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", **at, name=item["name"],
                                      arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = "response.output_text.done" if part["type"] == "output_text" else "response.reasoning_text.done"
            extra = {"logprobs": []} if part["type"] == "output_text" else {}
            events.append(self._event(kind, **at, content_index=0, text=part["text"], **extra))
            events.append(self._event("response.content_part.done", **at, content_index=0, part=part))
        item["status"] = status
        events.append(self._event("response.output_item.done", output_index=at["output_index"], item=item))
        self.output.append(item)
        self.item = None
        return events

    def feed(self, delta) -> list:
        events = []
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        for d in read_delta(self.reader, delta):
            if d.get("reasoning_content"):
                if self.item is None or self.item["type"] != "reasoning":
                    events += self._open(reasoning_item(""), {"type": "reasoning_text", "text": ""})
                self.item["content"][0]["text"] += d["reasoning_content"]
                events.append(self._event("response.reasoning_text.delta", **self._at(), content_index=0,
                                          delta=d["reasoning_content"]))
            if d.get("content"):
                if self.item is None or self.item["type"] != "message":
                    events += self._open(message_item(""), {"type": "output_text", "text": "", "annotations": [],
                                                            "logprobs": []})
                self.item["content"][0]["text"] += d["content"]
                events.append(self._event("response.output_text.delta", **self._at(), content_index=0,
                                          delta=d["content"], logprobs=[]))
            for call in d.get("tool_calls", []):
                if "id" in call:
                    events += self._open(call_item({**call, "function": {**call["function"], "arguments": ""}}),
                                         None)
                args = call["function"].get("arguments", "")
                if args:
                    self.item["arguments"] += args
                    events.append(self._event("response.function_call_arguments.delta", **self._at(), delta=args))
        return events

    def error(self, message: str) -> list:
        return [self._event("error", code="server_error", message=message, param=None)]

    def finish(self, usage: dict) -> list:
        status = final_status(self.finish_reason)
        events = self._close(status)  # the item that was cut is incomplete too
        response = response_object(self.meta, self.req, self.output, usage, status)
        self.on_done(response)
        # response.incomplete, as OpenAI's API sends it (the openai client's get_final_response()
        # raises on it: its final response is this event's)
        return events + [self._event(f"response.{status}", response=response)]


# --------------------------------------------------------------------------- routes


def final_status(finish_reason: str | None) -> str:
    """A response's status, streamed or not: ``incomplete`` when ``max_output_tokens`` cut it."""
    return "incomplete" if finish_reason == "length" else "completed"


def whole_output(reader, text: str, status: str) -> list[dict]:
    reasoning, content, calls = reader.message(text)
    output = [reasoning_item(reasoning)] if reasoning else []
    if content or not calls:
        output.append(message_item(content or ""))
    output += [call_item(c) for c in calls]
    output[-1]["status"] = status  # the item that was cut, as the stream's last item.done says
    return output


async def create_response(request: web.Request) -> web.StreamResponse:
    service, store = request.app[SERVICE], request.app[STORE]
    body = await request.read()
    req = parse(body, ResponsesRequest)
    extras = msgspec.json.decode(body)
    history: list[dict] = []
    if req.previous_response_id is not None:
        found = store.get(req.previous_response_id)
        if found is None:
            raise ApiError(f"Previous response with id '{req.previous_response_id}' not found.", 404,
                           param="previous_response_id", code="previous_response_not_found")
        history = found[1] + [assistant_turn(found[0]["output"])]
    chat_body, conversation = to_chat(req, extras, history)
    chat = chat_request(chat_body, _RENAMES)
    model, _ = await service.resolve_model(chat.model)
    meta = ResponseMeta(id=_id("resp"), created=int(time.time()), model=model, n=1)

    def keep(response: dict) -> None:
        if req.store:
            store.put(response, conversation)

    def respond(meta, deltas, usage):
        status = final_status(deltas[0].finish_reason)
        output = whole_output(reader_for(request, chat), deltas[0].text, status)
        response = response_object(meta, req, output, usage, status)
        keep(response)
        return response

    async def stream_fn(request, mailbox, meta, _req):
        return await stream_events(request, mailbox, ResponseEvents(meta, req, reader_for(request, chat), keep))

    return await run_chat(request, chat, meta, stream_fn, respond)


async def get_response(request: web.Request) -> web.Response:
    found = request.app[STORE].get(request.match_info["response_id"])
    if found is None:
        raise ApiError(f"Response with id '{request.match_info['response_id']}' not found.", 404,
                       param="response_id", code="not_found")
    return web.json_response(found[0])


def add_routes(app: web.Application) -> None:
    config = app[SERVICE].config
    app[STORE] = ResponseStore(getattr(config, "response_store_size", 1024),
                               getattr(config, "response_store_ttl_s", 3600.0))
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
