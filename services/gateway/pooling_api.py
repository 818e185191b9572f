"""The pooling routes: OpenAI's ``/v1/embeddings``, the Cohere/Jina ``/v1/rerank`` (also ``/rerank``
and ``/v2/rerank``) and vLLM's ``/v1/score``, served with ``--task embed`` (or ``score``,
``rerank``: one pooling server) and refused with a 400 naming the flag otherwise; a pooling-only
server refuses the generation routes the same way (``task_middleware``).

Each input is one pooling request (``SamplingParams.pooling``) that runs through the same
tokenizer, scheduler and executor as generation: prefill only, chunked under the same token
budget, through the prefix cache, and it ends after its last prompt chunk with one vector
(little-endian float32). An embedding goes back as floats, or as the base64 of those bytes
(OpenAI's ``encoding_format: base64``, which the official client asks for by default). A rerank or
score pair is the reranker's prompt (``RerankFormat``: Qwen3-Reranker's unless configured) and its
score p(yes), the softmax of its [no, yes] logits at the last position.
"""

from __future__ import annotations

import array
import asyncio
import base64
import time
import uuid
from typing import Literal

import msgspec
from aiohttp import web

from folio.core.input_processor import RerankFormat, embed_params, generate_request
from folio.services.gateway.protocol import ApiError, parse
from folio.services.gateway.routes import SERVICE
from folio.services.gateway.streaming import collect
from folio.shared.config import POOLING_TASKS
from folio.shared.sampling import ParamError

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
POOLING_PATHS = ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score")


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """OpenAI's body: ``input`` a string, strings, token ids or lists of token ids."""

    input: object
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class RerankRequest(msgspec.Struct, kw_only=True):
    """Cohere's and Jina's body: documents as strings or ``{"text": ...}`` objects."""

    query: str
    documents: list[str | dict]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True


class ScoreRequest(msgspec.Struct, kw_only=True):
    """vLLM's body: one ``text_1`` against each ``text_2``, or two lists of the same length, pairwise."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None


def tasks_of(config) -> set[str]:
    return set(getattr(config, "task", "generate").split(","))


def task_middleware(config):
    """A route of the other kind of server is a 400 that says which ``--task`` serves it."""
    tasks = tasks_of(config)
    pooling = bool(tasks & set(POOLING_TASKS))

    @web.middleware
    async def check(request: web.Request, handler):
        path = request.path.rstrip("/")
        if path in GENERATION_PATHS and "generate" not in tasks:
            raise ApiError(f"{path} generates text; this server pools (--task {config.task}). Start one with "
                           "--task generate (or generate,embed) for it", param="model")
        if path in POOLING_PATHS and not pooling:
            raise ApiError(f"{path} is served by a pooling server (--task embed, or generate,embed for both); "
                           f"this one runs --task {config.task}", param="model")
        return await handler(request)

    return check


def embedding_inputs(raw: object, max_inputs: int) -> list[dict]:
    """The prompts of ``input``: one per string or list of token ids; a 400 for an empty or
    malformed one, or more than ``max_inputs``."""
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(_is_id(t) for t in raw)):
        items = [raw]
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise ApiError("input must be a non-empty string, list of strings, list of token ids or list of lists "
                       "of token ids", param="input")
    if len(items) > max_inputs:
        raise ApiError(f"{len(items)} inputs in one request; this server takes at most {max_inputs} "
                       "(--max-pooling-inputs)", param="input")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str) and item:
            out.append({"prompt": item})
        elif isinstance(item, list) and item and all(_is_id(t) for t in item):
            out.append({"prompt_token_ids": list(item)})
        else:
            raise ApiError(f"input {i} is empty or not a string or a list of token ids", param="input")
    return out


def _is_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


async def pooled(request: web.Request, prompts: list[dict], params, prefix: str) -> list:
    """Run one pooling request per prompt; each one's ``TextDelta`` (``pooled`` set), in order."""
    service = request.app[SERVICE]
    req_id = f"{prefix}-{uuid.uuid4().hex}"
    gen = [generate_request(params, req_id, i, **fields) for i, fields in enumerate(prompts)]
    mailbox = service.submit(gen)
    timeout_s = service.config.request_timeout_s
    loop = asyncio.get_running_loop()
    timer = loop.call_later(timeout_s, service.fail, mailbox, f"the request did not finish within --request-timeout "
                            f"{timeout_s:g}s", 504) if timeout_s > 0 else None
    try:
        deltas = await collect(mailbox)
    finally:
        if timer is not None:
            timer.cancel()
        service.release(mailbox)
    out = [deltas[i] for i in range(len(prompts))]
    if any(d.pooled is None for d in out):
        raise ApiError("the engine returned no vector for an input", 500, type_="server_error")
    return out


def floats(data: bytes) -> list[float]:
    values = array.array("f")
    values.frombytes(data)  # the wire's little-endian float32 (every host folio runs on is little-endian)
    return values.tolist()


async def embeddings(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    req = parse(await request.read(), EmbeddingRequest)
    model, _ = await service.resolve_model(req.model)
    prompts = embedding_inputs(req.input, service.config.max_pooling_inputs)
    try:
        params = embed_params(req.dimensions)
    except ParamError as exc:
        raise ApiError(str(exc), param=exc.param) from None
    deltas = await pooled(request, prompts, params, "embd")
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(d.pooled).decode() if req.encoding_format == "base64" else floats(d.pooled)}
            for i, d in enumerate(deltas)]
    num_tokens = sum(d.num_prompt_tokens for d in deltas)
    return web.json_response({"object": "list", "data": data, "model": model,
                              "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def rerank_format(config) -> RerankFormat:
    fmt = RerankFormat(yes_token=config.rerank_yes_token, no_token=config.rerank_no_token)
    if config.rerank_template:
        fmt = RerankFormat(config.rerank_template, fmt.instruction, fmt.yes_token, fmt.no_token)
    if config.rerank_instruction:
        fmt = RerankFormat(fmt.template, config.rerank_instruction, fmt.yes_token, fmt.no_token)
    return fmt


async def _scores(request: web.Request, pairs: list[tuple[str, str]], param: str) -> tuple[list[float], int]:
    """p(yes) of each (query, document) pair, and the prompt tokens they took."""
    config = request.app[SERVICE].config
    if not pairs:
        raise ApiError(f"{param} must not be empty", param=param)
    if len(pairs) > config.max_pooling_inputs:
        raise ApiError(f"{len(pairs)} pairs in one request; this server takes at most {config.max_pooling_inputs} "
                       "(--max-pooling-inputs)", param=param)
    fmt = rerank_format(config)
    prompts = [{"prompt": fmt.prompt(q, d), "add_special_tokens": False} for q, d in pairs]
    deltas = await pooled(request, prompts, fmt.params(), "score")
    return [fmt.score(floats(d.pooled)) for d in deltas], sum(d.num_prompt_tokens for d in deltas)


async def rerank(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    req = parse(await request.read(), RerankRequest)
    model, _ = await service.resolve_model(req.model)
    texts = []
    for i, doc in enumerate(req.documents):
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise ApiError(f"document {i} is neither a string nor an object with a 'text' string", param="documents")
        texts.append(text)
    if req.top_n is not None and req.top_n < 1:
        raise ApiError("top_n must be at least 1", param="top_n")
    scores, num_tokens = await _scores(request, [(req.query, t) for t in texts], "documents")
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[: req.top_n or len(texts)]
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": texts[i]}}
                                                            if req.return_documents else {})} for i in order]
    return web.json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                              "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


async def score(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    req = parse(await request.read(), ScoreRequest)
    model, _ = await service.resolve_model(req.model)
    left = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    right = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise ApiError(f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1, or as many as "
                       "text_2", param="text_1")
    scores, num_tokens = await _scores(request, list(zip(left, right)), "text_2")
    return web.json_response({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": model,
                              "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                              "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.router.add_post(path, rerank)
    app.router.add_post("/v1/score", score)
