"""The token ids a replica will compute for a request body, so that the router can hash its blocks.

It encodes with the tokenizer service's own ``TextTokenizer`` (the same HF tokenizer and chat
template, read from the same model folder), so the ids, and hence the chained block hashes, are
the ones the replica's kvmanager computes. Only what decides the prompt is read from the body; the
replica validates the whole request. A body this cannot read yields None: the request is then
routed by load alone, and the replica answers whatever is wrong with it.
"""

from __future__ import annotations

import threading

from folio.shared.messages import ChatMessage, GenerateRequest, SamplingParams
from folio.shared.text import TextTokenizer


class PromptEncoder:
    """Called from worker threads (``asyncio.to_thread``): one at a time, as a Rust tokenizer whose
    settings ``encode`` touches refuses a second caller ("Already borrowed")."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()

    def token_ids(self, body: dict, chat: bool) -> list[int] | None:
        try:
            request = _generate_request(body, chat)
            if request is None:
                return None
            with self._lock:
                return self.tokenizer.encode_request(request)[0]
        except Exception:  # whatever a body or a chat template throws: the request is routed by load
            return None


def _generate_request(body: dict, chat: bool) -> GenerateRequest | None:
    """The request as the gateway would hand it to the tokenizer (first prompt of a batch)."""
    params = SamplingParams()
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        return GenerateRequest(req_id="route", sampling=params, messages=[_message(m) for m in messages],
                               add_generation_prompt=bool(body.get("add_generation_prompt", True)))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts: route by the first
    if isinstance(prompt, str) and prompt:
        return GenerateRequest(req_id="route", sampling=params, prompt=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return GenerateRequest(req_id="route", sampling=params, prompt_token_ids=prompt)
    return None


def _message(message: dict) -> ChatMessage:
    """OpenAI's content: a string, or text parts joined (as the gateway's ``ChatMessageIn.text``)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return ChatMessage(role=str(message["role"]), content=content or "")
