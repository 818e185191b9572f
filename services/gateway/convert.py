"""Validated OpenAI requests -> the front door's ``SamplingParams`` -> the ``GenerateRequest``s
the gateway pushes to the tokenizer.

Called by ``routes.py``. Only the OpenAI mapping lives here (which field means what, the
endpoints' defaults); the rules that tie parameters together, the forks of ``n``/``best_of``
choices, best_of's logprobs, beam search and stop strings are the front door's
(``folio/core/frontdoor.py``), the same that ``folio.LLM`` uses. Each prompt becomes one
``GenerateRequest``; its sequences are ``<id>-<index>``, ``index = prompt_index * n + i``. When
seeded, choice ``i`` gets ``seed + i`` (``SamplingParams.with_seed_offset``): the choices differ,
the whole response is reproducible. With ``use_beam_search`` the ids receive the best beams, best
first. ``lora_name`` is the LoRA adapter the request's ``model`` named (None: the base model).
"""

from __future__ import annotations

import time

import msgspec

from folio.core.frontdoor import ParamError, SamplingParams, chat_message
from folio.core.structured.grammar import after_reasoning
from folio.services.gateway.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from folio.services.gateway.structured import guided_spec, tool_mode
from folio.shared.messages import GenerateRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def sampling_params(req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None, **beam) -> SamplingParams:
    """The front door's params of an OpenAI body; a parameter it refuses is a 400 naming it.
    Parameters not given keep their defaults (OpenAI's and vLLM's agree); beam search, whose beams
    run greedy, defaults to temperature 0."""
    given = {
        "n": req.n,
        "temperature": req.temperature if req.temperature is not None or not beam.get("use_beam_search") else 0.0,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
    }
    try:
        return SamplingParams(**{k: v for k, v in given.items() if v is not None}, seed=req.seed,
                              max_tokens=max_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, **beam)
    except ParamError as exc:
        raise ApiError(str(exc), param=exc.param) from None


def completion_params(req: CompletionRequest) -> SamplingParams:
    # echo with logprobs also returns the prompt tokens' logprobs, as OpenAI does
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    return sampling_params(req, max_tokens=req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, logprobs=req.logprobs,
                           prompt_logprobs=prompt_logprobs, best_of=req.best_of,
                           use_beam_search=req.use_beam_search, length_penalty=req.length_penalty,
                           early_stopping=req.early_stopping)


def chat_params(req: ChatCompletionRequest) -> SamplingParams:
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return sampling_params(req, max_tokens=max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, logprobs=logprobs)


def completion_prompts(req: CompletionRequest) -> list[dict]:
    """Each prompt as the GenerateRequest fields that carry it."""
    p = req.prompt
    if isinstance(p, str):
        return [{"prompt": p}]
    if all(isinstance(x, int) for x in p):
        return [{"prompt_token_ids": list(p)}]
    return [{"prompt": x} if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]


def completion_generate_requests(req: CompletionRequest, base_id: str, params: SamplingParams | None = None,
                                 lora_name: str | None = None) -> list[GenerateRequest]:
    params = params or completion_params(req)
    now = time.time()
    return [params.to_generate_request(base_id, p_index, echo=req.echo, stream=bool(req.stream), arrival_time=now,
                                       cache_salt=req.cache_salt, priority=req.priority, guided=guided_spec(req),
                                       lora_name=lora_name, **prompt)
            for p_index, prompt in enumerate(completion_prompts(req))]


def chat_generate_requests(req: ChatCompletionRequest, base_id: str, params: SamplingParams | None = None,
                           lora_name: str | None = None, reasoning: bool = False) -> list[GenerateRequest]:
    """``reasoning``: the model thinks first (``--reasoning-parser``): structured output and forced
    tool calls constrain the answer after its think block; guided_regex and guided_grammar, the
    low-level forms, still constrain the whole output."""
    params = params or chat_params(req)
    guided = guided_spec(req)
    if reasoning and guided is not None and guided.kind in ("json_schema", "json_object", "choice"):
        guided = msgspec.structs.replace(guided, kind=after_reasoning(guided.kind))
    # tool_choice none still shows no tools to the model, as OpenAI does not call any
    tools = [msgspec.to_builtins(t) for t in req.tools] if tool_mode(req) != "none" else None
    return [params.to_generate_request(
        base_id, messages=[chat_message(m) for m in req.messages], add_generation_prompt=req.add_generation_prompt,
        fill_max_tokens=(req.max_completion_tokens or req.max_tokens) is None,  # chat's default: what the context leaves
        stream=bool(req.stream), arrival_time=time.time(), cache_salt=req.cache_salt, priority=req.priority,
        guided=guided, tools=tools, lora_name=lora_name, chat_template_kwargs=req.chat_template_kwargs)]
