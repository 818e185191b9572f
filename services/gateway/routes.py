"""The HTTP routes of the gateway: OpenAI's completions, chat completions and models, vLLM's
``/tokenize``, ``/detokenize``, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, plus ``/health``, ``/ready``, ``/live`` and ``/metrics``, and the
middlewares for the API key (on ``/v1/``, ``/tokenize``, ``/detokenize`` and the live KV page's
data, ``dashboard.py``) and for error objects.

Probes follow the Kubernetes convention: ``/live`` says only that the gateway's loop runs (a
liveness failure restarts the container, which would not mend a service behind it); ``/health``
and ``/ready`` say whether a request can be served now: every service answered its ping
(``health.HealthMonitor``) and the gateway is not draining, else 503 naming what is down.

``app.py`` mounts these on an aiohttp application that holds the ``GatewayService`` under
``SERVICE``. Every route that generates submits its choices, reads their mailbox (``streaming.py``)
and, whatever happens (client gone, error), aborts what did not finish.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from functools import partial

import msgspec
import structlog
from aiohttp import web

from folio.core.input_processor import best_of_order, chat_message
from folio.services.gateway import convert, media, responses
from folio.services.gateway.chat_output import OutputReader, output_reader, request_reasoning_parser
from folio.services.gateway.metrics import CONTENT_TYPE
from folio.services.gateway.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    LoadLoRAAdapterRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoRAAdapterRequest,
    parse,
)
from folio.services.gateway.responses import ResponseMeta, UsageCounter
from folio.services.gateway.service import GatewayService
from folio.services.gateway.streaming import collect, stream
from folio.shared import messages
from folio.shared.keys import verify
from folio.shared.curve import stack_keys

log = structlog.get_logger()  # lazy: takes the config setup_logging makes in main
SERVICE = web.AppKey("service", GatewayService)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # aiohttp's own errors (unknown route, wrong method, body too large) in OpenAI's shape too
        type_ = "invalid_request_error" if exc.status < 500 else "server_error"
        return web.json_response(ApiError(exc.reason, exc.status, type_=type_).body(), status=exc.status)
    except Exception:
        log.exception("request failed", path=request.path)
        return web.json_response(ApiError("internal server error", 500, type_="server_error").body(), status=500)


# the live KV page itself holds no data; /tokenize and /detokenize cost the tokenizer work
PROTECTED_PREFIXES = ("/v1/", "/dashboard/api/", "/tokenize", "/detokenize")


def auth_middleware(api_key: str | None):
    @web.middleware
    async def check_key(request: web.Request, handler):
        if api_key and request.path.startswith(PROTECTED_PREFIXES):
            given = request.headers.get("Authorization", "")
            anthropic_key = request.headers.get("x-api-key", "")  # Anthropic's clients send the key here
            if not (hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())
                    or hmac.compare_digest(anthropic_key.encode(), api_key.encode())):
                err = ApiError("Incorrect API key provided.", 401, code="invalid_api_key")
                return web.json_response(err.body(), status=401)
        return await handler(request)

    return check_key


async def completions(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    req = parse(await request.read(), CompletionRequest)
    params = req.sampling_params()
    model, lora_name = await service.resolve_model(req.model)
    meta = ResponseMeta(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model, n=req.n or 1,
                        echo=req.echo)
    gen = _with_kv_transfer(service, req, convert.completion_generate_requests(req, meta.id, params, lora_name))
    response_fn = await _kv_export_response(service, req, responses.completion_response)
    mailbox = service.submit(gen, _resumed(req))
    best_of = params.num_sequences if params.ranks_by_logprob else None
    return await _respond(request, mailbox, meta, req, _stream_completion, response_fn, best_of)


def _with_kv_transfer(service, req, gen: list[messages.GenerateRequest]) -> list[messages.GenerateRequest]:
    """The ``kv_transfer`` extension (router <-> gateway, disaggregated serving) onto the request:
    refused (400) where this instance's ``--kv-role`` cannot serve it or the handle is malformed."""
    kt = req.kv_transfer
    if kt is None:
        return gen
    from folio.shared.messages import TransferHandle
    role = getattr(service.config, "kv_role", "both")
    if kt.export and role != "prefill":
        raise ApiError(f"kv_transfer export needs a prefill instance (--kv-role prefill); this one is {role}",
                       param="kv_transfer")
    if kt.handle is None:
        if kt.export_to:  # the executor serves the transfer to this key only
            return [msgspec.structs.replace(g, kv_transfer={"export_to": kt.export_to}) for g in gen]
        return gen
    if role == "prefill":
        raise ApiError("a prefill instance (--kv-role prefill) does not decode from a kv_transfer handle",
                       param="kv_transfer")
    keys = stack_keys()
    try:  # only the router, holding the stack's key, names a transfer to pull (never a plain client)
        if keys is None:
            raise ValueError("kv_transfer handles are taken only signed by the router (this stack has no keys)")
        handle = TransferHandle.from_wire(verify(keys, kt.handle)).to_wire()
    except ValueError as exc:
        raise ApiError(str(exc), param="kv_transfer") from None
    return [msgspec.structs.replace(g, kv_transfer=handle, forced_token_ids=list(kt.forced_token_ids)) for g in gen]


async def _kv_export_response(service, req, response_fn):
    """With ``kv_transfer.export``: the response also names the transfer (the choice's request id,
    which the executor exports its prompt's KV under), the executor's transfer port and the first
    token's id, for the router to hand to a decode instance."""
    if req.kv_transfer is None or not req.kv_transfer.export:
        return response_fn
    sender = getattr(service, "kv_sender", None)  # (port, block size) of the executor's KV sender
    if sender is None:
        stats = await service._ask_executor("stats", {})
        if not stats.get("kv_transfer_port"):
            raise ApiError("the executor serves no KV transfers (start it with --kv-role prefill)", 503,
                           type_="server_error", code="service_unavailable")
        sender = service.kv_sender = (stats["kv_transfer_port"], stats["kv_block_size"])
    port, block_size = sender

    def respond(meta, deltas, usage):
        body = response_fn(meta, deltas, usage)
        d = deltas[0]
        body["kv_transfer"] = {"transfer_id": f"{meta.id}-0", "port": port, "token_ids": list(d.token_ids),
                               "num_prompt_tokens": d.num_prompt_tokens,
                               "num_blocks": -(-d.num_prompt_tokens // block_size)}
        return body
    return respond


def _resumed(req) -> dict[int, tuple[list[int], bool]] | None:
    """``continue_choices`` (the router resuming a stream another replica began): choice index ->
    (the token ids the client has, finished). Only for streams without tools: the tool-call
    reader's state is not rebuilt."""
    if not req.continue_choices:
        return None
    if not req.stream:
        raise ApiError("continue_choices resumes a stream: set stream", param="continue_choices")
    if getattr(req, "tools", None) or getattr(req, "use_beam_search", False):
        raise ApiError("a stream with tools or beam search cannot be resumed", param="continue_choices")
    return {c.index: (c.token_ids, c.finished) for c in req.continue_choices}


def _continued(req) -> set[int]:
    """The choices whose stream began on another replica (their opening chunk went out there)."""
    return {c.index for c in req.continue_choices or () if c.token_ids or c.finished}


def _with_token_ids(chunk: dict, delta) -> dict:
    """``return_token_ids``: the delta's token ids on its choice (vLLM's field)."""
    for choice in chunk["choices"]:
        choice["token_ids"] = list(delta.token_ids)
    return chunk


async def _respond(request, mailbox, meta: ResponseMeta, req, stream_fn, response_fn,
                   best_of: int | None = None) -> web.StreamResponse:
    """Stream the choices or wait for them all; abort what did not finish, whatever happens."""
    service = request.app[SERVICE]
    timeout_s = service.config.request_timeout_s
    timer = asyncio.get_running_loop().call_later(
        timeout_s, service.fail, mailbox, f"the request did not finish within --request-timeout {timeout_s:g}s", 504,
    ) if timeout_s > 0 else None
    try:
        if req.stream:
            return await stream_fn(request, mailbox, meta, req)
        deltas = await collect(mailbox)
        usage = UsageCounter(best_of or meta.n)  # every generated sequence counts
        for i, d in deltas.items():
            usage.add(i, d)
        if best_of:
            deltas = _best_of(deltas, best_of, meta.n, keep_logprobs=req.logprobs is not None)
        return web.json_response(response_fn(meta, deltas, usage.usage()))
    finally:
        if timer is not None:
            timer.cancel()
        service.release(mailbox)


def _best_of(deltas: dict, best_of: int, n: int, keep_logprobs: bool) -> dict:
    """Of each prompt's ``best_of`` sequences, the ``n`` the input processor's ``best_of_order`` keeps,
    re-indexed ``prompt_index * n + rank``."""
    chosen = {}
    for p_index in range(len(deltas) // best_of):
        group = [deltas[p_index * best_of + i] for i in range(best_of)]
        scores = [sum(lp.logprob or 0.0 for lp in d.logprobs or []) for d in group]
        for rank, delta in enumerate(group[i] for i in best_of_order(scores, n)):
            chosen[p_index * n + rank] = delta if keep_logprobs else msgspec.structs.replace(delta, logprobs=None)
    return chosen


async def _stream_completion(request, mailbox, meta: ResponseMeta, req: CompletionRequest):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    started: set[int] = _continued(req)
    templates: dict[int, responses.TextChunkTemplate] = {}
    with_ids = req.return_token_ids

    def make_chunks(index, delta):
        if with_ids:
            if not (delta.text or delta.token_ids or delta.logprobs or delta.finish_reason
                    or (meta.echo and index not in started)):
                return []
            choice = responses.completion_choice(index, delta, meta.echo, first=index not in started)
            started.add(index)
            return [_with_token_ids(responses.completion_chunk(meta, [choice], None, include_usage), delta)]
        if _text_only(delta) and (index in started or not meta.echo):
            template = templates.get(index)
            if template is None:
                template = templates[index] = responses.completion_text_template(meta, index, include_usage)
                started.add(index)
            return [template.encode(delta.text)]
        if not (delta.text or delta.logprobs or delta.finish_reason or (meta.echo and index not in started)):
            return []
        choice = responses.completion_choice(index, delta, meta.echo, first=index not in started)
        started.add(index)
        return [responses.completion_chunk(meta, [choice], None, include_usage)]

    def usage_chunk(usage):
        return responses.completion_chunk(meta, [], usage, True)

    return await stream(request, mailbox, make_chunks, usage_chunk if include_usage else None, meta.n)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    req = parse(await request.read(), ChatCompletionRequest)
    params = req.sampling_params()
    model, lora_name = await service.resolve_model(req.model)
    meta = ResponseMeta(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model, n=req.n or 1)
    reasoning = request_reasoning_parser(req, service.config) is not None
    images = await media.chat_images(req.messages, service.config)
    gen = _with_kv_transfer(service, req, convert.chat_generate_requests(req, meta.id, params, lora_name=lora_name,
                                                                         reasoning=reasoning, images=images))
    response_fn = responses.chat_response
    if output_reader(req, service.config) is not None:
        response_fn = partial(responses.chat_response, reader=lambda: output_reader(req, service.config))
    response_fn = await _kv_export_response(service, req, response_fn)
    mailbox = service.submit(gen, _resumed(req))
    return await _respond(request, mailbox, meta, req, _stream_chat, response_fn)


async def _stream_chat(request, mailbox, meta: ResponseMeta, req: ChatCompletionRequest):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    role_sent: set[int] = _continued(req)
    readers: dict[int, OutputReader | None] = {i: None for i in role_sent}
    templates: dict[int, responses.TextChunkTemplate] = {}
    with_ids = req.return_token_ids

    def make_chunks(index, delta):
        if index in role_sent and readers[index] is None and _text_only(delta) and not with_ids:
            template = templates.get(index)
            if template is None:
                template = templates[index] = responses.chat_text_template(meta, index, include_usage)
            return [template.encode(delta.text)]
        choices = []
        if index not in role_sent:  # OpenAI opens each choice with the role alone
            role_sent.add(index)
            choices.append(responses.chat_chunk_choice(index, None, role=True))
            readers[index] = output_reader(req, request.app[SERVICE].config)
        reader = readers[index]
        if reader is not None:
            choices.extend(_tool_chunk_choices(reader, index, delta))
        elif delta.text or delta.logprobs or delta.finish_reason or (with_ids and delta.token_ids):
            choice = responses.chat_chunk_choice(index, delta)
            if with_ids:
                choice["token_ids"] = list(delta.token_ids)
            choices.append(choice)
        return [responses.chat_chunk(meta, [c], None, include_usage) for c in choices]

    def usage_chunk(usage):
        return responses.chat_chunk(meta, [], usage, True)

    return await stream(request, mailbox, make_chunks, usage_chunk if include_usage else None, meta.n)


def _text_only(delta: messages.TextDelta) -> bool:
    """The delta is new text and nothing else: its chunk comes from a ``TextChunkTemplate``."""
    return bool(delta.text) and delta.logprobs is None and delta.finish_reason is None and delta.stop_reason is None


def _tool_chunk_choices(reader: OutputReader, index: int, delta) -> list[dict]:
    """With reasoning or tools on, a choice's text streams as reasoning, content or tool-call deltas."""
    choices = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None}
               for d in reader.stream_delta(delta.text, delta.finish_reason is not None)]
    if delta.finish_reason is not None:
        reason = reader.finish_reason(delta.finish_reason, reader.calls or ([1] if reader.named_id else []))
        choices.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason,
                        "stop_reason": delta.stop_reason})
    return choices


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``/tokenize``: a prompt, or a chat through the template (its images' placeholders
    counted, as the model's processor expands them); the ids, their count and the context length
    (``token_strs`` too when asked)."""
    service = request.app[SERVICE]
    body = await request.read()
    chat = _has_field(body, "messages")
    req = parse(body, TokenizeChatRequest if chat else TokenizeCompletionRequest)
    await service.resolve_model(req.model)  # an adapter shares the base model's tokenizer
    fields = {"prompt": req.prompt} if not chat else {
        "messages": [chat_message(m) for m in req.messages], "add_generation_prompt": req.add_generation_prompt,
        "tools": [msgspec.to_builtins(t) for t in req.tools] if req.tools else None}
    images = await media.chat_images(req.messages, service.config) if chat else []
    reply = _tokenizer_answer(await service.tokenize(messages.TokenizeRequest(
        req_id=f"tok-{uuid.uuid4().hex}", add_special_tokens=req.add_special_tokens,
        return_token_strs=req.return_token_strs, images=images, **fields)))
    return web.json_response({"count": len(reply.token_ids), "max_model_len": reply.max_model_len,
                              "tokens": reply.token_ids, "token_strs": reply.token_strs})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's ``/detokenize``: the text of token ids, special tokens included."""
    service = request.app[SERVICE]
    req = parse(await request.read(), DetokenizeBody)
    await service.resolve_model(req.model)  # an adapter shares the base model's tokenizer
    reply = _tokenizer_answer(await service.tokenize(messages.DetokenizeRequest(
        req_id=f"detok-{uuid.uuid4().hex}", token_ids=req.tokens)))
    return web.json_response({"prompt": reply.text})


def _has_field(body: bytes, name: str) -> bool:
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False  # parse() says what is wrong with it
    return isinstance(decoded, dict) and name in decoded


def _tokenizer_answer(reply: messages.TokenizeReply) -> messages.TokenizeReply:
    if reply.error is not None:
        type_ = "invalid_request_error" if reply.error_code < 500 else "server_error"
        raise ApiError(reply.error, reply.error_code, param=reply.error_param, type_=type_)
    return reply


async def models(request: web.Request) -> web.Response:
    """The base model, then each LoRA adapter with ``parent``: the base model's id (vLLM's shape)."""
    service = request.app[SERVICE]
    if service.config.enable_lora:
        await service.sync_adapters()  # as the executor holds them now (keeps the last list if it is slow)
    return web.json_response(responses.models_response(service.config.model_name, service.config.model,
                                                       service.started_at, service.adapters))


async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's ``POST /v1/load_lora_adapter`` {lora_name, lora_path} (``--allow-runtime-lora``): the
    executor reads and checks the adapter; a refusal is a 400 saying why, and nothing changes."""
    service = request.app[SERVICE]
    service._runtime_lora_allowed()
    req = parse(await request.read(), LoadLoRAAdapterRequest)
    if req.lora_name in (service.config.model_name, service.config.model):
        raise ApiError(f"'{req.lora_name}' is the base model's name", 400, param="lora_name")
    await service.load_lora(req.lora_name, req.lora_path)
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's ``POST /v1/unload_lora_adapter`` {lora_name}: 404 for an unknown adapter, 409 while
    requests on it are in flight (retry once they finish)."""
    service = request.app[SERVICE]
    service._runtime_lora_allowed()
    req = parse(await request.read(), UnloadLoRAAdapterRequest)
    await service.unload_lora(req.lora_name)
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def health(request: web.Request) -> web.Response:
    """200 while a request can be served; else 503 naming the services that do not answer."""
    service = request.app[SERVICE]
    report = service.health.report()
    if service.draining:
        report["status"] = "draining"
    return web.json_response(report, status=200 if report["status"] == "ok" else 503)


async def live(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    await service.refresh_engine_stats()
    return web.Response(body=service.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", health)
    app.router.add_get("/live", live)
    app.router.add_get("/metrics", metrics)
