"""One choice's generated text as the fields of an assistant message: reasoning, content and tool
calls, whole or as a stream of chat-chunk deltas.

``routes.py`` (chat completions) and the Responses and Messages APIs (``responses_api.py``,
``messages_api.py``) build one ``OutputReader`` per choice with ``output_reader``. The reasoning
is split off first (``reasoning.py``, ``--reasoning-parser``); tool calls are read from what
follows it only (``structured.ToolCallReader``, ``--tool-call-parser``), so a tool call the model
merely thinks about is not called.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from folio.services.gateway.protocol import ChatCompletionRequest
from folio.services.gateway.reasoning import ReasoningSplitter, resolve_parser
from folio.services.gateway.structured import ToolCallReader


@lru_cache(maxsize=8)
def reasoning_parser_of(flag: str, model: str) -> str | None:
    return resolve_parser(flag, model)


def thinking_enabled(req: ChatCompletionRequest) -> bool:
    """``chat_template_kwargs: {"enable_thinking": false}`` (Qwen3's switch) turns reasoning off."""
    return (req.chat_template_kwargs or {}).get("enable_thinking", True) is not False


def request_reasoning_parser(req: ChatCompletionRequest, config) -> str | None:
    """The reasoning parser this request's output is read with (None: no reasoning)."""
    parser = reasoning_parser_of(getattr(config, "reasoning_parser", "none"), getattr(config, "model", ""))
    return parser if parser is not None and thinking_enabled(req) else None


@dataclass
class OutputReader:
    reasoning: ReasoningSplitter | None
    tools: ToolCallReader | None

    @property
    def calls(self) -> list[dict]:
        return self.tools.calls if self.tools is not None else []

    @property
    def named_id(self) -> str | None:
        return self.tools.named_id if self.tools is not None else None

    def message(self, text: str) -> tuple[str | None, str | None, list[dict]]:
        """The whole text -> (reasoning, content, tool calls)."""
        reasoning, content = self.reasoning.split(text) if self.reasoning is not None else (None, text)
        if self.tools is None:
            return reasoning, content, []
        content, calls = self.tools.message(content or "")
        return reasoning, content, calls

    def finish_reason(self, reason: str | None, calls: list) -> str | None:
        return self.tools.finish_reason(reason, calls) if self.tools is not None else reason

    def stream_delta(self, new_text: str, finished: bool) -> list[dict]:
        """Chat-chunk deltas (``reasoning_content``, ``content``, ``tool_calls``) for ``new_text``."""
        out = []
        content = new_text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(new_text, finished)
            if reasoning:
                out.append({"reasoning_content": reasoning})
        if self.tools is not None:
            out += self.tools.stream_delta(content, finished)
        elif content:
            out.append({"content": content})
        return out


def output_reader(req: ChatCompletionRequest, config) -> OutputReader | None:
    """The request's reader, or None when its text is all content (no reasoning, no tools)."""
    parser = request_reasoning_parser(req, config)
    tools = ToolCallReader.for_request(req, getattr(config, "tool_call_parser", "auto"))
    if parser is None and tools is None:
        return None
    return OutputReader(ReasoningSplitter(parser) if parser is not None else None, tools)
