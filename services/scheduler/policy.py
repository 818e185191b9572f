"""The iteration-level batching policy, free of sockets so that it can be read (and tested) alone.

Each step every running request gets the tokens it needs to catch up (a decode: 1; a prefill
chunk: up to the remaining token budget), oldest first, then waiting requests are admitted while
the budget (``max_num_batched_tokens``), the sequence cap (``max_num_seqs``) and the free blocks
allow. When a running request cannot grow, the newest running request is preempted by recompute:
its blocks are freed in this step's kvmanager call (frees come before allocations), the executor
drops it, and it waits at the head of the queue with the tokens it generated.

The service drives one step as ``schedule`` -> kvmanager -> ``build_plan`` -> executor ->
``update_from_result``. Free blocks are mirrored here, so the one kvmanager call normally succeeds;
when it does not, the requests it refused are preempted instead of crashing anything.

Prefix caching keeps that one call per step. A request new to the kvmanager is budgeted as if
nothing were cached: ``num_new`` tokens from 0, ``cdiv(num_new, block_size)`` blocks. Its
allocation entry carries its token ids, the kvmanager looks them up and answers how many tokens
its first blocks already hold (``KVStepReply.num_cached_tokens``, whole blocks, capped so that at
least one token of the entry is left to compute). ``build_plan`` then starts the request there: the
executor gets ``num_computed_tokens`` = cached tokens and computes only the rest of the entry. The
table holds exactly the blocks the mirror counted (cached ones included), and a hit never takes
more free blocks than were counted; a released request is counted as giving back only the blocks
no other table holds (``KVStepReply.num_shared_blocks``), so the mirror stays safe; the part of the budget the hit
saved is left unused this step (the price of not asking the kvmanager twice). Tokens reach the
kvmanager with each allocation (``new_token_ids``: those it has not seen), so that it can hash
blocks as they fill. Requests that want prompt logprobs send none: they neither hit nor feed the
cache, since a cached prompt token would have no logprob.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.kvmanager.allocator import cdiv
from services.scheduler.request import Request
from shared.messages import (
    EngineRequest,
    KVStepReply,
    NewRequestData,
    PoolInfo,
    RunningRequestData,
    StepPlan,
    StepResult,
    TokenDelta,
)


@dataclass
class StepOutput:
    """What ``schedule`` decided for one step, before the kvmanager gave block ids."""

    step_id: int
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num new tokens)
    free_req_ids: list[str] = field(default_factory=list)
    allocate: list[tuple[str, int]] = field(default_factory=list)  # (req_id, num tokens in total)
    num_new_blocks: dict[str, int] = field(default_factory=dict)  # what each allocation should add
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)  # tokens the kvmanager has not seen
    cache_salts: dict[str, str] = field(default_factory=dict)
    discard_req_ids: list[str] = field(default_factory=list)  # freed, their last allocation never computed


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len_limit = max_model_len
        self.max_model_len: int | None = max_model_len
        self.pool: PoolInfo | None = None
        # Free blocks as the kvmanager will see them once our allocations land, plus the blocks of
        # requests whose release waits for the next kvmanager call.
        self.num_free_blocks = 0
        self.num_pending_free_blocks = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.pending_free_req_ids: list[str] = []  # for the next kvmanager call
        self.pending_discard_req_ids: list[str] = []  # the same, for tables whose last growth never ran
        self.pending_finished_req_ids: list[str] = []  # for the next StepPlan
        self.next_step_id = 0
        self.counters = dict(num_steps=0, num_preemptions=0, num_prompt_tokens_total=0,
                             num_generation_tokens_total=0, num_requests_finished=0,
                             num_requests_aborted=0, num_requests_rejected=0, num_executor_restarts=0,
                             num_scheduled_tokens_total=0, num_cached_tokens_total=0)

    # ------------------------------------------------------------------ pool
    def set_pool(self, info: PoolInfo) -> None:
        self.pool = info
        self.num_free_blocks = info.num_free_blocks
        limits = [n for n in (self.max_model_len_limit, info.max_model_len) if n]
        self.max_model_len = min(limits) if limits else None

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, msg: EngineRequest) -> TokenDelta | None:
        """Queue a request; a request that can never run is refused with an "error" delta."""
        error = self._refusal(msg)
        if error is not None:
            self.counters["num_requests_rejected"] += 1
            return TokenDelta(req_id=msg.req_id, token_ids=[], finish_reason="error", error=error,
                              num_prompt_tokens=len(msg.prompt_token_ids))
        req = Request.from_message(msg)
        self.requests[req.req_id] = req
        self.waiting.append(req)
        return None

    def _refusal(self, msg: EngineRequest) -> str | None:
        num_prompt, max_tokens = len(msg.prompt_token_ids), msg.sampling.max_tokens
        if msg.req_id in self.requests:
            return f"request id {msg.req_id!r} is already in use"
        if num_prompt == 0:
            return "the prompt is empty"
        if max_tokens < 1:
            return f"max_tokens must be at least 1, got {max_tokens}"
        if self.max_model_len and num_prompt + max_tokens > self.max_model_len:
            return (f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                    f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} in the "
                    "completion). Please reduce the length of the prompt or completion.")
        # the last sampled token is never fed back, so its KV needs no slot
        need = cdiv(num_prompt + max_tokens - 1, self.block_size)
        if need > self.pool.num_blocks:
            return (f"the request needs {need} KV blocks ({num_prompt} prompt + {max_tokens} completion tokens) "
                    f"but the whole KV cache holds {self.pool.num_blocks}")
        return None

    def abort(self, req_id: str) -> bool:
        req = self.requests.get(req_id)
        if req is None:
            return False
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._release(req)
        self.counters["num_requests_aborted"] += 1
        return True

    def _release(self, req: Request) -> None:
        """A request that is done: its blocks go in the next kvmanager call, its state in the next plan."""
        req.finished = True
        del self.requests[req.req_id]
        self.pending_free_req_ids.append(req.req_id)
        if req.on_executor:
            self.pending_finished_req_ids.append(req.req_id)
        self.num_pending_free_blocks += req.num_blocks - req.num_shared_blocks

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pending_free_req_ids.append(req.req_id)
        if req.on_executor:
            self.pending_finished_req_ids.append(req.req_id)
        self.num_pending_free_blocks += req.num_blocks - req.num_shared_blocks
        req.reset_for_recompute()
        self.waiting.appendleft(req)
        self.counters["num_preemptions"] += 1

    def reset_pool(self, info: PoolInfo, held: dict[str, list[int]] | None = None) -> int:
        """The executor restarted (a new epoch): its state and the old tables are gone. Every
        running request starts over by recompute, first in line; ``held`` requests still hold blocks
        in the new tables (given in the call that revealed the restart). Returns how many restart."""
        running, self.running = self.running, []
        for req in running:
            req.reset_for_recompute()
        for req in self.waiting:
            req.on_executor = False
        self.waiting.extendleft(reversed(running))
        self.pending_finished_req_ids = []
        held = held or {}
        self.set_pool(info)
        # the step that would have filled them never ran: their blocks must not be cached
        self.pending_free_req_ids, self.pending_discard_req_ids = [], list(held)
        self.num_pending_free_blocks = sum(map(len, held.values()))
        self.counters["num_executor_restarts"] += 1
        return len(running)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.pending_free_req_ids or self.pending_finished_req_ids
                    or self.pending_discard_req_ids)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> StepOutput | None:
        """Pick this step's work; None when there is nothing to compute and nothing to free."""
        out = StepOutput(step_id=self.next_step_id)
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            need = cdiv(req.num_computed_tokens + num_new, self.block_size) - req.num_blocks
            victim = None
            while need > self.num_free_blocks + self.num_pending_free_blocks and victim is not req:
                victim = self.running[-1]  # the newest running request gives way
                self._preempt(victim)
                preempted = True
            if victim is req:
                break  # nothing newer was left to give way: it waits with the others
            self._take(out, req, num_new, need)
            budget -= num_new
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            need = cdiv(req.num_computed_tokens + num_new, self.block_size) - req.num_blocks
            if need > self.num_free_blocks + self.num_pending_free_blocks:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.running.append(req)
            if not req.admitted:
                req.admitted = True
                self.counters["num_prompt_tokens_total"] += req.num_prompt_tokens
            self._take(out, req, num_new, need)
            budget -= num_new
        # every pending release rides on this step's kvmanager call, before its allocations
        out.free_req_ids, self.pending_free_req_ids = self.pending_free_req_ids, []
        out.discard_req_ids, self.pending_discard_req_ids = self.pending_discard_req_ids, []
        self.num_free_blocks += self.num_pending_free_blocks
        self.num_pending_free_blocks = 0
        if not out.scheduled and not out.free_req_ids and not out.discard_req_ids and not self.pending_finished_req_ids:
            return None
        self.next_step_id += 1
        return out

    def _take(self, out: StepOutput, req: Request, num_new: int, need: int) -> None:
        out.scheduled.append((req, num_new))
        if need > 0:
            num_tokens = req.num_computed_tokens + num_new
            out.allocate.append((req.req_id, num_tokens))
            out.num_new_blocks[req.req_id] = need
            req.num_blocks += need
            self.num_free_blocks -= need
            if req.sampling.prompt_logprobs is None:
                out.new_token_ids[req.req_id] = req.all_token_ids[req.num_kv_token_ids:num_tokens]
                req.num_kv_token_ids = num_tokens
            if req.cache_salt is not None and req.num_blocks == need:  # its first allocation
                out.cache_salts[req.req_id] = req.cache_salt

    def needs_kv_call(self, out: StepOutput) -> bool:
        """Most decode steps cross no block boundary: then the kvmanager has nothing to do."""
        return bool(out.allocate or out.free_req_ids or out.discard_req_ids)

    def build_plan(self, out: StepOutput, kv: KVStepReply | None) -> StepPlan:
        """The executor's per-step diff, from this step's choices and the kvmanager's block ids."""
        failed = set(kv.failed_req_ids) if kv is not None else ()
        new_block_ids = kv.new_block_ids if kv is not None else {}
        for req, _ in out.scheduled:
            if req.req_id in failed and not req.finished:
                req.num_blocks -= out.num_new_blocks.get(req.req_id, 0)  # the kvmanager gave none
                self._preempt(req)  # its table is unchanged; freed whole in the next call
        if kv is not None:
            self.num_free_blocks = kv.num_free_blocks  # the truth; releases since stay pending
            for req in self.running:  # a shared block is not freed with one of its tables
                req.num_shared_blocks = kv.num_shared_blocks.get(req.req_id, 0)
        new_reqs, running_reqs, num_scheduled = [], [], {}
        kept = []
        num_cached = kv.num_cached_tokens if kv is not None else {}
        for req, num_new in out.scheduled:
            if req.finished and req.req_id in out.num_new_blocks:
                self._discard(req.req_id)  # aborted while the kvmanager answered: never computed
            if req.finished or req.req_id in failed:
                continue  # aborted while the kvmanager answered, or refused blocks
            if req.req_id in num_cached:
                num_new = self._start_after_cached(req, num_new, num_cached[req.req_id])
            block_ids = new_block_ids.get(req.req_id, [])
            if req.on_executor:
                running_reqs.append(RunningRequestData(req_id=req.req_id, new_block_ids=block_ids,
                                                       num_computed_tokens=req.num_computed_tokens))
            else:
                new_reqs.append(NewRequestData(req_id=req.req_id, token_ids=req.all_token_ids,
                                               num_prompt_tokens=req.num_prompt_tokens, sampling=req.sampling,
                                               block_ids=block_ids, num_computed_tokens=req.num_computed_tokens))
                req.on_executor = True
            num_scheduled[req.req_id] = num_new
            req.num_computed_tokens += num_new
            self.counters["num_scheduled_tokens_total"] += num_new
            kept.append((req, num_new))
        out.scheduled = kept
        finished, self.pending_finished_req_ids = self.pending_finished_req_ids, []
        self.counters["num_steps"] += 1
        copies = dict(block_copies=kv.block_copies, swap_out=kv.swap_out, swap_in=kv.swap_in) if kv else {}
        return StepPlan(step_id=out.step_id, new_reqs=new_reqs, running_reqs=running_reqs,
                        num_scheduled_tokens=num_scheduled, finished_req_ids=finished, **copies)

    def _start_after_cached(self, req: Request, num_new: int, num_cached: int) -> int:
        """A new request whose first blocks were cached starts after them; returns what is left
        of its ``num_new`` tokens to compute (the kvmanager always leaves at least one)."""
        req.num_computed_tokens = num_cached
        req.num_cached_tokens = num_cached
        self.counters["num_cached_tokens_total"] += num_cached
        return num_new - num_cached

    def _discard(self, req_id: str) -> None:
        """Its release moves to ``discard_req_ids``: the kvmanager must not index what never ran."""
        if req_id in self.pending_free_req_ids:
            self.pending_free_req_ids.remove(req_id)
            self.pending_discard_req_ids.append(req_id)

    def update_from_result(self, out: StepOutput, result: StepResult) -> list[TokenDelta]:
        """Append sampled tokens, finish requests that are done; one delta per request that moved."""
        deltas: list[TokenDelta] = []
        released = False
        prompt_lps = result.prompt_logprobs
        for idx, req_id in enumerate(result.req_ids):
            req = self.requests.get(req_id)
            if req is None:
                continue  # aborted while the step ran
            token_ids, reason = self._append(req, result.sampled_token_ids[idx])
            logprobs = result.logprobs[idx] if idx < len(result.logprobs) else None
            prompt_lp = None
            if req_id in prompt_lps and not req.prompt_logprobs_sent:
                prompt_lp, req.prompt_logprobs_sent = prompt_lps[req_id], True
            deltas.append(TokenDelta(req_id=req_id, token_ids=token_ids, logprobs=logprobs,
                                     prompt_logprobs=prompt_lp, finish_reason=reason,
                                     num_prompt_tokens=req.num_prompt_tokens,
                                     num_cached_tokens=req.num_cached_tokens))
            if reason is not None:
                self._release(req)
                released = True
                self.counters["num_requests_finished"] += 1
        for req, _ in out.scheduled:
            # caught up with its tokens yet got none: the executor failed it; never leave it stuck
            if not req.finished and req.num_computed_tokens == req.num_tokens:
                deltas.append(TokenDelta(req_id=req.req_id, token_ids=[], finish_reason="error",
                                         error="the executor did not return a token for this request",
                                         num_prompt_tokens=req.num_prompt_tokens))
                self._release(req)
                self._discard(req.req_id)  # its step failed: its blocks may hold nothing
                released = True
        if released:
            self.running = [r for r in self.running if not r.finished]
        return deltas

    def _append(self, req: Request, token_ids: list[int]) -> tuple[list[int], str | None]:
        """Append sampled tokens up to the first that ends the request."""
        for n, token_id in enumerate(token_ids, start=1):
            req.output_token_ids.append(token_id)
            self.counters["num_generation_tokens_total"] += 1
            reason = req.stop_reason(token_id)
            if reason is not None:
                return token_ids[:n], reason
        return token_ids, None

    # ------------------------------------------------------------------ admin
    def stats(self) -> dict:
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            **self.counters,
            "num_free_blocks": self.num_free_blocks + self.num_pending_free_blocks,
            "num_blocks_total": self.pool.num_blocks if self.pool else 0,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
        }

    def describe_requests(self) -> list[dict]:
        return [
            {"req_id": r.req_id, "status": "running" if r in self.running else "waiting",
             "num_prompt_tokens": r.num_prompt_tokens, "num_output_tokens": len(r.output_token_ids),
             "num_computed_tokens": r.num_computed_tokens, "num_cached_tokens": r.num_cached_tokens,
             "num_blocks": r.num_blocks}
            for r in self.requests.values()
        ]
