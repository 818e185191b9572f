"""The scheduler service: the step loop (``folio.core.scheduler.step_loop``) over its sockets.

Who talks to it:
- the tokenizer PUSHes ``EngineRequest`` and ``AbortRequest`` into ``recv_from_tokenizer``;
- each step the loop plans with the allocator replica, sends the step's allocator log to the
  kvmanager (``KVManagerClient``: one ``KVStepRequest`` on ``send_to_kvmanager``, DEALER, when the
  log is not empty, without waiting), sends the ``StepPlan`` to the executor (``ExecutorClient``:
  ``send_to_executor``, DEALER), waits for its ``StepResult`` and PUSHes one ``TokenBatch`` to the
  tokenizer. With async scheduling (the default) it plans and sends step N+1 before waiting for
  step N's result, whenever the policy says N+1 does not depend on it (``can_plan_ahead``): at
  most one step runs ahead;
- the kvmanager's replies are read as they come (``KVManagerClient.receive``): each step's state
  digest is checked against the replica's; a mismatch, or a kvmanager that lost its state
  (restarted), starts a new epoch (``KVManagerClient.new_epoch``: the one place that
  resynchronises, also used when the executor restarts). ``KVClearCache`` (``folio kv clear``)
  puts a clear into the next log;
- CLIs ask its admin ROUTER for ``stats`` (with the running and waiting requests per LoRA
  adapter; at most ``--max-loras`` distinct adapters run at once), ``requests``, ``abort``,
  ``drain`` (finish what was accepted, refuse new requests with 503) and ``resume``.
With ``--otlp-traces-endpoint`` it records a traced request's queue span and, with the executor's
step times, its prefill chunks and a summary of its decodes (``step_spans.py``).
The loop sleeps on an event when there is no work (never polls) and wakes on the next message.
"""
from __future__ import annotations

import asyncio
import os

import structlog
import zmq
import zmq.asyncio

from folio.core.scheduler.policy import Scheduler
from folio.core.scheduler.state import StepOutput
from folio.core.scheduler.stats import describe_requests, scheduler_stats
from folio.core.scheduler.step_loop import StepLoop
from folio.shared.config import SchedulerConfig
from folio.core.executor.runtime.spec_config import speculation_on
from folio.services.shell import serve_admin, serve_pull
from folio.shared.transport import close_sockets, receive_reply
from folio.shared.messages import (
    AbortRequest,
    EngineRequest,
    GetPool,
    KVClearCache,
    KVReset,
    KVStepReply,
    PoolInfo,
    StepPlan,
    StepResult,
    TokenBatch,
    TokenDelta,
)
from folio.services.scheduler.step_spans import SchedulerTracer
from folio.shared.tracing import setup as tracing_setup
from folio.shared.transport import Decoder, encode, make_socket

log = structlog.get_logger()

# A step that takes longer than this makes us ask the kvmanager whether the executor restarted
# (a new pool epoch); a slow step is then simply waited for again.
EXECUTOR_CHECK_S = 5.0
# Step digests kept for replies still to come; a kvmanager that far behind is out of the picture.
MAX_PENDING_DIGESTS = 10_000
# Fault tests only: a request whose prompt starts with these token ids (comma-separated in the
# environment of the scheduler's process) makes it exit at once, a "poison" request that crashes
# every scheduler it reaches. Unset (always, outside the tests) it costs one falsy check.
CRASH_ON_PROMPT = [int(t) for t in os.environ.get("FOLIO_TESTING_CRASH_ON_PROMPT", "").split(",") if t.strip()]


class KVManagerClient:
    """The step loop's allocator of record in the service: the kvmanager behind its DEALER. Each
    step's log goes out without waiting; its digest is checked when the reply comes (a mismatch,
    or a kvmanager that lost its state, sets ``out_of_sync``)."""

    def __init__(self, sock: zmq.asyncio.Socket, scheduler: Scheduler, wake: asyncio.Event):
        self.sock = sock
        self.scheduler = scheduler
        self.wake = wake  # set when the loop has something to do: a new epoch, a cache to clear
        self.decoder = Decoder(PoolInfo, KVStepReply, KVClearCache)
        self.generation = 0  # the sync epoch with the kvmanager
        self.synced_generation = 0  # the last epoch whose reset both sides completed (stats)
        self.pending_digests: dict[int, bytes] = {}  # step_id -> the replica's digest, until the reply
        self.out_of_sync: str | None = None  # set when the kvmanager's state is not the replica's
        self.kv_reply: asyncio.Future | None = None  # a GetPool / KVReset waiting for its PoolInfo

    def send_log(self, out: StepOutput) -> None:
        """The step's allocator log to the kvmanager, not waited for: its digest is checked when
        the reply comes. A log that cannot be queued is lost, and the kvmanager, out of step,
        will say so (then a new epoch starts)."""
        if not out.ops:
            return
        if len(self.pending_digests) >= MAX_PENDING_DIGESTS:
            self.pending_digests.pop(next(iter(self.pending_digests)))
        self.pending_digests[out.step_id] = out.digest
        sent = self.sock.send(encode(self.scheduler.kv_request(out, self.generation)), flags=zmq.NOBLOCK)
        if sent.done() and sent.exception() is not None:
            log.warning("kvmanager not keeping up: step log dropped", step_id=out.step_id)

    async def new_epoch(self, reason: str) -> None:
        """Empty tables on both sides, in step: the kvmanager resets (``KVReset``) and answers with
        the pool, the replica starts over for it, and every running request recomputes (keeping its
        tokens: nothing is lost). Used at start, after an executor restart, a digest mismatch or a
        kvmanager that lost its state."""
        self.generation += 1
        self.pending_digests.clear()
        self.out_of_sync = None
        sched = self.scheduler
        pool = sched.pool or await self.call(GetPool())
        info = await self.call(KVReset(generation=self.generation, pool=pool))
        old = sched.pool.epoch if sched.pool else None
        num = sched.new_epoch(info)
        self.synced_generation = self.generation
        if reason != "start":
            log.error("new epoch: running requests start over", reason=reason, old_epoch=old,
                      new_epoch=info.epoch, generation=self.generation, num_requests=num)
            self.wake.set()

    async def call(self, request, timeout_s: float | None = None) -> PoolInfo:
        """A request the kvmanager answers with ``PoolInfo`` (read by ``receive``)."""
        self.kv_reply = asyncio.get_running_loop().create_future()
        await self.sock.send(encode(request))
        return await asyncio.wait_for(self.kv_reply, timeout_s)

    async def receive(self) -> None:
        """The kvmanager's messages as they come: ``PoolInfo`` answers ``call``, ``KVClearCache``
        clears the cache in the next log, ``KVStepReply`` carries a step's digest."""
        await serve_pull(self.sock, self.decoder,
                         {PoolInfo: self.handle_pool_info, KVClearCache: self.handle_clear_cache,
                          KVStepReply: self.check_digest}, log, "kvmanager")

    def handle_pool_info(self, info: PoolInfo) -> None:
        if self.kv_reply is not None and not self.kv_reply.done():
            self.kv_reply.set_result(info)

    def handle_clear_cache(self, msg: KVClearCache) -> None:
        self.scheduler.clear_cache()
        self.wake.set()

    def check_digest(self, reply: KVStepReply) -> None:
        if reply.generation != self.generation or self.out_of_sync is not None:
            return  # about an epoch already left
        expected = self.pending_digests.pop(reply.step_id, None)
        if not reply.in_sync:
            self.out_of_sync = "the kvmanager lost its state (restarted, or a new pool)"
        elif expected is not None and reply.digest != expected:
            self.scheduler.counters["num_digest_mismatches"] += 1
            self.out_of_sync = "the kvmanager's state digest differs from the replica's"
        if self.out_of_sync is not None:
            log.error("kvmanager out of sync", step_id=reply.step_id, reason=self.out_of_sync)
            self.wake.set()


class ExecutorClient:
    """The step loop's executor in the service: the executor behind its DEALER. A result slower
    than ``check_s`` makes it ask the kvmanager whether the executor restarted (a new pool epoch)."""

    def __init__(self, sock: zmq.asyncio.Socket, scheduler: Scheduler, kvmanager: KVManagerClient):
        self.sock = sock
        self.scheduler = scheduler
        self.kvmanager = kvmanager
        self.decoder = Decoder(StepResult)
        self.check_s = EXECUTOR_CHECK_S

    async def send_plan(self, plan: StepPlan) -> None:
        await self.sock.send(encode(plan))

    async def receive_result(self, step_id: int) -> StepResult | None:
        """Step ``step_id``'s ``StepResult`` (malformed or stale replies are skipped); None if the
        executor restarted."""
        while True:
            result = await receive_reply(self.sock, self.decoder, log, self.check_s,
                                         accept=lambda r: r.step_id == step_id, socket_name="executor")
            if result is not None:
                return result
            if await self.restarted():
                return None

    async def restarted(self) -> bool:
        try:
            info = await self.kvmanager.call(GetPool(), timeout_s=self.check_s)
        except TimeoutError:
            return False  # the kvmanager is away too: keep waiting for the executor
        return info.epoch != self.scheduler.pool.epoch


class SchedulerService:
    def __init__(self, config: SchedulerConfig, ctx: zmq.asyncio.Context):
        ep = config.endpoints
        self.config = config
        self.recv_from_tokenizer = make_socket(ctx, zmq.PULL, ep.scheduler_in)
        self.send_to_tokenizer = make_socket(ctx, zmq.PUSH, ep.tokenizer_in, service="tokenizer")
        self.send_to_kvmanager = make_socket(ctx, zmq.DEALER, ep.kvmanager, service="kvmanager")
        self.send_to_executor = make_socket(ctx, zmq.DEALER, ep.executor, service="executor")
        self.recv_from_admin = make_socket(ctx, zmq.ROUTER, ep.admin_scheduler)
        self.tokenizer_decoder = Decoder(EngineRequest, AbortRequest)
        self.handlers = {EngineRequest: self.handle_engine_request, AbortRequest: self.handle_abort_request}
        self.admin_commands = {"stats": self.admin_stats, "requests": self.admin_requests, "abort": self.admin_abort,
                               "drain": self.admin_drain, "resume": self.admin_resume}
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   long_prefill_token_threshold=config.long_prefill_token_threshold,
                                   preemption_mode=config.preemption_mode,
                                   scheduling_policy=config.scheduling_policy, max_loras=config.max_loras,
                                   max_pooling_tokens_per_step=config.max_pooling_tokens_per_step,
                                   max_num_encoder_input_tokens=config.max_num_encoder_input_tokens)
        self.scheduler.speculative = speculation_on(config)
        self.wake = asyncio.Event()
        self.pool_ready = False
        self.kvmanager = KVManagerClient(self.send_to_kvmanager, self.scheduler, self.wake)
        self.executor = ExecutorClient(self.send_to_executor, self.scheduler, self.kvmanager)
        tracing = tracing_setup(config.otlp_traces_endpoint, "scheduler")
        self.tracer = SchedulerTracer(tracing) if tracing is not None else None  # None: tracing off
        self.steps = StepLoop(self.scheduler, self.executor, self.kvmanager, async_scheduling=config.async_scheduling,
                              on_plan=(lambda out, plan: self.tracer.on_sent(out)) if self.tracer else None,
                              on_result=self.tracer.on_result if self.tracer else None)

    async def run(self) -> None:
        receiver = asyncio.ensure_future(self.kvmanager.receive())
        try:
            await asyncio.gather(self.loop(), serve_admin(self.recv_from_admin, self.admin_commands, log))
        finally:
            receiver.cancel()
            close_sockets(self.recv_from_tokenizer, self.send_to_tokenizer, self.send_to_kvmanager,
                          self.send_to_executor, self.recv_from_admin)

    # ------------------------------------------------------------------ the iteration loop
    async def loop(self) -> None:
        log.info("waiting for the executor's KV pool")
        await self.kvmanager.new_epoch("start")
        info = self.scheduler.pool
        self.pool_ready = True
        if self.config.preemption_mode == "swap" and not info.num_host_blocks:
            log.warning("--preemption-mode swap without a host tier (--num-host-blocks): preemption recomputes")
        log.info("pool ready", num_blocks=info.num_blocks, block_size=info.block_size,
                 max_model_len=self.scheduler.max_model_len, sliding_window=info.sliding_window, epoch=info.epoch)
        receiver = asyncio.ensure_future(self.receive_from_tokenizer())
        try:
            while True:
                if await self.steps.step(publish=self.push_batch) is None:
                    self.wake.clear()
                    await self.wake.wait()
        finally:
            receiver.cancel()

    async def push_batch(self, batch: TokenBatch) -> None:
        await self.send_to_tokenizer.send(encode(batch))

    async def push_deltas(self, step_id: int, deltas: list[TokenDelta]) -> None:
        await self.send_to_tokenizer.send(encode(TokenBatch(step_id=step_id, deltas=deltas)))

    # ------------------------------------------------------------------ from the tokenizer
    async def receive_from_tokenizer(self) -> None:
        await serve_pull(self.recv_from_tokenizer, self.tokenizer_decoder, self.handlers, log, "tokenizer")

    async def handle_engine_request(self, msg: EngineRequest) -> None:
        if CRASH_ON_PROMPT and msg.prompt_token_ids[:len(CRASH_ON_PROMPT)] == CRASH_ON_PROMPT:
            log.error("crashing on purpose: the prompt starts with $FOLIO_TESTING_CRASH_ON_PROMPT")
            os._exit(70)
        if self.tracer is not None:
            self.tracer.add(msg)
        refusals = self.scheduler.add_request(msg)
        if refusals:
            if self.tracer is not None:
                self.tracer.drop(msg.req_id)
            log.warning("request refused", req_id=msg.req_id, error=refusals[0].error)
            await self.push_deltas(self.scheduler.next_step_id, refusals)
            return
        self.wake.set()

    async def handle_abort_request(self, msg: AbortRequest) -> None:
        if self.tracer is not None:
            self.tracer.drop(msg.req_id, self.scheduler.requests.get(msg.req_id))
        if self.scheduler.abort(msg.req_id):
            log.info("request aborted", req_id=msg.req_id, reason=msg.reason)
            self.wake.set()  # its blocks go back in the next step, even when nothing else runs

    # ------------------------------------------------------------------ admin
    def admin_stats(self, args: dict) -> dict:
        if not self.pool_ready:
            return {"pool_ready": False, "num_running": 0, "num_waiting": 0, "num_swapped": 0,
                    **self.scheduler.counters}
        steps, timers = max(1, self.scheduler.counters["num_steps"]), self.steps.timers
        return {"pool_ready": True, **scheduler_stats(self.scheduler), **timers,
                "generation": self.kvmanager.synced_generation,
                "async_scheduling": self.config.async_scheduling,
                "mean_step_seconds": timers["step_seconds_total"] / steps,
                "mean_plan_seconds": timers["plan_seconds_total"] / steps, **self.lora_stats()}

    def lora_stats(self) -> dict:
        """Running and waiting requests per LoRA adapter (``/metrics``), and the adapters' limit."""
        sched = self.scheduler
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for counts, queue in ((running, sched.running), (waiting, (*sched.waiting, *sched.swapped))):
            for r in queue:
                if r.lora_name is not None:
                    counts[r.lora_name] = counts.get(r.lora_name, 0) + 1
        return {"lora_running": running, "lora_waiting": waiting, "max_loras": sched.max_loras}

    def admin_requests(self, args: dict) -> dict:
        return {"requests": describe_requests(self.scheduler)}

    def admin_abort(self, args: dict) -> dict:
        req_id = args["req_id"]
        group = self.scheduler.forks.groups.get(req_id)
        choice_ids = list(group.choice_ids) if group is not None else [req_id]
        if not self.scheduler.abort(req_id):
            raise KeyError(f"no request {req_id!r} (finished already, or never here)")
        # the tokenizer did not ask for this one: tell it, so that the client's stream ends
        deltas = [TokenDelta(req_id=i, token_ids=[], finish_reason="abort") for i in choice_ids]
        asyncio.ensure_future(self.push_deltas(self.scheduler.next_step_id, deltas))
        self.wake.set()
        log.info("request aborted by admin", req_id=req_id)
        return {"req_id": req_id, "aborted": True}

    def admin_drain(self, args: dict) -> dict:
        """Admit nothing new (refused with 503) and finish what was accepted."""
        self.scheduler.draining = True
        log.info("draining: new requests are refused")
        s = self.scheduler
        return {"draining": True, "num_running": len(s.running), "num_waiting": len(s.waiting),
                "num_swapped": len(s.swapped), "idle": not s.has_work()}

    def admin_resume(self, args: dict) -> dict:
        self.scheduler.draining = False
        log.info("resumed: new requests are admitted")
        return {"draining": False}
