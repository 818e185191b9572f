"""The scheduler service: the iteration loop around ``policy.Scheduler``, and its sockets.

Who talks to it:
- the tokenizer PUSHes ``EngineRequest`` and ``AbortRequest`` into ``recv_from_tokenizer``;
- each step it asks the kvmanager for blocks (``send_to_kvmanager``, DEALER: one ``KVStepRequest``,
  skipped when the step needs no block and frees none), sends the ``StepPlan`` to the executor
  (``send_to_executor``, DEALER) and PUSHes one ``TokenBatch`` to the tokenizer;
- CLIs ask its admin ROUTER for ``stats``, ``requests``, ``abort``, ``drain`` (finish what was
  accepted, refuse new requests with 503) and ``resume``.
The loop sleeps on an event when there is no work (never polls) and wakes on the next message.
"""

from __future__ import annotations

import asyncio
import time

import structlog
import zmq
import zmq.asyncio

from services.common import close_sockets, serve_admin, sniff_req_id
from services.scheduler.policy import Scheduler
from shared.config import SchedulerConfig
from shared.messages import (
    AbortRequest,
    EngineRequest,
    GetPool,
    KVStepReply,
    PoolInfo,
    StepResult,
    TokenBatch,
    TokenDelta,
)
from shared.transport import Decoder, MalformedMessage, encode, make_socket

log = structlog.get_logger()

# A step that takes longer than this makes us ask the kvmanager whether the executor restarted
# (a new pool epoch); a slow step is then simply waited for again.
EXECUTOR_CHECK_S = 5.0


class SchedulerService:
    def __init__(self, config: SchedulerConfig, ctx: zmq.asyncio.Context):
        ep = config.endpoints
        self.config = config
        self.recv_from_tokenizer = make_socket(ctx, zmq.PULL, ep.scheduler_in)
        self.send_to_tokenizer = make_socket(ctx, zmq.PUSH, ep.tokenizer_in)
        self.send_to_kvmanager = make_socket(ctx, zmq.DEALER, ep.kvmanager)
        self.send_to_executor = make_socket(ctx, zmq.DEALER, ep.executor)
        self.recv_from_admin = make_socket(ctx, zmq.ROUTER, ep.admin_scheduler)
        self.tokenizer_decoder = Decoder(EngineRequest, AbortRequest)
        self.kvmanager_decoder = Decoder(PoolInfo, KVStepReply)
        self.executor_decoder = Decoder(StepResult)
        self.handlers = {EngineRequest: self.handle_engine_request, AbortRequest: self.handle_abort_request}
        self.admin_commands = {"stats": self.admin_stats, "requests": self.admin_requests, "abort": self.admin_abort,
                               "drain": self.admin_drain, "resume": self.admin_resume}
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   long_prefill_token_threshold=config.long_prefill_token_threshold,
                                   preemption_mode=config.preemption_mode,
                                   scheduling_policy=config.scheduling_policy)
        self.wake = asyncio.Event()
        self.pool_ready = False
        self.executor_check_s = EXECUTOR_CHECK_S
        # where step time goes: the bench compares them with the executor's execute time
        self.timers = {"step_seconds_total": 0.0, "kv_wait_seconds_total": 0.0, "executor_wait_seconds_total": 0.0,
                       "last_step_seconds": 0.0}

    async def run(self) -> None:
        try:
            await asyncio.gather(self.loop(), serve_admin(self.recv_from_admin, self.admin_commands, log))
        finally:
            close_sockets(self.recv_from_tokenizer, self.send_to_tokenizer, self.send_to_kvmanager,
                          self.send_to_executor, self.recv_from_admin)

    # ------------------------------------------------------------------ the iteration loop
    async def loop(self) -> None:
        log.info("waiting for the executor's KV pool")
        info = await self.call(self.send_to_kvmanager, self.kvmanager_decoder, GetPool(), PoolInfo)
        self.scheduler.set_pool(info)
        self.pool_ready = True
        if self.config.preemption_mode == "swap" and not info.num_host_blocks:
            log.warning("--preemption-mode swap without a host tier (--num-host-blocks): preemption recomputes")
        log.info("pool ready", num_blocks=info.num_blocks, block_size=info.block_size,
                 max_model_len=self.scheduler.max_model_len, epoch=info.epoch)
        receiver = asyncio.ensure_future(self.receive_from_tokenizer())
        try:
            while True:
                if not self.scheduler.has_work() or not await self.step():
                    self.wake.clear()
                    await self.wake.wait()
        finally:
            receiver.cancel()

    async def step(self) -> bool:
        """Run one step; False when there was nothing to do (then the loop waits for a message)."""
        sched, timers = self.scheduler, self.timers
        t0 = time.perf_counter()
        out = sched.schedule()
        if out is None:
            return False
        kv = None
        if sched.needs_kv_call(out):
            t1 = time.perf_counter()
            kv = await self.call(self.send_to_kvmanager, self.kvmanager_decoder, out.kv_request(), KVStepReply,
                                 out.step_id)
            timers["kv_wait_seconds_total"] += time.perf_counter() - t1
            if kv.epoch and kv.epoch != sched.pool.epoch:
                await self.recover_from_restart(kv.new_block_ids)
                return True
        plan = sched.build_plan(out, kv)
        t2 = time.perf_counter()
        result = await self.call(self.send_to_executor, self.executor_decoder, plan, StepResult, out.step_id,
                                 check_s=self.executor_check_s)
        timers["executor_wait_seconds_total"] += time.perf_counter() - t2
        if result is None or (result.epoch and result.epoch != sched.pool.epoch):
            await self.recover_from_restart()
            return True
        deltas = sched.update_from_result(out, result)
        if deltas:
            await self.push_deltas(out.step_id, deltas)
        timers["last_step_seconds"] = time.perf_counter() - t0
        timers["step_seconds_total"] += timers["last_step_seconds"]
        return True

    async def call(self, sock, decoder: Decoder, request, reply_type: type, step_id: int | None = None,
                   check_s: float | None = None):
        """One request/reply on a DEALER: malformed or stale replies are logged and skipped. With
        ``check_s``, a reply slower than that checks for an executor restart (None if it did)."""
        await sock.send(encode(request))
        while True:
            if check_s is not None:
                while not await sock.poll(int(check_s * 1000), zmq.POLLIN):
                    if await self.executor_restarted():
                        return None
            data = await sock.recv()
            try:
                reply = decoder.decode(data)
            except MalformedMessage as exc:
                log.warning("malformed reply dropped", type=reply_type.__name__, error=str(exc))
                continue
            if not isinstance(reply, reply_type) or (step_id is not None and reply.step_id != step_id):
                log.warning("unexpected reply dropped", expected=reply_type.__name__, got=type(reply).__name__,
                            step_id=step_id)
                continue
            return reply

    async def executor_restarted(self) -> bool:
        info = await self.call(self.send_to_kvmanager, self.kvmanager_decoder, GetPool(), PoolInfo)
        return info.epoch != self.scheduler.pool.epoch

    async def recover_from_restart(self, held: dict[str, list[int]] | None = None) -> None:
        """A new executor knows nothing: every running request starts over by recompute."""
        old = self.scheduler.pool.epoch
        info = await self.call(self.send_to_kvmanager, self.kvmanager_decoder, GetPool(), PoolInfo)
        num = self.scheduler.reset_pool(info, held)
        log.error("the executor restarted: its requests start over", old_epoch=old, new_epoch=info.epoch,
                  num_requests=num)

    async def push_deltas(self, step_id: int, deltas: list[TokenDelta]) -> None:
        await self.send_to_tokenizer.send(encode(TokenBatch(step_id=step_id, deltas=deltas)))

    # ------------------------------------------------------------------ from the tokenizer
    async def receive_from_tokenizer(self) -> None:
        while True:
            data = await self.recv_from_tokenizer.recv()
            try:
                msg = self.tokenizer_decoder.decode(data)
            except MalformedMessage as exc:
                log.warning("malformed message dropped", socket="tokenizer", error=str(exc), num_bytes=len(data),
                            req_id=sniff_req_id(data))
                continue
            try:
                await self.handlers[type(msg)](msg)
            except Exception:
                log.exception("handler failed; message dropped", req_id=getattr(msg, "req_id", None))

    async def handle_engine_request(self, msg: EngineRequest) -> None:
        refusals = self.scheduler.add_request(msg)
        if refusals:
            log.warning("request refused", req_id=msg.req_id, error=refusals[0].error)
            await self.push_deltas(self.scheduler.next_step_id, refusals)
            return
        self.wake.set()

    async def handle_abort_request(self, msg: AbortRequest) -> None:
        if self.scheduler.abort(msg.req_id):
            log.info("request aborted", req_id=msg.req_id, reason=msg.reason)
            self.wake.set()  # its blocks go back in the next step, even when nothing else runs

    # ------------------------------------------------------------------ admin
    def admin_stats(self, args: dict) -> dict:
        if not self.pool_ready:
            return {"pool_ready": False, "num_running": 0, "num_waiting": 0, "num_swapped": 0,
                    **self.scheduler.counters}
        steps = max(1, self.scheduler.counters["num_steps"])
        return {"pool_ready": True, **self.scheduler.stats(), **self.timers,
                "mean_step_seconds": self.timers["step_seconds_total"] / steps}

    def admin_requests(self, args: dict) -> dict:
        return {"requests": self.scheduler.describe_requests()}

    def admin_abort(self, args: dict) -> dict:
        req_id = args["req_id"]
        group = self.scheduler.groups.get(req_id)
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
