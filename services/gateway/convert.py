"""Validated OpenAI requests -> the ``GenerateRequest``s the gateway pushes to the tokenizer.

Called by ``routes.py``. Each prompt becomes one ``GenerateRequest``; its ``n`` choices (or
``best_of`` sequences) have req ids ``<id>-<index>``, ``index = prompt_index * n + i``: the first
is the request's own id, the others ride in ``fork_req_ids`` and the scheduler forks them from the
first once the prompt is computed, so the prompt is computed and stored once. When seeded, choice
``i`` gets ``seed + i`` (``SamplingParams.with_seed_offset``): the choices differ, the whole
response is reproducible. With ``use_beam_search`` the ids receive the best beams, best first.
"""

from __future__ import annotations

import time

import msgspec

from folio.services.gateway.protocol import ChatCompletionRequest, ChatMessageIn, CompletionRequest
from folio.services.gateway.structured import guided_spec, tool_mode
from folio.shared.messages import BeamSearchParams, ChatMessage, GenerateRequest, SamplingParams, ToolCall

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def sampling_params(req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
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
        seed=req.seed,
        max_tokens=max_tokens,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


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
    n = req.num_sequences if not req.use_beam_search else req.n or 1
    max_tokens = req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    # echo with logprobs also returns the prompt tokens' logprobs, as OpenAI does
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    logprobs = req.logprobs
    if n > (req.n or 1) and logprobs is None:
        logprobs = 0  # best_of ranks the sequences by their cumulative logprob
    beam = None
    if req.use_beam_search:
        beam = BeamSearchParams(width=req.num_sequences, length_penalty=req.length_penalty,
                                early_stopping=req.early_stopping)
    now = time.time()
    return [
        GenerateRequest(
            req_id=f"{base_id}-{p_index * n}",
            fork_req_ids=[f"{base_id}-{p_index * n + i}" for i in range(1, n)],
            sampling=sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs),
            stop=stop_strings(req),
            echo=req.echo,
            stream=bool(req.stream),
            arrival_time=now,
            cache_salt=req.cache_salt,
            priority=req.priority,
            beam_search=beam,
            guided=guided_spec(req),
            **prompt,
        )
        for p_index, prompt in enumerate(completion_prompts(req))
    ]


def chat_generate_requests(req: ChatCompletionRequest, base_id: str) -> list[GenerateRequest]:
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    messages = [chat_message(m) for m in req.messages]
    # tool_choice none still shows no tools to the model, as OpenAI does not call any
    tools = [msgspec.to_builtins(t) for t in req.tools] if tool_mode(req) != "none" else None
    return [GenerateRequest(
        req_id=f"{base_id}-0",
        fork_req_ids=[f"{base_id}-{i}" for i in range(1, req.n or 1)],
        sampling=sampling_params(req, max_tokens=max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, logprobs=logprobs),
        messages=messages,
        add_generation_prompt=req.add_generation_prompt,
        fill_max_tokens=max_tokens is None,  # chat's default: whatever the context leaves
        stop=stop_strings(req),
        stream=bool(req.stream),
        arrival_time=time.time(),
        cache_salt=req.cache_salt,
        priority=req.priority,
        guided=guided_spec(req),
        tools=tools,
    )]


def chat_message(m: ChatMessageIn) -> ChatMessage:
    calls = [ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments) for c in m.tool_calls or []]
    return ChatMessage(role=m.role, content=m.text(), tool_calls=calls, tool_call_id=m.tool_call_id, name=m.name)
