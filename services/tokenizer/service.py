"""The tokenizer service: text in, token ids to the scheduler; token ids back, text to the gateway.

More in docs/modules.md (services/tokenizer/service.py).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable

import structlog
import zmq
import zmq.asyncio

from folio.core.structured.grammar import GrammarChecker, GrammarError
from folio.core.tokenizer.output_processor import OutputProcessor, TokenTexts
from folio.core.tokenizer.text import RequestError, TextTokenizer
from folio.shared.config import TokenizerConfig
from folio.services.shell import serve_admin, serve_pull
from folio.shared.transport import close_sockets
from folio.shared.messages import (
    AbortRequest,
    DetokenizeRequest,
    EngineRequest,
    GenerateRequest,
    Grammar,
    TextBatch,
    TextDelta,
    TokenBatch,
    TokenizeReply,
    TokenizeRequest,
)
from folio.shared.tracing import now_ns, setup as tracing_setup
from folio.shared.transport import Decoder, encode, make_socket

log = structlog.get_logger()  # lazy: takes the config setup_logging makes in main
NUM_REMEMBERED_ENDED = 4096  # req_ids recently aborted here, whose late tokens need no new abort
# what a GenerateRequest hands on to its EngineRequest as it is
PASSED_ON = ("priority", "arrival_time", "cache_salt", "fork_req_ids", "lora_name", "forced_token_ids", "kv_transfer",
             "traceparent")


class TokenizerService:
    def __init__(self, config: TokenizerConfig, tokenizer: TextTokenizer, ctx: zmq.asyncio.Context | None = None,
                 after_warm: Callable[[], None] | None = None):
        """``after_warm``: called (in the grammar worker) once xgrammar is imported."""
        self.config = config
        self.after_warm = after_warm
        self.tokenizer = tokenizer
        texts = TokenTexts(tokenizer.decode_with_specials, tokenizer.raw_bytes)
        self.outputs = OutputProcessor(tokenizer.decode, texts)
        self.ctx = ctx or zmq.asyncio.Context.instance()
        ep = config.endpoints
        self.recv_from_pipeline = make_socket(self.ctx, zmq.PULL, ep.tokenizer_in)
        self.send_to_scheduler = make_socket(self.ctx, zmq.PUSH, ep.scheduler_in, service="scheduler")
        self.send_to_gateway = make_socket(self.ctx, zmq.PUSH, ep.gateway_in, service="gateway")
        self.recv_from_admin = make_socket(self.ctx, zmq.ROUTER, ep.admin_tokenizer)
        self.decoder = Decoder(GenerateRequest, AbortRequest, TokenBatch, TokenizeRequest, DetokenizeRequest)
        self.handlers = {
            GenerateRequest: self.handle_generate,
            AbortRequest: self.handle_abort,
            TokenBatch: self.handle_token_batch,
            TokenizeRequest: self.handle_tokenize,
            DetokenizeRequest: self.handle_tokenize,
        }
        self.stats = {"num_generate": 0, "num_tokenize": 0, "num_aborts": 0, "num_token_batches": 0, "num_malformed": 0,
                      "num_rejected": 0, "num_stray_aborts": 0}
        self.grammars = GrammarChecker()
        self.compiling: dict[str, GenerateRequest] = {}  # req_id -> a request waiting for its grammar
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.tracing = tracing_setup(config.otlp_traces_endpoint, "tokenizer")  # None: off
        self.traces: dict[str, list] = {}  # traced choice id -> [traceparent, first output ns, tokens]

    async def run(self) -> None:
        """Serve until cancelled (SIGTERM/SIGINT cancel it from ``main``)."""
        admin = asyncio.ensure_future(serve_admin(self.recv_from_admin, {"stats": self.admin_stats}, log))
        warm = self.grammars.warm()
        if self.after_warm is not None:
            warm.add_done_callback(lambda _: self.after_warm())
        log.info("tokenizer ready", max_model_len=self.tokenizer.max_model_len,
                 inbox=self.config.endpoints.tokenizer_in)
        try:
            await serve_pull(self.recv_from_pipeline, self.decoder, self.handlers, log, "pipeline",
                             on_malformed=self._count_malformed, on_error=self._on_handler_error)
        finally:
            admin.cancel()

    def close(self) -> None:
        self.grammars.close()
        close_sockets(self.recv_from_pipeline, self.send_to_scheduler, self.send_to_gateway, self.recv_from_admin)

    def _count_malformed(self) -> None:
        self.stats["num_malformed"] += 1

    def _on_handler_error(self, message) -> None:
        """A request whose handling failed still gets an answer: an error for each of its choices."""
        if isinstance(message, GenerateRequest):
            for choice_id in (message.req_id, *message.fork_req_ids):
                self._reply_error(choice_id, "internal error while tokenizing", 500)
        elif isinstance(message, (TokenizeRequest, DetokenizeRequest)):
            self.send_to_gateway.send(encode(TokenizeReply(req_id=message.req_id,
                                                           error="internal error while tokenizing", error_code=500)))

    def handle_generate(self, req: GenerateRequest) -> None:
        self.stats["num_generate"] += 1
        t0 = now_ns() if self.tracing is not None and req.traceparent else 0
        try:
            prompt_token_ids, prompt_text, images = self.tokenizer.prepare_prompt(req)
        except RequestError as exc:
            if t0:
                self.tracing.record("tokenizer.encode", req.traceparent, t0, now_ns(), {"error.type": "rejected"})
            self._reject(req, str(exc), exc.param)
            return
        if t0:
            self.tracing.record("tokenizer.encode", req.traceparent, t0, now_ns(),
                                {"gen_ai.usage.input_tokens": len(prompt_token_ids), "folio.lora_name": req.lora_name})
            for choice_id in (req.req_id, *req.fork_req_ids):
                self.traces[choice_id] = [req.traceparent, 0, 0]
        if req.guided is None:
            self._send(req, prompt_token_ids, prompt_text, None, images)
            return
        grammar = self.grammars.lookup(req.guided)
        if grammar is not None:
            self._send(req, prompt_token_ids, prompt_text, grammar, images)
            return
        # a new spec: checked in a worker thread while the loop serves everybody else
        self.compiling[req.req_id] = req
        future = self.grammars.submit(req.guided)
        loop = asyncio.get_running_loop()
        future.add_done_callback(lambda f: loop.call_soon_threadsafe(
            self._grammar_done, req, prompt_token_ids, prompt_text, f, images))

    def _grammar_done(self, req: GenerateRequest, prompt_token_ids, prompt_text, future, images=()) -> None:
        if self.compiling.pop(req.req_id, None) is None:
            return  # aborted while it was checked
        exc = future.exception()
        if exc is not None:
            param = exc.param if isinstance(exc, GrammarError) else req.guided.param
            self._reject(req, str(exc) if isinstance(exc, GrammarError) else f"cannot compile: {exc}", param)
            return
        self._send(req, prompt_token_ids, prompt_text, future.result(), images)

    def _reject(self, req: GenerateRequest, message: str, param: str | None) -> None:
        self.stats["num_rejected"] += 1
        log.info("request rejected", req_id=req.req_id, reason=message)
        for choice_id in (req.req_id, *req.fork_req_ids):
            self._reply_error(choice_id, message, 400, param)

    def _send(self, req: GenerateRequest, prompt_token_ids: list[int], prompt_text, grammar: Grammar | None,
              images=()) -> None:
        """The request on to the scheduler, its sampling params as the gateway built them."""
        self.outputs.add_choices(req, prompt_token_ids, self.tokenizer.eos_token_id, prompt_text)
        engine_req = EngineRequest(req_id=req.req_id, prompt_token_ids=prompt_token_ids,
                                   sampling=self.tokenizer.engine_sampling(req.sampling),
                                   grammar=grammar, eos_token_id=self.tokenizer.eos_token_id, images=list(images),
                                   **{name: getattr(req, name) for name in PASSED_ON})
        self.send_to_scheduler.send(encode(engine_req))
        log.debug("request tokenized", req_id=req.req_id, num_prompt_tokens=len(prompt_token_ids))

    def handle_tokenize(self, req: TokenizeRequest | DetokenizeRequest) -> None:
        """``/tokenize`` and ``/detokenize``: answered at once, on the gateway's pipeline."""
        self.stats["num_tokenize"] += 1
        try:
            reply = (self.tokenizer.tokenize(req) if isinstance(req, TokenizeRequest)
                     else self.tokenizer.detokenize(req))
        except RequestError as exc:
            reply = TokenizeReply(req_id=req.req_id, error=str(exc), error_param=exc.param)
        self.send_to_gateway.send(encode(reply))

    def handle_abort(self, abort: AbortRequest) -> None:
        """The gateway's client went away: forget the request, tell the scheduler to free it."""
        self.stats["num_aborts"] += 1
        self.compiling.pop(abort.req_id, None)
        self._ended(abort.req_id)
        self.traces.pop(abort.req_id, None)
        self.outputs.remove(abort.req_id)
        self.send_to_scheduler.send(encode(abort))
        log.info("request aborted", req_id=abort.req_id, reason=abort.reason)

    def handle_token_batch(self, batch: TokenBatch) -> None:
        self.stats["num_token_batches"] += 1
        t0 = now_ns() if self.traces else 0
        deltas, aborts, unknown = self.outputs.process(batch)
        if t0:
            self._trace_detokenize(deltas, t0)
        for abort in aborts:
            log.debug("stop string hit", req_id=abort.req_id)
            self._ended(abort.req_id)
            self.send_to_scheduler.send(encode(abort))
        for req_id in unknown:
            if req_id in self.ended:
                continue  # its abort is on its way: a step was already under way
            # from before this tokenizer restarted: nobody waits for it; stop it using the engine
            self._ended(req_id)
            self.stats["num_stray_aborts"] += 1
            log.info("tokens of an unknown request: aborting it", req_id=req_id)
            self.send_to_scheduler.send(encode(AbortRequest(req_id=req_id)))
        if deltas:
            self.send_to_gateway.send(encode(TextBatch(deltas=deltas)))

    def _trace_detokenize(self, deltas: list[TextDelta], t0: int) -> None:
        """Traced choices: ``tokenizer.detokenize`` spans from the first batch with their tokens to
        the one that finished them."""
        traces = self.traces
        for delta in deltas:
            trace = traces.get(delta.req_id)
            if trace is None:
                continue
            if not trace[1]:
                trace[1] = t0
            trace[2] += len(delta.token_ids)
            if delta.finish_reason is not None:
                del traces[delta.req_id]
                self.tracing.record("tokenizer.detokenize", trace[0], trace[1], now_ns(),
                                    {"gen_ai.usage.output_tokens": trace[2], "folio.choice_id": delta.req_id,
                                     "folio.finish_reason": delta.finish_reason})

    def _ended(self, req_id: str) -> None:
        self.ended[req_id] = None
        if len(self.ended) > NUM_REMEMBERED_ENDED:
            self.ended.popitem(last=False)

    def admin_stats(self, args: dict) -> dict:
        return {**self.stats, **self.grammars.stats, "num_requests": len(self.outputs.requests),
                "max_model_len": self.tokenizer.max_model_len}

    def _reply_error(self, req_id: str, message: str, code: int, param: str | None = None) -> None:
        delta = TextDelta(req_id=req_id, finish_reason="error", error=message, error_code=code, error_param=param)
        self.send_to_gateway.send(encode(TextBatch(deltas=[delta])))

