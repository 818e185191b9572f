"""The step loop: plan a step, send it, wait for its result, apply it; with async scheduling, plan
step N+1 while step N runs (``docs/scheduling-and-kv.md``, "Async scheduling").

One loop for both shells. ``folio.LLM`` runs it in its own thread over the model runner
(``folio.core.engine``); the scheduler service runs it over its sockets (``services/scheduler``).
It reaches the executor and the allocator of record (the kvmanager) through the two interfaces
below, and opens no socket itself.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from folio.core.scheduler.policy import Scheduler
from folio.core.scheduler.state import StepOutput
from folio.shared.messages import StepPlan, StepResult, TokenBatch


class StepExecutor(Protocol):
    """Where plans go and results come from: the model runner in process, the executor service's
    socket in the scheduler service. Plans are run in the order they are sent."""

    async def send_plan(self, plan: StepPlan) -> None: ...

    async def receive_result(self, step_id: int) -> StepResult | None:
        """Step ``step_id``'s result (the oldest step sent); None when the executor restarted and
        every step sent to it is lost."""


class AllocatorOfRecord(Protocol):
    """The owner of record of the blocks, which applies each step's allocator log after the
    replica did: nobody in process (the replica is the only allocator), the kvmanager in the
    service."""

    @property
    def out_of_sync(self) -> str | None:
        """Why its state and the replica's differ (then a new epoch must start), or None."""

    def send_log(self, out: StepOutput) -> None:
        """``out``'s allocator log, not waited for."""

    async def new_epoch(self, reason: str) -> None:
        """Both sides start over with empty tables (``policy.new_epoch``); nothing is in flight."""


class StepLoop:
    """The steps of one scheduler, planned ahead when async scheduling allows it. ``on_plan`` and
    ``on_result`` see each step's decision with its plan before it is sent, and with its result
    once applied (tests and tracing)."""

    def __init__(self, scheduler: Scheduler, executor: StepExecutor, record: AllocatorOfRecord, *,
                 async_scheduling: bool,
                 on_plan: Callable[[StepOutput, StepPlan], None] | None = None,
                 on_result: Callable[[StepOutput, StepResult], None] | None = None):
        self.scheduler = scheduler
        self.executor = executor
        self.record = record
        self.async_scheduling = async_scheduling
        self.on_plan = on_plan
        self.on_result = on_result
        # where step time goes (``folio scheduler stats``; the bench compares it with the executor's)
        self.timers = {"step_seconds_total": 0.0, "plan_seconds_total": 0.0, "update_seconds_total": 0.0,
                       "executor_wait_seconds_total": 0.0, "last_step_seconds": 0.0}

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    async def step(self, publish: Callable[[TokenBatch], Awaitable[None]] | None = None) -> TokenBatch | None:
        """One iteration: wait for the oldest step's result, sending a step first when none runs
        and, with async scheduling, the one after it meanwhile; returns the result's deltas (empty
        when the executor restarted and the step was lost), None when there was nothing to do.

        ``publish``: where the deltas go when their reader is in another process. Then the next
        step is planned before they are published, so that the executor gets its plan first; in
        process the caller reads them (a stop string aborts its request) before the next plan."""
        sched, timers, in_flight = self.scheduler, self.timers, self.scheduler.in_flight
        if self.record.out_of_sync is not None and not in_flight:
            await self.record.new_epoch(self.record.out_of_sync)
        if not sched.has_work():
            return None
        t0 = time.perf_counter()
        if not in_flight and not await self._send_step(None):
            return None
        await self.plan_ahead()
        t1 = time.perf_counter()
        out = in_flight[0]
        result = await self.executor.receive_result(out.step_id)
        t2 = time.perf_counter()
        timers["plan_seconds_total"] += t1 - t0
        timers["executor_wait_seconds_total"] += t2 - t1
        if result is None or (result.epoch and result.epoch != sched.pool.epoch):
            await self._restart()
            return TokenBatch(step_id=out.step_id)
        in_flight.popleft()
        batch = sched.update_from_result(out, result)
        if self.on_result is not None:
            self.on_result(out, result)
        t3 = t4 = time.perf_counter()
        if publish is not None:
            await self.plan_ahead()
            t4 = time.perf_counter()
            if batch:
                await publish(batch)
        t5 = time.perf_counter()
        timers["plan_seconds_total"] += t4 - t3
        timers["update_seconds_total"] += (t3 - t2) + (t5 - t4)
        timers["last_step_seconds"] = t5 - t0
        timers["step_seconds_total"] += t5 - t0
        return batch

    async def plan_ahead(self) -> None:
        """With async scheduling, send the step after the running one when the policy allows."""
        in_flight = self.scheduler.in_flight
        if (self.async_scheduling and len(in_flight) == 1 and self.record.out_of_sync is None
                and self.scheduler.can_plan_ahead(in_flight[0])):
            await self._send_step(in_flight[0])

    async def _send_step(self, running: StepOutput | None) -> bool:
        """Plan a step (ahead of ``running``'s result, if given) and send it; False if empty."""
        sched = self.scheduler
        out = sched.schedule(running)
        if out is None:
            return False
        plan = sched.build_plan(out)
        self.record.send_log(out)
        if self.on_plan is not None:  # before the send yields: the requests are as ``schedule`` left them
            self.on_plan(out, plan)
        await self.executor.send_plan(plan)
        sched.in_flight.append(out)
        return True

    async def _restart(self) -> None:
        """The executor restarted: the steps sent to it are lost, and every running request
        recomputes in a new epoch."""
        self.scheduler.counters["num_executor_restarts"] += 1
        self.scheduler.in_flight.clear()
        await self.record.new_epoch("the executor restarted")
