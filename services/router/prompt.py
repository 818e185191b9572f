"""The token ids a replica will compute for a request body, so that the router can hash its blocks.

It encodes with the tokenizer service's own ``TextTokenizer`` (the same HF tokenizer and chat
template, read from the same model folder), so the ids, and hence the chained block hashes, are
the ones the replica's kvmanager computes. Only what decides the prompt is read from the body; the
replica validates the whole request. A body this cannot read yields None: the request is then
routed by load alone, and the replica answers whatever is wrong with it.

Replicas of different base models tokenize differently: ``PromptEncoders`` keeps one encoder per
base model. The router's ``--model`` is the one used while every replica serves one base model (as
before there were several), and for the base model whose id or ``root`` (the replicas' own
``--model``) it names; another base model's tokenizer is read, once, from its ``root`` when the
router can resolve that path too. When it cannot, that model's requests are routed by load.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import structlog

from folio.core.tokenizer.text import TextTokenizer
from folio.shared.messages import ChatMessage, GenerateRequest
from folio.shared.sampling import SamplingParams

log = structlog.get_logger()


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


class PromptEncoders:
    """The encoder for each base model behind the router. ``default``: the ``--model``'s (None: the
    router does not tokenize, and neither does this for any other model)."""

    def __init__(self, default: PromptEncoder | None, default_model: str):
        self.default = default
        self.default_names = {default_model, Path(default_model.rstrip("/")).name}
        self._by_root: dict[str, asyncio.Future] = {}

    async def for_model(self, base, num_bases: int) -> PromptEncoder | None:
        """``base``: the ``ServedModel`` of the request's base model (None: not known)."""
        if self.default is None or base is None or num_bases <= 1:
            return self.default
        if base.id in self.default_names or base.root in self.default_names:
            return self.default
        if not base.root:
            return None
        loading = self._by_root.get(base.root)
        if loading is None:
            loading = self._by_root[base.root] = asyncio.ensure_future(asyncio.to_thread(_load, base.id, base.root))
        return await asyncio.shield(loading)


def _load(model_id: str, root: str) -> PromptEncoder | None:
    from folio.core.model_files import resolve_model

    try:
        encoder = PromptEncoder(TextTokenizer(resolve_model(root)))
    except Exception as exc:  # not on this machine, or no tokenizer in it: routed by load
        log.warning("cannot load a base model's tokenizer; its requests are routed by load", model=model_id,
                    root=root, error=f"{type(exc).__name__}: {exc}")
        return None
    log.info("tokenizer loaded for a base model", model=model_id, root=root)
    return encoder


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
