"""The reasoning a model writes before its answer, split from the answer (``--reasoning-parser``).

Qwen3 and DeepSeek-R1 think inside ``<think>...</think>`` and answer after it. vLLM and SGLang
return that part as ``reasoning_content``; so does folio: ``chat_output.OutputReader`` (chat, and
through it the Responses and Messages APIs) asks a ``ReasoningSplitter`` for each choice's
(reasoning, content), whole or delta by delta, and reads tool calls from the content only.

- ``qwen3``: reasoning only when the output opens with ``<think>`` (with ``enable_thinking:
  false`` the template closes an empty block in the prompt and the output is all answer);
- ``deepseek_r1``: the template opens the block in the prompt, so the output starts in the
  reasoning (an opening ``<think>`` is dropped) and stays there until ``</think>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PARSERS = ("auto", "none", "qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def resolve_parser(name: str, model: str) -> str | None:
    """The parser ``--reasoning-parser`` names; ``auto``: the model family's (a Qwen3 or
    DeepSeek-R1 checkpoint's config or name says which), else none."""
    if name != "auto":
        return None if name == "none" else name
    model_type = ""
    config = Path(model) / "config.json"
    if config.is_file():
        try:
            model_type = str(json.loads(config.read_text()).get("model_type", ""))
        except (OSError, ValueError):
            pass
    lowered = f"{model_type} {Path(model.rstrip('/')).name}".lower()
    if "deepseek-r1" in lowered or "deepseek_r1" in lowered:
        return "deepseek_r1"
    if model_type in ("qwen3", "qwen3_moe") or "qwen3" in lowered:
        return "qwen3"
    return None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (a marker cut by a delta)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReasoningSplitter:
    """One choice's output as (reasoning, content): ``split`` on whole text, ``feed`` on deltas."""

    parser: str  # qwen3 or deepseek_r1
    state: str = ""  # "" undecided, "reasoning", "content"
    held: str = ""  # text not yet sent: it may be part of a marker

    def split(self, text: str) -> tuple[str | None, str | None]:
        if self.parser == "qwen3" and not text.lstrip().startswith(START):
            return None, text or None
        if END in text:
            reasoning, content = text.split(END, 1)
            reasoning = reasoning.lstrip().removeprefix(START)
            return reasoning or None, content.lstrip("\n") or None
        if self.parser == "deepseek_r1" or text.lstrip().startswith(START):
            return text.lstrip().removeprefix(START) or None, None  # cut short while thinking
        return None, text or None

    def feed(self, new_text: str, finished: bool = False) -> tuple[str, str]:
        """(reasoning, content) to send for ``new_text``; text that may be a cut marker waits."""
        text, self.held = self.held + new_text, ""
        reasoning = content = ""
        if not self.state:
            stripped = text.lstrip()
            if stripped.startswith(START):
                self.state, text = "reasoning", stripped[len(START):]
            elif START.startswith(stripped) and not finished:
                self.held = text  # maybe "<thi" of "<think>"
                return "", ""
            else:
                self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self.state == "reasoning":
            if END in text:
                reasoning, text = text.split(END, 1)
                self.state, text = "content", text.lstrip("\n")
                if not text and not finished:
                    self.state = "content_start"  # the answer's leading newlines are dropped
            else:
                keep = 0 if finished else _partial_suffix(text, END)
                reasoning, self.held, text = text[:len(text) - keep], text[len(text) - keep:], ""
        if self.state == "content_start":
            text = text.lstrip("\n")
            if text:
                self.state = "content"
        if self.state == "content":
            content = text
        return reasoning, content
