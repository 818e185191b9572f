"""Validated OpenAI requests -> the ``GenerateRequest``s the gateway pushes to the tokenizer.

Called by ``routes.py`` and ``api_bridge.py``. The body's ``SamplingParams`` comes from its request
model (``protocol.py``'s ``sampling_params()``) and travels in each request unchanged; the forks of
``n``/``best_of`` choices and beam search are the input processor's (``folio/core/input_processor.py``), the same
that ``folio.LLM`` uses. Each prompt becomes one ``GenerateRequest``; its sequences are
``<id>-<index>``, ``index = prompt_index * n + i``. When seeded, choice ``i`` gets ``seed + i``
(``SamplingParams.with_seed_offset``): the choices differ, the whole response is reproducible. With
``use_beam_search`` the ids receive the best beams, best first. ``lora_name`` is the LoRA adapter the
request's ``model`` named (None: the base model).
"""

from __future__ import annotations

import time

import msgspec

from folio.core.input_processor import chat_message, generate_request
from folio.core.structured.grammar import after_reasoning
from folio.services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from folio.services.gateway.structured import guided_spec, tool_mode
from folio.shared.messages import GenerateRequest
from folio.shared.sampling import SamplingParams


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
    params = params or req.sampling_params()
    now = time.time()
    return [generate_request(params, base_id, p_index, echo=req.echo, stream=bool(req.stream), arrival_time=now,
                             cache_salt=req.cache_salt, priority=req.priority, guided=guided_spec(req),
                             lora_name=lora_name, **prompt)
            for p_index, prompt in enumerate(completion_prompts(req))]


def chat_generate_requests(req: ChatCompletionRequest, base_id: str, params: SamplingParams | None = None,
                           lora_name: str | None = None, reasoning: bool = False,
                           images: list[bytes] = ()) -> list[GenerateRequest]:
    """``reasoning``: the model thinks first (``--reasoning-parser``): structured output and forced
    tool calls constrain the answer after its think block; guided_regex and guided_grammar, the
    low-level forms, still constrain the whole output."""
    params = params or req.sampling_params()
    guided = guided_spec(req)
    if reasoning and guided is not None and guided.kind in ("json_schema", "json_object", "choice"):
        guided = msgspec.structs.replace(guided, kind=after_reasoning(guided.kind))
    # tool_choice none still shows no tools to the model, as OpenAI does not call any
    tools = [msgspec.to_builtins(t) for t in req.tools] if tool_mode(req) != "none" else None
    return [generate_request(
        params, base_id, messages=[chat_message(m) for m in req.messages],
        add_generation_prompt=req.add_generation_prompt, stream=bool(req.stream), arrival_time=time.time(),
        cache_salt=req.cache_salt, priority=req.priority, guided=guided, tools=tools, lora_name=lora_name,
        chat_template_kwargs=req.chat_template_kwargs, images=list(images))]
