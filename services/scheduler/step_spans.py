"""The scheduler's spans of a traced request (``folio.shared.tracing``; only with ``--otlp-traces-endpoint``).

The scheduler knows what the executor does with a request: which steps carry its prefill chunks,
which its decodes, and when it was preempted. So it records the executor's spans too, with the
executor's clock (each ``StepResult`` carries the step's start and end, ``exec_ns``, while tracing
is on), all children of the gateway's request span (``EngineRequest.traceparent``):

- ``scheduler.queue``: from the request's arrival here to the first step that schedules it (prompt
  and cached tokens, the adapter);
- ``executor.prefill_chunk``: one per step that computes part of its prompt (the chunk's tokens and
  start; a chunk after a preemption by recompute says ``folio.recompute``);
- ``executor.decode``: one summary of its decode steps, recorded when it finishes: their count, the
  output tokens, preemptions, from the first decode step's start to the last one's end.

Only requests that carry a traceparent are followed; the service calls in here only while tracing
is on, so the step's path pays nothing when it is off.
"""

from __future__ import annotations

from dataclasses import dataclass

from folio.core.scheduler.state import StepOutput
from folio.core.scheduler.request import Request, Status
from folio.shared.messages import EngineRequest, StepResult
from folio.shared.tracing import Tracing, now_ns

MAX_OPEN_STEPS = 64  # steps sent and not answered kept (an executor restart loses their results)


@dataclass
class RequestTrace:
    traceparent: str
    arrival_ns: int
    lora_name: str | None
    queued: bool = True  # not scheduled yet
    num_sends: int = 0  # times sent to the executor as new: 1 + preemptions
    num_prefill_chunks: int = 0
    num_decode_steps: int = 0
    decode_start_ns: int = 0
    decode_end_ns: int = 0


class SchedulerTracer:
    def __init__(self, tracing: Tracing):
        self.tracing = tracing
        self.requests: dict[str, RequestTrace] = {}
        # step id -> (request, its trace, first token computed, tokens, a prefill chunk?) per traced request
        self.steps: dict[int, list[tuple[Request, RequestTrace, int, int, bool]]] = {}

    def add(self, msg: EngineRequest) -> None:
        if msg.traceparent:
            self.requests[msg.req_id] = RequestTrace(msg.traceparent, now_ns(), msg.lora_name)

    def drop(self, req_id: str, req: Request | None = None) -> None:
        """Refused (no ``req``) or aborted (a stop string, a client gone): no more spans, but the
        decode summary of the steps it had."""
        trace = self.requests.pop(req_id, None)
        if trace is not None and req is not None:
            self._finish(req, trace)

    def on_sent(self, out: StepOutput) -> None:
        """A step was planned and sent: close the queue span of the traced requests it schedules
        first, and remember which of them compute prompt tokens in it."""
        if not self.requests:
            return
        entries = []
        new_ids = {n.req_id for n in out.new_reqs}
        for req, num_new in out.scheduled:
            trace = self.requests.get(req.req_id)
            if trace is None:
                continue
            if trace.queued:
                trace.queued = False
                self.tracing.record("scheduler.queue", trace.traceparent, trace.arrival_ns, now_ns(),
                                    {"gen_ai.usage.input_tokens": req.num_prompt_tokens,
                                     "folio.cached_tokens": req.num_cached_tokens, "folio.lora_name": trace.lora_name})
            if req.req_id in new_ids:
                trace.num_sends += 1
            start = req.num_computed_tokens - num_new  # ``schedule`` advanced it past this step's tokens
            entries.append((req, trace, start, num_new, start < req.num_prompt_tokens))
        if entries:
            if len(self.steps) >= MAX_OPEN_STEPS:
                self.steps.pop(next(iter(self.steps)))
            self.steps[out.step_id] = entries

    def on_result(self, out: StepOutput, result: StepResult) -> None:
        """A step's result: its prefill chunks' spans, its decodes counted; a finished request's
        decode summary."""
        entries = self.steps.pop(out.step_id, None)
        if not entries:
            return
        start_ns, end_ns = result.exec_ns if len(result.exec_ns) == 2 else (now_ns(), now_ns())
        for req, trace, start, num_new, prefill in entries:
            if prefill:
                trace.num_prefill_chunks += 1
                self.tracing.record("executor.prefill_chunk", trace.traceparent, start_ns, end_ns,
                                    {"folio.chunk_tokens": num_new, "folio.chunk_start": start,
                                     "gen_ai.usage.input_tokens": req.num_prompt_tokens,
                                     "folio.cached_tokens": req.num_cached_tokens,
                                     "folio.recompute": trace.num_sends > 1, "folio.lora_name": trace.lora_name})
            else:
                trace.num_decode_steps += 1
                trace.decode_start_ns = trace.decode_start_ns or start_ns
                trace.decode_end_ns = end_ns
            if req.status is Status.FINISHED and self.requests.pop(req.req_id, None) is not None:
                self._finish(req, trace)

    def _finish(self, req: Request, trace: RequestTrace) -> None:
        if not trace.num_decode_steps:
            return  # finished at its prefill's token
        self.tracing.record("executor.decode", trace.traceparent, trace.decode_start_ns, trace.decode_end_ns,
                            {"folio.decode_steps": trace.num_decode_steps,
                             "gen_ai.usage.output_tokens": len(req.output_token_ids),
                             "folio.preemptions": max(0, trace.num_sends - 1),
                             "folio.cached_tokens": req.num_cached_tokens, "folio.lora_name": trace.lora_name})
