"""The gateway's side of the sockets: requests out to the tokenizer, text back into mailboxes.

More in docs/modules.md (services/gateway/service.py).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import OrderedDict

import msgspec
import structlog
import zmq
import zmq.asyncio

from folio.services.gateway.health import HealthMonitor
from folio.services.gateway.mailbox import OutputMailbox
from folio.services.gateway.metrics import GatewayMetrics
from folio.services.gateway.protocol import ApiError
from folio.services.gateway.request_spans import current as request_trace
from folio.shared.config import GatewayConfig
from folio.services.shell import serve_admin, serve_pull
from folio.shared.transport import ask_admin, close_sockets
from folio.shared.messages import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    TextBatch,
    TextDelta,
    TokenizeReply,
    TokenizeRequest,
)
from folio.shared.tracing import setup as tracing_setup
from folio.shared.transport import Decoder, encode, make_socket

log = structlog.get_logger()  # lazy: takes the config setup_logging makes in main
NUM_REMEMBERED_STRAYS = 4096  # req_ids of stray deltas already aborted (bounded)
LORA_SYNC_S = 2.0  # how often the adapter names are read again from the executor (it may have restarted)
LORA_ADMIN_TIMEOUT_S = 2.0
LORA_LOAD_TIMEOUT_S = 120.0  # reading an adapter's folder and checking it
REPLAY_HOLD_S = 30.0  # a probed replay (of a request without output) gets this long to deliver


class GatewayService:
    def __init__(self, config: GatewayConfig, ctx: zmq.asyncio.Context | None = None):
        self.config = config
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.metrics = GatewayMetrics(config.model_name)
        self.mailboxes: dict[str, OutputMailbox] = {}  # engine req_id -> its HTTP request's mailbox
        # replayed choices run under a new engine id: engine id <-> the choice id the client knows
        self.aliases: dict[str, str] = {}
        self.engine_ids: dict[str, str] = {}
        # replays of requests without output yet, sent one at a time (``_probe_next``)
        self._suspects: list[tuple[OutputMailbox, list[GenerateRequest]]] = []
        self._probing: OutputMailbox | None = None
        self._probing_tokens = 0
        self._replay_cause = ""
        self.decoder = Decoder(TextBatch, TokenizeReply)
        self.handlers = {TextBatch: self.handle_text_batch, TokenizeReply: self.handle_tokenize_reply}
        self.tokenizing: dict[str, asyncio.Future] = {}  # req_id -> its /tokenize or /detokenize reply
        self.stats = {"num_requests": 0, "num_aborts": 0, "num_malformed": 0, "num_refused_busy": 0,
                      "num_refused_unavailable": 0, "num_failed": 0, "num_stray_aborts": 0, "num_replays": 0,
                      "num_replays_exhausted": 0, "num_resumed": 0}
        self.started_at = int(time.time())
        self._tasks: list[asyncio.Task] = []
        self.send_to_tokenizer = self.recv_from_tokenizer = self.recv_from_admin = None
        ep = config.endpoints
        self.health = HealthMonitor({name: getattr(ep, f"admin_{name}") for name in config.probed_services},
                                    self.ask_admin, self.on_lost)
        self.queued: set[OutputMailbox] = set()  # accepted, no output yet
        self.num_open = 0  # generation requests between submit and their response's end
        self.draining = False
        self._strays: OrderedDict[str, None] = OrderedDict()
        self.adapters: dict[str, str] = {}  # LoRA adapter name -> its folder, as the executor holds them
        self.lora_open: dict[str, int] = {}  # adapter -> requests open here (submitted, response not over)
        self._lora_change = asyncio.Lock()  # one load, unload or sync at a time
        self.tracing = tracing_setup(config.otlp_traces_endpoint, "gateway")  # None: off

    async def start(self) -> None:
        ep = self.config.endpoints
        self.send_to_tokenizer = make_socket(self.ctx, zmq.PUSH, ep.tokenizer_in, service="tokenizer")
        self.recv_from_tokenizer = make_socket(self.ctx, zmq.PULL, ep.gateway_in)
        self.recv_from_admin = make_socket(self.ctx, zmq.ROUTER, ep.admin_gateway)
        await self.health.probe_all()
        self._tasks = [
            asyncio.ensure_future(self._receive()),
            asyncio.ensure_future(serve_admin(self.recv_from_admin, {"stats": self.admin_stats}, log)),
            asyncio.ensure_future(self.health.run()),
        ]
        if self.config.enable_lora:
            self._tasks.append(asyncio.ensure_future(self._keep_adapters_synced()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for req_id in list(self.mailboxes):  # whatever still runs has nobody left to read it
            self.abort(self.aliases.get(req_id, req_id))
        close_sockets(self.send_to_tokenizer, self.recv_from_tokenizer, self.recv_from_admin)

    async def _receive(self) -> None:
        await serve_pull(self.recv_from_tokenizer, self.decoder, self.handlers, log, "tokenizer",
                         on_malformed=self._count_malformed)

    def _count_malformed(self) -> None:
        self.stats["num_malformed"] += 1

    def handle_text_batch(self, batch: TextBatch) -> None:
        now = time.monotonic()
        self.health.heard_from("tokenizer", now)
        mailboxes, queued, on_delta = self.mailboxes, self.queued, self.metrics.on_delta
        num_tokens = 0
        aliases = self.aliases
        for delta in batch.deltas:
            engine_id = delta.req_id
            mailbox = mailboxes.get(engine_id)
            if mailbox is None:
                self._abort_stray(delta)
                continue
            if aliases and engine_id in aliases:  # a replayed choice: the client knows its own id
                delta = msgspec.structs.replace(delta, req_id=aliases[engine_id])
                if delta.finish_reason is not None:
                    del aliases[engine_id]
                    self.engine_ids.pop(delta.req_id, None)
            queued.discard(mailbox)
            mailbox.put(delta)
            on_delta(mailbox.timing[delta.req_id], delta, now)
            num_tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                del mailboxes[engine_id]
        self.metrics.on_batch(num_tokens)
        if self._suspects and num_tokens:  # output again: is it the probed suspect's?
            self._check_probe()

    async def tokenize(self, request: TokenizeRequest | DetokenizeRequest) -> TokenizeReply:
        """Ask the tokenizer (``/tokenize``, ``/detokenize``); 503 while it is down or lost, 504
        past ``--request-timeout``."""
        if self.draining or "tokenizer" in self.health.down():
            raise ApiError("unavailable: tokenizer not answering; retry later", 503, type_="server_error",
                           code="service_unavailable")
        future = self.tokenizing[request.req_id] = asyncio.get_running_loop().create_future()
        try:
            self.send_to_tokenizer.send(encode(request))
            timeout_s = self.config.request_timeout_s or None
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise ApiError(f"the tokenizer did not answer within --request-timeout {timeout_s:g}s", 504,
                           type_="server_error") from None
        finally:
            self.tokenizing.pop(request.req_id, None)

    def handle_tokenize_reply(self, reply: TokenizeReply) -> None:
        self.health.heard_from("tokenizer", time.monotonic())
        future = self.tokenizing.get(reply.req_id)
        if future is not None and not future.done():
            future.set_result(reply)

    def _abort_stray(self, delta: TextDelta) -> None:
        """Output for a request nobody here waits for: its client left (the abort is on its way),
        or it was sent before this gateway restarted. Abort it once, so that it stops using the
        engine instead of running to max_tokens."""
        if delta.finish_reason is not None or delta.req_id in self._strays:
            return
        self._strays[delta.req_id] = None
        if len(self._strays) > NUM_REMEMBERED_STRAYS:
            self._strays.popitem(last=False)
        self.stats["num_stray_aborts"] += 1
        self.send_to_tokenizer.send(encode(AbortRequest(req_id=delta.req_id)))

    def admit(self) -> None:
        """Refuse a new request up front (ApiError) when it could not be served now."""
        config = self.config
        down = self.health.down()
        if self.draining or down:
            self.stats["num_refused_unavailable"] += 1
            why = "the server is shutting down" if self.draining else f"unavailable: {', '.join(down)} not answering"
            raise ApiError(f"{why}; retry later", 503, type_="server_error", code="service_unavailable")
        if len(self.queued) >= config.max_queue_len or self.num_open >= config.max_concurrent_requests:
            self.stats["num_refused_busy"] += 1
            limit = ("--max-queue-len", config.max_queue_len) if len(self.queued) >= config.max_queue_len else \
                ("--max-concurrent-requests", config.max_concurrent_requests)
            raise ApiError(f"the server is busy ({limit[0]} {limit[1]} reached); retry later", 429,
                           type_="server_error", code="too_many_requests")

    def submit(self, reqs: list[GenerateRequest],
               resumed: dict[int, tuple[list[int], bool]] | None = None) -> OutputMailbox:
        """Send the requests; the mailbox holds every choice, forked ones (``fork_req_ids``) included.
        ``resumed`` (a stream another replica began, ``continue_choices``): choice index -> (the
        token ids its client has, finished); those choices go on after their tokens, or not at all."""
        self.admit()
        choice_ids = [choice_id for r in reqs for choice_id in (r.req_id, *r.fork_req_ids)]
        mailbox = OutputMailbox(choice_ids)
        if self.tracing is not None and (trace := request_trace()) is not None:  # the later stages' parent
            trace.mailbox = mailbox
            reqs = [msgspec.structs.replace(r, traceparent=trace.traceparent) for r in reqs]
        mailbox.reqs = reqs
        self.queued.add(mailbox)
        self.num_open += 1
        mailbox.lora_name = reqs[0].lora_name
        if mailbox.lora_name is not None:
            self.lora_open[mailbox.lora_name] = self.lora_open.get(mailbox.lora_name, 0) + 1
        if resumed:
            for index, (token_ids, finished) in resumed.items():
                if index < len(choice_ids):
                    mailbox.token_ids[choice_ids[index]] = list(token_ids)
                    if finished:
                        mailbox.unfinished.discard(choice_ids[index])
            reqs = self._continuations(mailbox, lambda c: c, "a beam search cannot be resumed part way")
            self.stats["num_resumed"] += 1
        for choice_id in choice_ids:
            if choice_id in mailbox.unfinished:
                self.mailboxes[choice_id] = mailbox
        for req in reqs:
            self.send_to_tokenizer.send(encode(req))
        self.stats["num_requests"] += 1
        log.info("request received", req_id=choice_ids[0].rpartition("-")[0], num_choices=len(choice_ids),
                 stream=mailbox.reqs[0].stream)
        return mailbox

    def abort(self, req_id: str) -> None:
        """Forget a choice and have the tokenizer and scheduler drop it (its blocks are freed)."""
        engine_id = self.engine_ids.pop(req_id, None)
        if engine_id is None:
            engine_id = req_id
        else:
            self.aliases.pop(engine_id, None)
        if self.mailboxes.pop(engine_id, None) is None:
            return
        req_id = engine_id
        self.stats["num_aborts"] += 1
        self.send_to_tokenizer.send(encode(AbortRequest(req_id=req_id)))
        log.info("request aborted", req_id=req_id)

    def release(self, mailbox: OutputMailbox) -> None:
        """The response is over: abort what did not finish, forget the mailbox."""
        self.queued.discard(mailbox)
        self.num_open -= 1
        if mailbox.lora_name is not None:
            left = self.lora_open[mailbox.lora_name] - 1
            if left:
                self.lora_open[mailbox.lora_name] = left
            else:
                del self.lora_open[mailbox.lora_name]
        for req_id in list(mailbox.unfinished):
            self.abort(req_id)

    def fail(self, mailbox: OutputMailbox, message: str, code: int) -> None:
        """End every unfinished choice of ``mailbox`` with an error (and abort it, which frees its
        blocks): a plain HTTP error before a stream began, an error event after."""
        self.queued.discard(mailbox)
        unfinished = list(mailbox.unfinished)
        if unfinished:
            self.stats["num_failed"] += 1
            log.warning("request failed", req_ids=unfinished, reason=message)
        for req_id in unfinished:
            self.abort(req_id)
            mailbox.put(TextDelta(req_id=req_id, finish_reason="error", error=message, error_code=code))

    def fail_all(self, message: str, code: int) -> int:
        mailboxes = set(self.mailboxes.values())
        for mailbox in mailboxes:
            self.fail(mailbox, message, code)
        return len(mailboxes)

    def on_lost(self, name: str, why: str) -> None:
        """The tokenizer or scheduler restarted (every request in flight lost its state there: each
        is replayed), or has been silent for a while (its requests wait for it)."""
        if name == "tokenizer":
            for future in self.tokenizing.values():
                if not future.done():
                    future.set_exception(ApiError(f"the tokenizer {why}; retry the request", 503,
                                                  type_="server_error", code="service_unavailable"))
        if why != "restarted":
            log.warning("service silent: its requests wait for it, or for its restart", service=name, why=why,
                        num_requests=len(set(self.mailboxes.values())))
            return
        mailboxes = set(self.mailboxes.values())
        cause = f"the {name} {why}"
        # suspects (no output yet: one of them may be what crashed it) keep their turn in line; the
        # one probed when it crashed goes to the back
        order = {id(mb): i for i, (mb, _) in enumerate(self._suspects) if mb is not self._probing}
        # a crash while a suspect was probed is blamed on it alone (its replay counted when sent):
        # a request beside it that had no time to deliver since its own replay is not charged
        blamed = self._probing is not None and self._probing in mailboxes
        self._suspects, self._probing = [], None
        now = []
        for mailbox in sorted(mailboxes, key=lambda mb: order.get(id(mb), len(order))):
            if any(mailbox.token_ids.values()):  # delivered something: proven to run
                now += self.replay(mailbox, cause, counted=not blamed)
            elif mailbox.unfinished:
                self._suspects.append((mailbox, self.replay(mailbox, cause, counted=False)))
        self._send_replays(now)
        self._replay_cause = cause
        if not now:
            self._probe_next()
        elif self._suspects:  # should the others deliver nothing either, the suspects go all the same
            asyncio.get_running_loop().call_later(REPLAY_HOLD_S, self._probe_timeout, None)
        log.error("service restarted: the requests in flight are replayed", service=name,
                  num_requests=len(mailboxes), num_sent=len(now), num_held=len(self._suspects))

    def replay(self, mailbox: OutputMailbox, cause: str, counted: bool = True) -> list[GenerateRequest]:
        """``mailbox``'s unfinished choices as continuations of what they delivered (see the
        module's docstring), to send; after ``--max-replays`` replays in a row with no token
        delivered in between, they end with an error instead. ``counted`` False: a suspect's
        replay, counted when it is sent (``_probe_next``)."""
        todo = mailbox.unfinished
        if not todo:
            return []
        delivered = sum(len(t) for t in mailbox.token_ids.values())
        if delivered > mailbox.num_delivered_at_replay:  # it moved since its last replay: not the culprit
            mailbox.num_replays = 0
        mailbox.num_delivered_at_replay = delivered
        if counted and not self._count_replay(mailbox, cause):
            return []
        self.stats["num_replays"] += 1
        mailbox.num_replays_total += 1
        sends = self._continuations(mailbox, lambda c: self._reroute(c, mailbox), f"{cause}; the request was lost, "
                                    "retry it")
        log.info("request replayed", req_ids=[r.req_id for r in sends], replay=mailbox.num_replays)
        return sends

    def _continuations(self, mailbox: OutputMailbox, new_id, lost: str) -> list[GenerateRequest]:
        """The requests that continue ``mailbox``'s unfinished choices after the tokens each
        delivered (``mailbox.token_ids``), each under ``new_id(choice id)``: a request none of
        whose choices delivered anything goes again whole (its choices forked from it); otherwise
        each choice alone, with its seed offset. A beam search some of whose beams came out cannot
        go on: its other choices end with ``lost``."""
        todo, got, sends = mailbox.unfinished, mailbox.token_ids, []
        for req in mailbox.reqs:
            choices = [req.req_id, *req.fork_req_ids]
            if not any(c in todo for c in choices):
                continue
            if all(c in todo and not got[c] for c in choices):  # nothing out yet: the request again, whole
                new_ids = [new_id(c) for c in choices]
                sends.append(msgspec.structs.replace(req, req_id=new_ids[0], fork_req_ids=new_ids[1:]))
                continue
            if req.sampling.use_beam_search:  # its beams come out together: some did, some not
                for c in choices:
                    if c in todo:
                        self.abort(c)
                        mailbox.put(TextDelta(req_id=c, finish_reason="error", error_code=503, error=lost))
                continue
            for offset, c in enumerate(choices):
                if c not in todo:
                    continue
                sampling = req.sampling.with_seed_offset(offset)
                if got[c]:  # its prompt logprobs went out with its first tokens
                    sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
                sends.append(msgspec.structs.replace(req, req_id=new_id(c), fork_req_ids=[],
                                                     sampling=sampling, forced_token_ids=list(got[c])))
        return sends

    def _count_replay(self, mailbox: OutputMailbox, cause: str) -> bool:
        """One more replay in a row; past ``--max-replays`` the request fails (False)."""
        mailbox.num_replays += 1
        limit = self.config.max_replays
        if mailbox.num_replays <= limit:
            return True
        self.stats["num_replays_exhausted"] += 1
        self.fail(mailbox, f"{cause}; the request was lost, retry it" + (
            f" (replayed {limit} times in a row without progress)" if limit else ""), 503)
        return False

    def _send_replays(self, reqs: list[GenerateRequest]) -> None:
        for req in reqs:
            if req.req_id in self.mailboxes:  # not aborted, nor replayed again, meanwhile
                self.send_to_tokenizer.send(encode(req))

    def _probe_next(self) -> None:
        """Send the next suspect's replay, alone: the next goes once it delivered tokens (it is not
        what crashes the service), or ended, or after ``REPLAY_HOLD_S``."""
        self._probing = None
        while self._suspects:
            mailbox, sends = self._suspects.pop(0)
            if not mailbox.unfinished or not any(r.req_id in self.mailboxes for r in sends):
                continue  # ended or aborted meanwhile
            if not self._count_replay(mailbox, self._replay_cause):
                continue
            self._probing, self._probing_tokens = mailbox, sum(len(t) for t in mailbox.token_ids.values())
            self._send_replays(sends)
            asyncio.get_running_loop().call_later(REPLAY_HOLD_S, self._probe_timeout, mailbox)
            return

    def _probe_timeout(self, mailbox: OutputMailbox) -> None:
        if self._probing is mailbox:
            self._probe_next()

    def _check_probe(self) -> None:
        """After output arrived: the probed suspect delivered (or ended): the next one goes."""
        mailbox = self._probing
        if mailbox is None or not mailbox.unfinished or (
                sum(len(t) for t in mailbox.token_ids.values()) > self._probing_tokens):
            self._probe_next()

    def _reroute(self, choice_id: str, mailbox: OutputMailbox) -> str:
        """Abort the choice's current engine id; the new one it runs under from now on."""
        old = self.engine_ids.get(choice_id, choice_id)
        self.aliases.pop(old, None)
        if self.mailboxes.pop(old, None) is not None:
            self.send_to_tokenizer.send(encode(AbortRequest(req_id=old)))
        new = f"{choice_id}.r{mailbox.num_replays_total}"
        self.mailboxes[new] = mailbox
        self.aliases[new] = choice_id
        self.engine_ids[choice_id] = new
        return new

    # ------------------------------------------------------------------ LoRA adapters
    async def resolve_model(self, model: str | None) -> tuple[str, str | None]:
        """A request's ``model``: (the name responses carry, its LoRA adapter or None for the base
        model); 404 ``model_not_found`` for a model served nowhere here."""
        config = self.config
        name = config.model_name
        # without --served-model-name the --model value itself is an alias (vLLM's default name)
        aliases = (name,) if config.served_model_name else (name, config.model)
        if model is None or model in aliases:
            return name, None
        if config.enable_lora and (model in self.adapters or (await self.sync_adapters() and model in self.adapters)):
            return model, model
        raise ApiError(f"The model `{model}` does not exist.", 404, param="model", code="model_not_found")

    async def sync_adapters(self) -> bool:
        """Read the adapter names from the executor; False when it did not answer."""
        async with self._lora_change:
            data = await self.ask_admin(self.config.endpoints.admin_executor, "lora_list", LORA_ADMIN_TIMEOUT_S)
            if data is None:
                return False
            self.adapters = dict(data.get("adapters") or {})
            return True

    async def _keep_adapters_synced(self) -> None:
        while True:
            await self.sync_adapters()
            await asyncio.sleep(LORA_SYNC_S)

    async def load_lora(self, name: str, path: str) -> None:
        """Have the executor read, check and register the adapter; ApiError (nothing changed) when
        it refuses."""
        self._runtime_lora_allowed()
        async with self._lora_change:
            await self._ask_executor("lora_load", {"name": name, "path": path})
            self.adapters[name] = path
        log.info("LoRA adapter loaded", name=name, path=path)

    async def unload_lora(self, name: str) -> None:
        """Forget the adapter here (new requests naming it get 404) and in the executor; 409 while
        requests on it are open."""
        self._runtime_lora_allowed()
        async with self._lora_change:
            if self.lora_open.get(name):
                raise ApiError(f"The lora adapter '{name}' has {self.lora_open[name]} request(s) in flight; "
                               "unload it once they finish", 409, param="lora_name", code="adapter_in_use")
            path = self.adapters.pop(name, None)
            try:
                await self._ask_executor("lora_unload", {"name": name})
            except ApiError as exc:
                if path is not None and exc.status != 404:
                    self.adapters[name] = path
                raise
        log.info("LoRA adapter unloaded", name=name)

    def _runtime_lora_allowed(self) -> None:
        if not self.config.allow_runtime_lora:
            raise ApiError("loading and unloading LoRA adapters at run time needs --allow-runtime-lora "
                           "(and --enable-lora)", 404, code="not_found")
        if not self.config.enable_lora:
            raise ApiError("LoRA adapters are not enabled: start the server with --enable-lora", 400)

    async def _ask_executor(self, command: str, args: dict) -> dict:
        data = await self.ask_admin(self.config.endpoints.admin_executor, command, LORA_LOAD_TIMEOUT_S, args)
        if data is None:
            raise ApiError("unavailable: the executor did not answer; retry later", 503, type_="server_error",
                           code="service_unavailable")
        if data.get("error"):
            status = int(data.get("status", 400))
            raise ApiError(data["error"], status, code="not_found" if status == 404 else None)
        return data

    def admin_stats(self, args: dict) -> dict:
        return {**self.stats, "num_unfinished": len(self.mailboxes), "num_queued": len(self.queued),
                "num_open": self.num_open, "down": self.health.down(),
                # blocks held by Python's small-object allocator: a per-request leak shows here
                # (bench_soak samples it) even where the resident size hides it in freed pages
                "python_allocated_blocks": sys.getallocatedblocks()}

    async def refresh_engine_stats(self) -> None:
        ep, timeout = self.config.endpoints, self.config.admin_timeout_s
        scheduler, kvmanager = await asyncio.gather(
            self.ask_admin(ep.admin_scheduler, "stats", timeout), self.ask_admin(ep.admin_kvmanager, "stats", timeout)
        )
        self.metrics.set_engine_stats(scheduler, kvmanager)
        tokenizer, executor = await asyncio.gather(
            self.ask_admin(ep.admin_tokenizer, "stats", timeout), self.ask_admin(ep.admin_executor, "stats", timeout)
        )
        self.metrics.set_grammar_stats(tokenizer, executor)
        self.metrics.set_image_stats(executor)
        if self.config.enable_lora:
            self.metrics.set_lora_stats(scheduler, executor)

    async def ask_admin(self, address: str, command: str, timeout: float, args: dict | None = None) -> dict | None:
        """``AdminReply.data`` of a service, or None when it is absent, slow or says no."""
        reply = await ask_admin(self.ctx, address, command, args, timeout, log, self.config.endpoints.owner(address))
        return reply.data if reply is not None and reply.ok else None
