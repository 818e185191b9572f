"""The iteration-level batching policy, free of sockets so that it can be read (and tested) alone.

Each step every running sequence gets the tokens it needs to catch up (a decode: 1; a prefill
chunk: up to the remaining token budget, and at most ``long_prefill_token_threshold``), in queue
order, then swapped-out sequences come back and waiting ones are admitted while the budget
(``max_num_batched_tokens``), the sequence cap (``max_num_seqs``) and the free blocks allow.
Queue order is first come first served, or ``(priority, arrival)`` with the priority policy.
Without chunked prefill a prompt is computed whole: the first one of a step even beyond the
budget, the others only while they fit.

The scheduler plans with its own replica of the block allocator (``shared.kv``): ``schedule``
applies each allocator operation to it as it decides it, so it knows exact block ids, prefix-cache
hits and refusals while it plans. When a running sequence cannot grow (the allocator refuses,
changing nothing), the last one in queue order gives its blocks back and the growth is tried
again: preemption by recompute (its table is freed now, the executor drops it and it waits, first
in line, with the tokens it generated) or, with ``preemption_mode="swap"`` and room on the host
tier, by swapping (its blocks are copied to host blocks before the step; it comes back, before any
waiting request, into fresh device blocks and goes on where it stopped). Nothing new is admitted
in a step that preempted.

The operations of a step form its log (``StepOutput.ops``), in the order they were applied: the
service sends it to the kvmanager, the owner of record, which applies the same log and answers
with a state digest, without the step waiting for it (``service.py``). The service drives one step
as ``schedule`` -> ``build_plan`` -> executor -> ``update_from_result``.

A sequence new to the allocator first looks up the prefix cache: it starts after the blocks
found there (whole blocks, at least one token left to compute), and those tokens cost nothing
from the token budget nor from the free blocks beyond reviving them. Tokens reach the allocator
with each allocation (those it has not seen), so that it can hash blocks as they fill; blocks
become findable once the step that computed them ran (``KVConfirm`` at the start of the next
step). Requests that want prompt logprobs send none: they neither hit nor feed the cache, since a
cached prompt token would have no logprob.

Several sequences of one request share blocks through forks (``KVFork``): with
``n`` > 1 the first choice computes all but the last prompt token, then the others are forked
from it and each computes that last token itself and samples its own continuation (the shared,
partly filled last block is copied on the first write). Beam search (``beam.py``) keeps
``width`` beams in lockstep: once every live beam reported its top candidates, the group picks
the next beams; a beam with several children is forked, one without any is freed.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from services.scheduler.beam import BeamSearch
from services.scheduler.request import FORKING, RUNNING, SWAPPED, WAITING, Request
from shared.kv.allocator import BlockAllocator, cdiv
from shared.kv.steplog import StepLog
from shared.messages import (
    EngineRequest,
    KVAllocate,
    KVClear,
    KVConfirm,
    KVFork,
    KVFree,
    KVOp,
    KVStepRequest,
    KVSwapIn,
    KVSwapOut,
    KVTruncate,
    NewRequestData,
    PoolInfo,
    RunningRequestData,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenDelta,
)

PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")


def _key(req: Request) -> tuple[int, int, int]:
    return req.key


@dataclass
class StepOutput:
    """What ``schedule`` decided for one step, and the allocator log it applied to the replica."""

    step_id: int
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (sequence, num new tokens)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts verified this step
    ops: list[KVOp] = field(default_factory=list)  # the step log, in the order applied
    digest: bytes = b""  # the replica's state digest after it
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)


@dataclass(eq=False)
class BeamGroup:
    """One beam-search request: its live beams (sequences), the choices that receive the best."""

    req_id: str
    choice_ids: list[str]
    search: BeamSearch
    sampling: SamplingParams  # what each beam runs with: greedy, top-2W logprobs
    live: dict[int, Request] = field(default_factory=dict)  # beam id -> sequence
    candidates: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    width: int = 1
    num_prompt_tokens: int = 0
    queue_time: float | None = None


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int | None = None, *,
                 enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                 preemption_mode: str = "recompute", scheduling_policy: str = "fcfs"):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {scheduling_policy!r}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = max(0, long_prefill_token_threshold)
        self.preemption_mode = preemption_mode
        self.scheduling_policy = scheduling_policy
        self.max_model_len_limit = max_model_len
        self.max_model_len: int | None = max_model_len
        self.pool: PoolInfo | None = None
        self.kv: StepLog | None = None  # the allocator replica, set with the pool
        # the queues, each kept in queue order (``Request.key``)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.unforked: list[Request] = []  # new beams, forked from their parent in the next call
        self.requests: dict[str, Request] = {}  # every sequence by req_id (beams by their own ids)
        self.groups: dict[str, BeamGroup] = {}  # beam searches by each of their choice ids
        # applied at the start of the next step (``_settle``)
        self.pending_free_req_ids: list[str] = []
        self.pending_discard_req_ids: list[str] = []  # the same, for tables whose last growth never ran
        self.pending_truncate: list[tuple[str, int]] = []
        self.pending_clear = False  # ``folio kv clear``: a KVClear in the next log
        self.num_cache_blocks_cleared = 0
        self.pending_finished_req_ids: list[str] = []  # for the next StepPlan
        self.spec_accepted_per_pos: list[int] = []  # speculative decoding: accepted drafts by position
        self.next_step_id = 0
        self.next_arrival = 0
        self.draining = False
        self.max_num_running = 0
        self.last_batch_size = 0
        self.last_num_scheduled_tokens = 0
        self.counters = dict(num_steps=0, num_preemptions=0, num_swap_outs=0, num_swap_ins=0, num_forks=0,
                             num_prompt_tokens_total=0, num_generation_tokens_total=0,
                             num_requests_finished=0, num_requests_aborted=0, num_requests_rejected=0,
                             num_executor_restarts=0, num_epochs=0, num_digest_mismatches=0, num_scheduled_tokens_total=0, num_scheduled_seqs_total=0,
                             num_cached_tokens_total=0, num_spec_drafts=0, num_spec_draft_tokens=0,
                             num_spec_accepted_tokens=0)

    # ------------------------------------------------------------------ pool
    def set_pool(self, info: PoolInfo) -> None:
        """A fresh, empty replica of the allocator for ``info``'s pool."""
        self.pool = info
        self.kv = StepLog(BlockAllocator(info.num_blocks, info.block_size, info.num_host_blocks,
                                         enable_prefix_caching=info.enable_prefix_caching, record_events=False))
        limits = [n for n in (self.max_model_len_limit, info.max_model_len) if n]
        self.max_model_len = min(limits) if limits else None

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def alloc(self) -> BlockAllocator:
        return self.kv.alloc

    def clear_cache(self) -> None:
        """``folio kv clear``: both allocators drop their free cached blocks in the next step."""
        self.pending_clear = True

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, msg: EngineRequest) -> list[TokenDelta]:
        """Queue a request (with its choices); one that can never run is refused with "error" deltas."""
        error, code = self._refusal(msg)
        if error is not None:
            self.counters["num_requests_rejected"] += 1
            return [TokenDelta(req_id=req_id, token_ids=[], finish_reason="error", error=error, error_code=code,
                               num_prompt_tokens=len(msg.prompt_token_ids))
                    for req_id in (msg.req_id, *msg.fork_req_ids)]
        priority = msg.priority if self.scheduling_policy == "priority" else 0
        arrival, self.next_arrival = self.next_arrival, self.next_arrival + 1
        if msg.beam_search is not None:
            self._add_beam_search(msg, priority, arrival)
            return []
        first = Request.from_message(msg)
        first.key = (priority, arrival, 0)
        others = [Request.from_message(msg, req_id, msg.sampling.with_seed_offset(i))
                  for i, req_id in enumerate(msg.fork_req_ids, start=1)]
        for i, req in enumerate(others, start=1):
            req.key = (priority, arrival, i)
            self.requests[req.req_id] = req
        # forking needs a computed prefix to share; prompt logprobs are per choice
        if len(first.prompt_token_ids) > 1 and msg.sampling.prompt_logprobs is None:
            for req in others:
                req.status, req.fork_parent = FORKING, first
            first.pending_forks = others
            others = []
        self.requests[first.req_id] = first
        for req in (first, *others):
            self._enqueue(self.waiting, req, WAITING)
        return []

    def _add_beam_search(self, msg: EngineRequest, priority: int, arrival: int) -> None:
        params = msg.beam_search
        eos = set(msg.sampling.stop_token_ids)
        if msg.eos_token_id is not None and not msg.sampling.ignore_eos:
            eos.add(msg.eos_token_id)
        search = BeamSearch(params.width, length_penalty=params.length_penalty,
                            early_stopping=params.early_stopping, max_tokens=msg.sampling.max_tokens,
                            eos_token_ids=eos)
        # every beam runs greedy and reports its top raw logprobs; the group picks its tokens
        sampling = SamplingParams(temperature=0.0, max_tokens=msg.sampling.max_tokens, ignore_eos=True,
                                  logprobs=search.top_k)
        group = BeamGroup(req_id=msg.req_id, choice_ids=[msg.req_id, *msg.fork_req_ids], search=search,
                          sampling=sampling, width=params.width, num_prompt_tokens=len(msg.prompt_token_ids))
        beam = self._new_beam(group, search.beams[0].beam_id, msg.prompt_token_ids, [], (priority, arrival))
        beam.arrival_time = msg.arrival_time
        for choice_id in group.choice_ids:
            self.groups[choice_id] = group
        self._enqueue(self.waiting, beam, WAITING)

    def _new_beam(self, group: BeamGroup, beam_id: int, prompt: list[int], output: list[int],
                  order: tuple[int, int]) -> Request:
        beam = Request(req_id=f"{group.req_id}#beam{beam_id}", prompt_token_ids=list(prompt), sampling=group.sampling,
                       output_token_ids=list(output), append_sampled=False, group=group, key=(*order, beam_id))
        group.live[beam_id] = beam
        self.requests[beam.req_id] = beam
        return beam

    def _refusal(self, msg: EngineRequest) -> tuple[str | None, int]:
        num_prompt, max_tokens = len(msg.prompt_token_ids), msg.sampling.max_tokens
        if self.draining:
            return "the server is draining: it admits no new requests", 503
        ids = [msg.req_id, *msg.fork_req_ids]
        if len(set(ids)) != len(ids) or any(i in self.requests or i in self.groups for i in ids):
            return f"request id {msg.req_id!r} (or one of its choices) is already in use", 400
        if num_prompt == 0:
            return "the prompt is empty", 400
        if max_tokens < 1:
            return f"max_tokens must be at least 1, got {max_tokens}", 400
        if msg.beam_search is not None and not 1 <= len(ids) <= msg.beam_search.width:
            return f"beam search returns at most its width ({msg.beam_search.width}) choices, {len(ids)} asked", 400
        num_seqs = msg.beam_search.width if msg.beam_search is not None else len(ids)
        if num_seqs > self.max_num_seqs:
            return (f"the request runs {num_seqs} sequences at once (its choices or beams) but the server runs at "
                    f"most {self.max_num_seqs} (--max-num-seqs)"), 400
        if self.max_model_len and num_prompt + max_tokens > self.max_model_len:
            return (f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                    f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} in the "
                    "completion). Please reduce the length of the prompt or completion."), 400
        # the last sampled token is never fed back, so its KV needs no slot
        need = cdiv(num_prompt + max_tokens - 1, self.block_size)
        if need > self.pool.num_blocks:
            return (f"the request needs {need} KV blocks ({num_prompt} prompt + {max_tokens} completion tokens) "
                    f"but the whole KV cache holds {self.pool.num_blocks}"), 400
        return None, 400

    def abort(self, req_id: str) -> bool:
        """Drop a request (all of a beam search, whichever choice is named); its blocks go back in
        the next step."""
        group = self.groups.get(req_id)
        if group is not None:
            self._end_group(group)
            self.counters["num_requests_aborted"] += 1
            return True
        req = self.requests.get(req_id)
        if req is None:
            return False
        if req.group is not None:  # one beam named by its own id: the whole search goes
            self._end_group(req.group)
        elif req.status == FORKING:  # a choice not forked yet
            req.fork_parent.pending_forks.remove(req)
            del self.requests[req_id]
        else:
            self._orphan_forks(req)
            self._dequeue(req)
            self._release(req)
        self.counters["num_requests_aborted"] += 1
        return True

    def _orphan_forks(self, req: Request) -> None:
        """A first choice going away before its forks: the others start on their own."""
        for child in req.pending_forks:
            child.fork_parent = None
            self._enqueue(self.waiting, child, WAITING)
        req.pending_forks = []

    def _end_group(self, group: BeamGroup) -> None:
        for beam in group.live.values():
            if beam.status == FORKING:
                self.unforked.remove(beam)
                del self.requests[beam.req_id]
            else:
                self._dequeue(beam)
                self._release(beam)
        group.live = {}
        for choice_id in group.choice_ids:
            self.groups.pop(choice_id, None)

    def _enqueue(self, queue: list[Request], req: Request, status: str) -> None:
        req.status = status
        bisect.insort(queue, req, key=_key)

    def _dequeue(self, req: Request) -> None:
        queue = {RUNNING: self.running, WAITING: self.waiting, SWAPPED: self.swapped}[req.status]
        queue.remove(req)

    def _release(self, req: Request) -> None:
        """A sequence that is done: its blocks go at the start of the next step, its state in the next plan."""
        req.finished = True
        del self.requests[req.req_id]
        self.pending_free_req_ids.append(req.req_id)
        if req.on_executor:
            self.pending_finished_req_ids.append(req.req_id)

    def _preempt(self, req: Request) -> None:
        """``req`` gives its device blocks back now: swapped to the host tier when the mode says so
        and there is room, else freed (it starts over by recompute)."""
        self.running.remove(req)
        self.counters["num_preemptions"] += 1
        if req.on_executor:
            self.pending_finished_req_ids.append(req.req_id)
            req.on_executor = False
        req.spec_token_ids = []  # the executor forgets its proposal with it
        seq = self.alloc.seqs.get(req.req_id)
        if (self.preemption_mode == "swap" and seq is not None and seq.block_ids
                and len(seq.block_ids) <= self.alloc.host.num_free_blocks):
            self.kv.try_apply(KVSwapOut(req.req_id))
            self.counters["num_swap_outs"] += 1
            self._enqueue(self.swapped, req, SWAPPED)
            return
        self.kv.try_apply(KVFree([req.req_id]))
        req.reset_for_recompute()
        self._enqueue(self.waiting, req, WAITING)

    def new_epoch(self, info: PoolInfo) -> int:
        """Start over with empty tables (the executor restarted, the kvmanager restarted, or its
        state digest differed from the replica's): a fresh replica for ``info``'s pool, and every
        running or swapped sequence starts over by recompute, first in line, keeping its tokens.
        The executor is told to drop what it holds. Returns how many start over."""
        restart = self.running + self.swapped
        self.running, self.swapped = [], []
        self.pending_finished_req_ids += [r.req_id for r in (*restart, *self.waiting) if r.on_executor]
        for req in restart:
            req.reset_for_recompute()
            self._enqueue(self.waiting, req, WAITING)
        for req in self.waiting:
            req.on_executor = False
            req.num_computed_tokens = 0
        self.pending_free_req_ids, self.pending_discard_req_ids, self.pending_truncate = [], [], []
        self.set_pool(info)
        self.counters["num_epochs"] += 1
        return len(restart)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.swapped or self.unforked or self.pending_free_req_ids
                    or self.pending_finished_req_ids or self.pending_discard_req_ids or self.pending_truncate
                    or self.pending_clear)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> StepOutput | None:
        """Pick this step's work, applying its allocator operations to the replica as it goes;
        None when there is nothing to compute and nothing to tell the kvmanager or the executor."""
        out = StepOutput(step_id=self.next_step_id)
        self._settle()
        self._issue_forks()
        budget = self.max_num_batched_tokens
        preempted = False
        whole_prefill_taken = False  # without chunked prefill: the first whole prompt may pass the budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._num_new_tokens(req, budget, whole_prefill_taken)
            if not num_new:
                i += 1
                continue
            grown = self._grow(req, num_new)
            while not grown and (victim := self._victim(i)) is not None:
                self._preempt(victim)
                preempted = True
                grown = self._grow(req, num_new)
            if not grown:
                self._preempt(req)  # nothing later in line was left to give way
                preempted = True
                continue
            whole_prefill_taken |= num_new > 1
            self._take(out, req, num_new)
            budget -= num_new
            i += 1
        num_seqs = self._num_seqs()
        while self.swapped and budget > 0 and not preempted:
            req = self.swapped[0]
            num_new = self._num_new_tokens(req, budget, whole_prefill_taken)
            num_host = len(self.alloc.seqs[req.req_id].host_block_ids)
            need = max(num_host, cdiv(req.num_computed_tokens + num_new, self.block_size))
            if num_seqs + 1 > self.max_num_seqs or need > self.alloc.num_free_blocks:
                break
            self.swapped.pop(0)
            self.kv.try_apply(KVSwapIn(req.req_id))
            self.counters["num_swap_ins"] += 1
            self._enqueue(self.running, req, RUNNING)
            if num_new and self._grow(req, num_new):
                self._take(out, req, num_new)
                budget -= num_new
            num_seqs += 1
        while self.waiting and budget > 0 and not preempted and not self.swapped:
            req = self.waiting[0]
            self._find_cached(req)
            num_new = self._num_new_tokens(req, budget, whole_prefill_taken)
            cost = self._seq_cost(req)
            # nobody overtakes the head of the queue; without chunked prefill a prompt that does
            # not fit waits for the next step
            if not num_new or num_seqs + cost > self.max_num_seqs or not self._grow(req, num_new):
                req.num_computed_tokens = req.num_cached_tokens = 0
                break
            self.waiting.pop(0)
            self._enqueue(self.running, req, RUNNING)
            num_seqs += cost
            if not req.admitted:
                req.admitted = True
                self.counters["num_prompt_tokens_total"] += req.num_prompt_tokens
            self.counters["num_cached_tokens_total"] += req.num_cached_tokens
            whole_prefill_taken |= num_new > 1
            self._take(out, req, num_new)
            budget -= num_new
        self.max_num_running = max(self.max_num_running, len(self.running))
        out.ops, (out.block_copies, out.swap_out, out.swap_in), out.digest = self.kv.seal()
        if not (out.scheduled or out.ops or self.pending_finished_req_ids):
            return None
        self.next_step_id += 1
        return out

    def _settle(self) -> None:
        """What waited for this step, in the log's fixed order: tables shrunk after rejected drafts,
        the last step's allocations confirmed as computed, releases, a cache clear."""
        alloc = self.alloc
        for req_id, num_tokens in self.pending_truncate:
            if self.kv.try_apply(KVTruncate(req_id, num_tokens)) and req_id in self.requests:
                self.requests[req_id].table_changed = True
        if alloc.unconfirmed:
            self.kv.try_apply(KVConfirm(self.pending_discard_req_ids))
        released = self.pending_free_req_ids + self.pending_discard_req_ids
        if released:
            self.kv.try_apply(KVFree(released))
        if self.pending_clear:
            self.num_cache_blocks_cleared = self.kv.try_apply(KVClear())
        self.pending_truncate, self.pending_free_req_ids, self.pending_discard_req_ids = [], [], []
        self.pending_clear = False

    def _find_cached(self, req: Request) -> None:
        """A sequence new to the allocator starts after the blocks the prefix cache holds for it;
        those tokens cost nothing from the token budget. Requests that want prompt logprobs
        neither hit nor feed the cache (a cached prompt token would have no logprob)."""
        if req.req_id in self.alloc.seqs or req.sampling.prompt_logprobs is not None:
            return
        end = req.num_prompt_tokens - 1 if req.pending_forks else req.num_tokens
        # at least one token is left to compute: the last one, which samples
        num_blocks = self.alloc.num_cached_blocks(req.all_token_ids, req.cache_salt, (end - 1) // self.block_size)
        req.num_computed_tokens = req.num_cached_tokens = num_blocks * self.block_size

    def _grow(self, req: Request, num_new: int) -> bool:
        """Make room in ``req``'s table for its next ``num_new`` tokens (False: refused, nothing
        changed). The tokens the allocator has not seen ride along, so that it hashes the blocks
        they fill; draft tokens are not known until accepted."""
        alloc, start = self.alloc, req.num_computed_tokens
        end = start + num_new
        if not alloc.changes_table(req.req_id, start, end):
            return True
        is_new = req.req_id not in alloc.seqs
        known = min(end, req.num_tokens) if req.sampling.prompt_logprobs is None else req.num_kv_token_ids
        num_copies = len(alloc.block_copies)
        op = KVAllocate(req.req_id, start, end, req.token_slice(req.num_kv_token_ids, known),
                        req.cache_salt if is_new else None)
        if self.kv.try_apply(op) is None:
            return False
        req.num_kv_token_ids = max(req.num_kv_token_ids, known)
        if len(alloc.block_copies) > num_copies:
            req.table_changed = True  # copy-on-write replaced a block inside its table
        return True

    def _num_new_tokens(self, req: Request, budget: int, whole_prefill_taken: bool) -> int:
        """Tokens ``req`` computes this step (0: none, or its whole prompt does not fit)."""
        end = req.num_tokens
        if req.pending_forks:
            end = req.num_prompt_tokens - 1  # its choices fork off before the last prompt token
        remaining = end - req.num_computed_tokens
        if remaining == 1 and req.spec_token_ids and req.on_executor:  # a decode that verifies its drafts
            # (the executor holds the proposal: a request it dropped, swapped or new, has none)
            left = req.sampling.max_tokens - len(req.output_token_ids)  # it gains at most drafts + 1
            room = (self.max_model_len or 1 << 30) - req.num_tokens
            return 1 + max(0, min(len(req.spec_token_ids), left - 1, room, budget - 1))
        if remaining <= 1:
            return max(remaining, 0)
        if not self.enable_chunked_prefill:
            return remaining if remaining <= budget or not whole_prefill_taken else 0
        if self.long_prefill_token_threshold:
            remaining = min(remaining, self.long_prefill_token_threshold)
        return min(remaining, budget)

    def _victim(self, i: int) -> Request | None:
        """The last sequence in queue order after position ``i`` (not yet scheduled this step)."""
        return self.running[-1] if len(self.running) - 1 > i else None

    def _seq_cost(self, req: Request) -> int:
        """Against ``max_num_seqs``: a request with choices to fork counts them; a beam search
        counts its width once, whichever beam is admitted first."""
        if req.group is None:
            return req.num_seqs
        return 0 if any(r.group is req.group for r in self.running) else req.group.width

    def _num_seqs(self) -> int:
        groups = {r.group for r in self.running if r.group is not None}
        return sum(r.num_seqs for r in self.running if r.group is None) + sum(g.width for g in groups)

    def _take(self, out: StepOutput, req: Request, num_new: int) -> None:
        out.scheduled.append((req, num_new))
        if num_new > 1 and req.num_tokens - req.num_computed_tokens == 1:
            out.spec_token_ids[req.req_id] = req.spec_token_ids[:num_new - 1]
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.time()

    # ------------------------------------------------------------------ forks
    def _issue_forks(self) -> None:
        """Fork the choices of first choices that computed all but their last prompt token, and
        the new beams of the last step. A child whose parent lost its table starts on its own."""
        for req in list(self.running):
            if req.pending_forks and req.num_computed_tokens == req.num_prompt_tokens - 1 and self._holds_table(req):
                for child in req.pending_forks:
                    self._fork(req, child)
                req.pending_forks = []
        unforked, self.unforked = self.unforked, []
        for child in unforked:
            parent = child.fork_parent
            if parent.status == RUNNING and not parent.finished and self._holds_table(parent):
                self._fork(parent, child)
            else:
                child.reset_for_recompute()
                self._enqueue(self.waiting, child, WAITING)

    def _holds_table(self, req: Request) -> bool:
        seq = self.alloc.seqs.get(req.req_id)
        return seq is not None and bool(seq.block_ids)

    def _fork(self, parent: Request, child: Request) -> None:
        self.kv.try_apply(KVFork(parent.req_id, child.req_id, parent.num_computed_tokens))
        child.fork_parent = None
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_kv_token_ids = parent.num_kv_token_ids
        child.admitted = True
        child.arrival_time, child.first_scheduled_time = parent.arrival_time, parent.first_scheduled_time
        self.counters["num_forks"] += 1
        self._enqueue(self.running, child, RUNNING)

    # ------------------------------------------------------------------ the executor's plan
    def build_plan(self, out: StepOutput) -> StepPlan:
        """The executor's per-step diff: new sequences in full, running ones as the blocks they
        gained (their whole table when blocks inside it changed) and their counts."""
        alloc = self.alloc
        new_reqs, running_reqs, num_scheduled = [], [], {}
        for req, num_new in out.scheduled:
            table = alloc.seqs[req.req_id].block_ids
            if req.on_executor:
                changed = req.table_changed
                running_reqs.append(RunningRequestData(
                    req_id=req.req_id, new_block_ids=[] if changed else table[req.num_sent_blocks:],
                    num_computed_tokens=req.num_computed_tokens, new_token_ids=req.unsent_token_ids,
                    block_ids=list(table) if changed else None))
            else:
                new_reqs.append(NewRequestData(
                    req_id=req.req_id, token_ids=req.all_token_ids, num_prompt_tokens=req.num_prompt_tokens,
                    sampling=req.sampling, block_ids=list(table), num_computed_tokens=req.num_computed_tokens,
                    append_sampled=req.append_sampled))
                req.on_executor = True
            req.unsent_token_ids, req.num_sent_blocks, req.table_changed = [], len(table), False
            num_scheduled[req.req_id] = num_new
            req.num_computed_tokens += num_new
        finished, self.pending_finished_req_ids = self.pending_finished_req_ids, []
        c = self.counters
        c["num_steps"] += 1
        c["num_scheduled_seqs_total"] += len(out.scheduled)
        self.last_batch_size, self.last_num_scheduled_tokens = len(out.scheduled), sum(num_scheduled.values())
        c["num_scheduled_tokens_total"] += self.last_num_scheduled_tokens
        return StepPlan(step_id=out.step_id, new_reqs=new_reqs, running_reqs=running_reqs,
                        num_scheduled_tokens=num_scheduled, finished_req_ids=finished,
                        spec_token_ids=out.spec_token_ids, block_copies=out.block_copies,
                        swap_out=out.swap_out, swap_in=out.swap_in)

    def kv_request(self, out: StepOutput, generation: int) -> KVStepRequest:
        return KVStepRequest(step_id=out.step_id, generation=generation, ops=out.ops)

    def _discard(self, req_id: str) -> None:
        """Its release becomes a discard: the allocator must not index what never ran."""
        if req_id in self.pending_free_req_ids:
            self.pending_free_req_ids.remove(req_id)
            self.pending_discard_req_ids.append(req_id)

    # ------------------------------------------------------------------ the executor's answer
    def update_from_result(self, out: StepOutput, result: StepResult) -> list[TokenDelta]:
        """Append sampled tokens, finish requests that are done; one delta per request that moved."""
        deltas: list[TokenDelta] = []
        released = False
        prompt_lps = result.prompt_logprobs
        reported: set[str] = set()
        groups: list[BeamGroup] = []
        for idx, req_id in enumerate(result.req_ids):
            req = self.requests.get(req_id)
            if req is None or req.finished:
                continue  # aborted while the step ran
            reported.add(req_id)
            logprobs = result.logprobs[idx] if idx < len(result.logprobs) else None
            if req.group is not None:
                if logprobs:
                    self._report_beam(req, logprobs[-1], groups)
                continue
            sampled = result.sampled_token_ids[idx]
            drafts = out.spec_token_ids.get(req_id)
            if drafts:
                self._count_accepted(len(drafts), len(sampled) - 1)
            req.spec_token_ids = result.spec_token_ids[idx] if idx < len(result.spec_token_ids) else []
            token_ids, reason = self._append(req, sampled)
            prompt_lp = None
            if req_id in prompt_lps and not req.prompt_logprobs_sent:
                prompt_lp, req.prompt_logprobs_sent = prompt_lps[req_id], True
            deltas.append(TokenDelta(req_id=req_id, token_ids=token_ids, logprobs=logprobs,
                                     prompt_logprobs=prompt_lp, finish_reason=reason,
                                     num_prompt_tokens=req.num_prompt_tokens,
                                     num_cached_tokens=req.num_cached_tokens,
                                     queue_time_s=None if req.queue_time_sent else self._queue_time(req)))
            if reason is not None:
                self._release(req)
                released = True
                self.counters["num_requests_finished"] += 1
            elif drafts:
                self._roll_back(req)
        for group in groups:
            deltas.extend(self._advance_beams(group))
            released = True
        for req, _ in out.scheduled:
            # caught up with its tokens yet got none: the executor failed it; never leave it stuck
            if not req.finished and req.num_computed_tokens >= req.num_tokens and req.req_id not in reported:
                deltas.extend(self._fail(req))
                released = True
        if released:
            self.running = [r for r in self.running if not r.finished]
        return deltas

    def _count_accepted(self, num_drafts: int, num_accepted: int) -> None:
        c = self.counters
        c["num_spec_drafts"] += 1
        c["num_spec_draft_tokens"] += num_drafts
        c["num_spec_accepted_tokens"] += num_accepted
        per_pos = self.spec_accepted_per_pos
        per_pos.extend([0] * (num_drafts - len(per_pos)))
        for pos in range(num_accepted):
            per_pos[pos] += 1

    def _roll_back(self, req: Request) -> None:
        """After verification the KV of the last token and the accepted drafts is kept; the
        rejected drafts' slots are not: the table shrinks back first thing in the next step
        (``KVTruncate``), and the executor then gets it whole."""
        req.num_computed_tokens = req.num_tokens - 1
        seq = self.alloc.seqs.get(req.req_id)
        if seq is not None and len(seq.block_ids) > cdiv(req.num_computed_tokens, self.block_size):
            self.pending_truncate.append((req.req_id, req.num_computed_tokens))

    def _queue_time(self, req: Request) -> float | None:
        if req.queue_time_sent or req.first_scheduled_time is None or not req.arrival_time:
            return None
        req.queue_time_sent = True
        return max(0.0, req.first_scheduled_time - req.arrival_time)

    def _fail(self, req: Request) -> list[TokenDelta]:
        error = "the executor did not return a token for this request"
        if req.group is not None:
            group = req.group
            self._end_group(group)
            ids = group.choice_ids
        else:
            self._release(req)
            ids = [req.req_id]
        self._discard(req.req_id)  # its step failed: its blocks may hold nothing
        return [TokenDelta(req_id=i, token_ids=[], finish_reason="error", error=error,
                           num_prompt_tokens=req.num_prompt_tokens) for i in ids]

    def _append(self, req: Request, token_ids: list[int]) -> tuple[list[int], str | None]:
        """Append sampled tokens up to the first that ends the request."""
        for n, token_id in enumerate(token_ids, start=1):
            req.output_token_ids.append(token_id)
            self.counters["num_generation_tokens_total"] += 1
            reason = req.stop_reason(token_id)
            if reason is not None:
                return token_ids[:n], reason
        return token_ids, None

    # ------------------------------------------------------------------ beams
    def _report_beam(self, beam: Request, lp, groups: list[BeamGroup]) -> None:
        group = beam.group
        beam_id = next(b for b, r in group.live.items() if r is beam)
        group.candidates[beam_id] = (lp.top_token_ids, lp.top_logprobs)
        if len(group.candidates) == len(group.live) and group not in groups:
            groups.append(group)

    def _advance_beams(self, group: BeamGroup) -> list[TokenDelta]:
        """Every live beam reported: the search picks the next beams. A parent's first child goes
        on in its sequence, the others are forked from it in the next call; a parent without
        children is freed. Returns the choices' deltas once the search is over."""
        decision = group.search.step(group.candidates)
        group.candidates = {}
        self.counters["num_generation_tokens_total"] += len(group.live)
        if group.queue_time is None:
            group.queue_time = self._queue_time(next(iter(group.live.values()))) or 0.0
        if group.search.done:
            self._end_group(group)
            self.counters["num_requests_finished"] += len(group.choice_ids)
            results = group.search.results(len(group.choice_ids))
            return [TokenDelta(req_id=choice_id, token_ids=list(tokens), finish_reason=reason,
                               num_prompt_tokens=group.num_prompt_tokens,
                               queue_time_s=group.queue_time or None)
                    for choice_id, (tokens, _score, reason) in zip(group.choice_ids, results)]
        children: dict[int, list] = {}
        for beam in decision.beams:
            children.setdefault(beam.parent_beam_id, []).append(beam)
        old, group.live = group.live, {}
        for parent_id, parent in old.items():
            kids = children.get(parent_id, [])
            if not kids:
                self._dequeue(parent)
                self._release(parent)
                continue
            base = list(parent.output_token_ids)
            for n, kid in enumerate(kids):
                token = kid.output_token_ids[-1]
                if n == 0:
                    parent.output_token_ids.append(token)
                    parent.unsent_token_ids.append(token)
                    group.live[kid.beam_id] = parent
                    continue
                child = self._new_beam(group, kid.beam_id, parent.prompt_token_ids, base + [token], parent.key[:2])
                child.status, child.fork_parent = FORKING, parent
                self.unforked.append(child)
        return []

    # ------------------------------------------------------------------ admin
    def stats(self) -> dict:
        c, steps = self.counters, max(1, self.counters["num_steps"])
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting) + sum(len(r.pending_forks) for r in self.waiting),
            "num_swapped": len(self.swapped),
            **c,
            "num_free_blocks": self.alloc.num_free_blocks,
            "num_blocks_total": self.pool.num_blocks if self.pool else 0,
            "num_free_host_blocks": self.alloc.host.num_free_blocks,
            "max_num_running": self.max_num_running,
            "last_batch_size": self.last_batch_size,
            "mean_batch_size": c["num_scheduled_seqs_total"] / steps,
            "last_token_budget_use": self.last_num_scheduled_tokens / self.max_num_batched_tokens,
            "mean_token_budget_use": c["num_scheduled_tokens_total"] / steps / self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "enable_chunked_prefill": self.enable_chunked_prefill,
            "long_prefill_token_threshold": self.long_prefill_token_threshold,
            "preemption_mode": self.preemption_mode,
            "scheduling_policy": self.scheduling_policy,
            "draining": self.draining,
            "spec_accepted_per_pos": list(self.spec_accepted_per_pos),
            "spec_acceptance_rate": (self.counters["num_spec_accepted_tokens"]
                                     / max(1, self.counters["num_spec_draft_tokens"])),
            "spec_mean_accepted_length": 1 + (self.counters["num_spec_accepted_tokens"]
                                              / max(1, self.counters["num_spec_drafts"])),
        }

    def describe_requests(self) -> list[dict]:
        return [
            {"req_id": r.req_id, "status": r.status, "priority": r.key[0],
             "num_prompt_tokens": r.num_prompt_tokens, "num_output_tokens": len(r.output_token_ids),
             "num_computed_tokens": r.num_computed_tokens, "num_cached_tokens": r.num_cached_tokens,
             "num_blocks": len(self.alloc.block_table(r.req_id)), "beam_of": r.group.req_id if r.group is not None else None}
            for r in self.requests.values()
        ]
