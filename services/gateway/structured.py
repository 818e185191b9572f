"""Structured output and tool calling at the gateway: request fields -> a ``GuidedSpec``, and
generated text -> OpenAI ``tool_calls``.

``convert.py`` asks ``guided_spec`` what the output must match (``response_format``, vLLM's
``guided_*``, or, with ``tool_choice`` required or a named function, the tools' argument
schemas); the tokenizer compiles it and the executor enforces it. ``routes.py`` turns each
choice's text into tool calls with ``ToolCallReader``: with ``tool_choice`` named the text *is*
the arguments; with ``required`` it is a JSON list of ``{"name", "arguments"}``; with ``auto`` the
calls are parsed from free text, in the form the model's family writes them (``tool_parsers.py``:
Hermes/Qwen, Llama 3 JSON, Llama pythonic, Mistral, Qwen3-Coder; ``--tool-call-parser``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from folio.services.gateway.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from folio.services.gateway.tool_parsers import hold_from, parse_calls, tool_call
from folio.shared.messages import GuidedSpec

ANY_OBJECT = {"type": "object"}


def guided_spec(req: CompletionRequest | ChatCompletionRequest) -> GuidedSpec | None:
    """What the request's output must match, or None (the rules in ``protocol.py`` already
    refused more than one)."""
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        return GuidedSpec(kind="json_object", param="response_format")
    if rf is not None and rf.type == "json_schema":
        return GuidedSpec(kind="json_schema", spec=json.dumps(rf.json_schema.schema), param="response_format")
    if req.guided_json is not None:
        spec = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
        return GuidedSpec(kind="json_schema", spec=spec, param="guided_json")
    if req.guided_regex is not None:
        return GuidedSpec(kind="regex", spec=req.guided_regex, param="guided_regex")
    if req.guided_choice is not None:
        return GuidedSpec(kind="choice", spec=json.dumps(req.guided_choice), param="guided_choice")
    if req.guided_grammar is not None:
        return GuidedSpec(kind="grammar", spec=req.guided_grammar, param="guided_grammar")
    if isinstance(req, ChatCompletionRequest):
        return _tools_spec(req)
    return None


def tool_mode(req: ChatCompletionRequest) -> str:
    """none (no tools, or tool_choice none), auto, required or named."""
    if not req.tools or req.tool_choice == "none":
        return "none"
    if isinstance(req.tool_choice, NamedToolChoice):
        return "named"
    return req.tool_choice or "auto"


def _tools_spec(req: ChatCompletionRequest) -> GuidedSpec | None:
    mode = tool_mode(req)
    if mode == "named":
        fn = next(t.function for t in req.tools if t.function.name == req.tool_choice.function.name)
        return GuidedSpec(kind="json_schema", spec=json.dumps(fn.parameters or ANY_OBJECT), param="tools")
    if mode != "required":
        return None
    call = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                              "arguments": t.function.parameters or ANY_OBJECT},
             "required": ["name", "arguments"]} for t in req.tools]
    schema = {"type": "array", "minItems": 1, "items": call[0] if len(call) == 1 else {"anyOf": call}}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    return GuidedSpec(kind="json_schema", spec=json.dumps(schema), param="tools")


# --------------------------------------------------------------------------- parsing


def parse_auto(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of free text in any of the families' formats (``tool_parsers``)."""
    return parse_calls(text, names)


@dataclass
class ToolCallReader:
    """One choice's text as OpenAI message fields (``content``, ``tool_calls``), whole or as a
    stream of chat-chunk deltas."""

    mode: str  # auto, required, named
    names: set[str]
    named: str | None = None
    text: str = ""
    streamed: int = 0  # characters of ``text`` already sent
    named_id: str | None = None
    calls: list[dict] = field(default_factory=list)
    parser: str = "auto"  # --tool-call-parser: the format free text is read in (``tool_parsers``)
    schemas: dict[str, dict] = field(default_factory=dict)  # each tool's parameter schema

    @classmethod
    def for_request(cls, req: ChatCompletionRequest, parser: str = "auto") -> "ToolCallReader | None":
        mode = tool_mode(req)
        if mode == "none":
            return None
        named = req.tool_choice.function.name if mode == "named" else None
        return cls(mode=mode, names={t.function.name for t in req.tools}, named=named, parser=parser,
                   schemas={t.function.name: t.function.parameters or {} for t in req.tools})

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        """The whole text -> (content, tool_calls)."""
        if self.mode == "named":
            return None, [tool_call(self.named, text)]
        if self.mode == "required":
            return None, self._required_calls(text)
        return parse_calls(text, self.names, self.parser, self.schemas)

    def _required_calls(self, text: str) -> list[dict]:
        try:
            items = json.loads(text)
        except ValueError:  # cut short by max_tokens: nothing complete to call
            return []
        return [tool_call(i["name"], i["arguments"]) for i in items if isinstance(i, dict) and "name" in i]

    def finish_reason(self, reason: str | None, calls: list[dict]) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a forced named call ends with "stop"
        if reason == "stop" and calls and self.mode != "named":
            return "tool_calls"
        return reason

    def stream_delta(self, new_text: str, finished: bool) -> list[dict]:
        """Chunk deltas for ``new_text`` (and, when ``finished``, whatever was held back)."""
        self.text += new_text
        if self.mode == "named":  # the arguments stream as they come
            out = []
            if self.named_id is None:
                self.named_id = tool_call(self.named, "")["id"]
                out.append({"tool_calls": [{"index": 0, "id": self.named_id, "type": "function",
                                            "function": {"name": self.named, "arguments": ""}}]})
            if new_text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]})
            return out
        out = []
        if self.mode == "auto":  # send the text that cannot be part of a call at once
            cut = hold_from(self.text[self.streamed:], not self.text[:self.streamed].strip(), self.parser)
            if cut:
                out.append({"content": self.text[self.streamed:self.streamed + cut]})
                self.streamed += cut
        pending = self.text[self.streamed:]
        if not finished:
            return out
        content, self.calls = self.message(pending if self.mode == "auto" else self.text)
        out += [{"content": content}] if content else []
        for i, call in enumerate(self.calls):
            out.append({"tool_calls": [{"index": i, **call}]})
        return out
