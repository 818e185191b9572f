"""Validated OpenAI requests -> the ``GenerateRequest``s the gateway pushes to the tokenizer.

Called by ``routes.py``. A request with ``n`` choices (and, for completions, several prompts)
fans out into one ``GenerateRequest`` per choice, with req ids ``<id>-<choice index>``; choice
``index = prompt_index * n + i`` and, when seeded, choice ``i`` gets ``seed + i`` so the choices
differ but the whole response is reproducible.
"""

from __future__ import annotations

import time

from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from shared.messages import ChatMessage, GenerateRequest, SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def sampling_params(req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None, seed_offset: int = 0) -> SamplingParams:
    given = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    return SamplingParams(
        **{k: v for k, v in given.items() if v is not None},
        top_k=req.top_k if req.top_k is not None and req.top_k > 0 else None,
        seed=None if req.seed is None else _offset_seed(req.seed, seed_offset),
        max_tokens=max_tokens,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _offset_seed(seed: int, offset: int) -> int:
    """``seed + offset``, stepping down instead where that would leave the int64 range."""
    return seed + offset if seed + offset < 2**63 else seed - offset


def stop_strings(req: CompletionRequest | ChatCompletionRequest) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def completion_prompts(req: CompletionRequest) -> list[dict]:
    """Each prompt as the GenerateRequest fields that carry it."""
    p = req.prompt
    if isinstance(p, str):
        return [{"prompt": p}]
    if all(isinstance(x, int) for x in p):
        return [{"prompt_token_ids": list(p)}]
    return [{"prompt": x} if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]


def completion_generate_requests(req: CompletionRequest, base_id: str) -> list[GenerateRequest]:
    n = req.n or 1
    max_tokens = req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    # echo with logprobs also returns the prompt tokens' logprobs, as OpenAI does
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    now = time.time()
    out = []
    for p_index, prompt in enumerate(completion_prompts(req)):
        for i in range(n):
            out.append(GenerateRequest(
                req_id=f"{base_id}-{p_index * n + i}",
                sampling=sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs,
                                         prompt_logprobs=prompt_logprobs, seed_offset=i),
                stop=stop_strings(req),
                echo=req.echo,
                stream=bool(req.stream),
                arrival_time=now,
                cache_salt=req.cache_salt,
                **prompt,
            ))
    return out


def chat_generate_requests(req: ChatCompletionRequest, base_id: str) -> list[GenerateRequest]:
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    messages = [ChatMessage(role=m.role, content=m.text()) for m in req.messages]
    now = time.time()
    return [
        GenerateRequest(
            req_id=f"{base_id}-{i}",
            sampling=sampling_params(req, max_tokens=max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, logprobs=logprobs,
                                     seed_offset=i),
            messages=messages,
            add_generation_prompt=req.add_generation_prompt,
            fill_max_tokens=max_tokens is None,  # chat's default: whatever the context leaves
            stop=stop_strings(req),
            stream=bool(req.stream),
            arrival_time=now,
            cache_salt=req.cache_salt,
        )
        for i in range(req.n or 1)
    ]
