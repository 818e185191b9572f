"""The iteration-level batching policy, free of sockets so that it can be read (and tested) alone.

Each step every running sequence gets the tokens it needs to catch up (a decode: 1; a prefill
chunk: up to the remaining token budget, and at most ``long_prefill_token_threshold``), in queue
order, then swapped-out sequences come back and waiting ones are admitted while the budget
(``max_num_batched_tokens``), the sequence cap (``max_num_seqs``) and the free blocks allow.
Queue order is first come first served, or ``(priority, arrival)`` with the priority policy.
Without chunked prefill a prompt is computed whole: the first one of a step even beyond the
budget, the others only while they fit.

When a running sequence cannot grow, the last one in queue order gives its blocks back:
preemption by recompute (its blocks are freed in this step's kvmanager call, frees come before
allocations, the executor drops it and it waits, first in line, with the tokens it generated) or,
with ``preemption_mode="swap"`` and room on the host tier, by swapping (its blocks are copied to
host blocks in this step's call; it comes back, before any waiting request, into fresh device
blocks and goes on where it stopped). Nothing new is admitted in a step that preempted.

The service drives one step as ``schedule`` -> kvmanager -> ``build_plan`` -> executor ->
``update_from_result``. Free blocks are mirrored here, so the one kvmanager call normally succeeds;
when it does not, the sequences it refused start over by recompute instead of crashing anything.

Prefix caching keeps that one call per step. A sequence new to the kvmanager is budgeted as if
nothing were cached: ``num_new`` tokens from 0, ``cdiv(num_new, block_size)`` blocks. Its
allocation entry carries its token ids, the kvmanager looks them up and answers how many tokens
its first blocks already hold (``KVStepReply.num_cached_tokens``, whole blocks, capped so that at
least one token of the entry is left to compute). ``build_plan`` then starts the sequence there.
A hit never takes more free blocks than were counted; a released sequence is counted as giving
back only the blocks no other table holds (``KVStepReply.num_shared_blocks``). Tokens reach the
kvmanager with each allocation (``new_token_ids``: those it has not seen), so that it can hash
blocks as they fill. Requests that want prompt logprobs send none: they neither hit nor feed the
cache, since a cached prompt token would have no logprob.

Several sequences of one request share blocks through forks (``KVStepRequest.forks``): with
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

from services.kvmanager.allocator import cdiv
from services.scheduler.beam import BeamSearch
from services.scheduler.request import FORKING, RUNNING, SWAPPED, WAITING, Request
from shared.messages import (
    EngineRequest,
    KVStepReply,
    KVStepRequest,
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
    """What ``schedule`` decided for one step, before the kvmanager gave block ids."""

    step_id: int
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (sequence, num new tokens)
    free_req_ids: list[str] = field(default_factory=list)
    allocate: list[tuple[str, int]] = field(default_factory=list)  # (req_id, num tokens in total)
    num_new_blocks: dict[str, int] = field(default_factory=dict)  # what each allocation should add
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)  # tokens the kvmanager has not seen
    cache_salts: dict[str, str] = field(default_factory=dict)
    discard_req_ids: list[str] = field(default_factory=list)  # freed, their last allocation never computed
    forks: list[tuple[str, str, int]] = field(default_factory=list)  # (parent, child, parent's tokens)
    swap_out_req_ids: list[str] = field(default_factory=list)
    swap_in_req_ids: list[str] = field(default_factory=list)
    truncate: list[tuple[str, int]] = field(default_factory=list)  # tables shrunk after rejected drafts
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts verified this step
    # each fork parent's shares_last_block before this step's forks, to restore if they are undone
    parents_sharing: dict[str, bool] = field(default_factory=dict)

    def kv_request(self) -> KVStepRequest:
        return KVStepRequest(step_id=self.step_id, free_req_ids=self.free_req_ids, allocate=self.allocate,
                             discard_req_ids=self.discard_req_ids, new_token_ids=self.new_token_ids,
                             cache_salts=self.cache_salts, forks=self.forks,
                             swap_out_req_ids=self.swap_out_req_ids, swap_in_req_ids=self.swap_in_req_ids,
                             truncate=self.truncate)


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
        # Free blocks as the kvmanager will see them once our allocations land, plus the blocks of
        # sequences whose release waits for the next kvmanager call.
        self.num_free_blocks = 0
        self.num_pending_free_blocks = 0
        self.num_free_host_blocks = 0  # host blocks are never shared or cached: an exact mirror
        # the queues, each kept in queue order (``Request.key``)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.unforked: list[Request] = []  # new beams, forked from their parent in the next call
        self.requests: dict[str, Request] = {}  # every sequence by req_id (beams by their own ids)
        self.groups: dict[str, BeamGroup] = {}  # beam searches by each of their choice ids
        self.pending_free_req_ids: list[str] = []  # for the next kvmanager call
        self.pending_discard_req_ids: list[str] = []  # the same, for tables whose last growth never ran
        self.pending_finished_req_ids: list[str] = []  # for the next StepPlan
        self.pending_truncate: list[tuple[str, int]] = []  # for the next kvmanager call
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
                             num_executor_restarts=0, num_scheduled_tokens_total=0, num_scheduled_seqs_total=0,
                             num_cached_tokens_total=0, num_spec_drafts=0, num_spec_draft_tokens=0,
                             num_spec_accepted_tokens=0)

    # ------------------------------------------------------------------ pool
    def set_pool(self, info: PoolInfo) -> None:
        self.pool = info
        self.num_free_blocks = info.num_free_blocks
        self.num_free_host_blocks = info.num_host_blocks
        limits = [n for n in (self.max_model_len_limit, info.max_model_len) if n]
        self.max_model_len = min(limits) if limits else None

    @property
    def block_size(self) -> int:
        return self.pool.block_size

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
        """A sequence that is done: its blocks go in the next kvmanager call, its state in the next plan."""
        req.finished = True
        del self.requests[req.req_id]
        self.pending_free_req_ids.append(req.req_id)
        if req.on_executor:
            self.pending_finished_req_ids.append(req.req_id)
        if req.status == SWAPPED:
            self.num_free_host_blocks += req.num_blocks
        else:
            self.num_pending_free_blocks += req.num_blocks - req.num_shared_blocks

    def _preempt(self, req: Request, out: StepOutput | None = None) -> None:
        """``req`` gives its device blocks back: swapped to the host tier when the mode says so and
        there is room, else by recompute."""
        self.running.remove(req)
        self.counters["num_preemptions"] += 1
        fork = next((f for f in out.forks if f[1] == req.req_id), None) if out is not None else None
        if fork is not None:  # forked in this very call: undo it, it starts on its own
            out.forks.remove(fork)
            parent = self.requests.get(fork[0])
            if parent is not None and not any(f[0] == fork[0] for f in out.forks):
                parent.shares_last_block = out.parents_sharing[fork[0]]  # nobody shares it after all
            req.reset_for_recompute()
            self._enqueue(self.waiting, req, WAITING)
            return
        if req.on_executor:
            self.pending_finished_req_ids.append(req.req_id)
            req.on_executor = False
        self.num_pending_free_blocks += req.num_blocks - req.num_shared_blocks
        if (out is not None and self.preemption_mode == "swap" and 0 < req.num_blocks <= self.num_free_host_blocks):
            out.swap_out_req_ids.append(req.req_id)
            self.num_free_host_blocks -= req.num_blocks
            req.num_shared_blocks = 0  # its host copies are its own
            req.table = []
            req.spec_token_ids = []  # the executor forgets its proposal with it
            self.counters["num_swap_outs"] += 1
            self._enqueue(self.swapped, req, SWAPPED)
            return
        self.pending_free_req_ids.append(req.req_id)
        req.reset_for_recompute()
        self._enqueue(self.waiting, req, WAITING)

    def reset_pool(self, info: PoolInfo, held: dict[str, list[int]] | None = None) -> int:
        """The executor restarted (a new epoch): its state and the old tables are gone. Every
        running or swapped sequence starts over by recompute, first in line; ``held`` sequences
        still hold blocks in the new tables (given in the call that revealed the restart).
        Returns how many start over."""
        restart = self.running + self.swapped
        self.running, self.swapped = [], []
        for req in restart:
            req.reset_for_recompute()
            self._enqueue(self.waiting, req, WAITING)
        for req in self.waiting:
            req.on_executor = False
        self.pending_finished_req_ids = []
        self.pending_truncate = []
        held = held or {}
        self.set_pool(info)
        # the step that would have filled them never ran: their blocks must not be cached
        self.pending_free_req_ids, self.pending_discard_req_ids = [], list(held)
        self.num_pending_free_blocks = sum(map(len, held.values()))
        self.counters["num_executor_restarts"] += 1
        return len(restart)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.swapped or self.unforked or self.pending_free_req_ids
                    or self.pending_finished_req_ids or self.pending_discard_req_ids or self.pending_truncate)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> StepOutput | None:
        """Pick this step's work; None when there is nothing to compute and nothing to free."""
        out = StepOutput(step_id=self.next_step_id)
        self._issue_forks(out)
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
            while True:
                need, cow = self._blocks_needed(req, num_new)  # an undone fork may spare a copy
                if need + cow <= self.num_free_blocks + self.num_pending_free_blocks:
                    break
                victim = self._victim(i, self._fork_parents(out))
                if victim is None:
                    break
                self._preempt(victim, out)
                preempted = True
            if need + cow <= self.num_free_blocks + self.num_pending_free_blocks:
                whole_prefill_taken |= num_new > 1
                self._take(out, req, num_new, need, cow)
                budget -= num_new
                i += 1
                continue
            if req.req_id in self._fork_parents(out):
                i += 1  # it is forked from this step (freed before forking): it waits, holding its blocks
                continue
            self._preempt(req, out)  # nothing later in line was left to give way
            preempted = True
        num_seqs = self._num_seqs()
        while self.swapped and budget > 0 and not preempted:
            req = self.swapped[0]
            num_new = self._num_new_tokens(req, budget, whole_prefill_taken)
            need, cow = self._blocks_needed(req, num_new)
            if (num_seqs + 1 > self.max_num_seqs
                    or req.num_blocks + need > self.num_free_blocks + self.num_pending_free_blocks):
                break
            self.swapped.pop(0)
            out.swap_in_req_ids.append(req.req_id)
            self.num_free_host_blocks += req.num_blocks
            self.num_free_blocks -= req.num_blocks
            self.counters["num_swap_ins"] += 1
            self._enqueue(self.running, req, RUNNING)
            self._take(out, req, num_new, need, 0)
            budget -= num_new
            num_seqs += 1
        while self.waiting and budget > 0 and not preempted and not self.swapped:
            req = self.waiting[0]
            num_new = self._num_new_tokens(req, budget, whole_prefill_taken)
            if not num_new:
                break  # without chunked prefill, a prompt that does not fit waits for the next step
            need, cow = self._blocks_needed(req, num_new)
            cost = self._seq_cost(req)
            if num_seqs + cost > self.max_num_seqs or need + cow > self.num_free_blocks + self.num_pending_free_blocks:
                break  # nobody overtakes the head of the queue
            self.waiting.pop(0)
            self._enqueue(self.running, req, RUNNING)
            num_seqs += cost
            if not req.admitted:
                req.admitted = True
                self.counters["num_prompt_tokens_total"] += req.num_prompt_tokens
            whole_prefill_taken |= num_new > 1
            self._take(out, req, num_new, need, cow)
            budget -= num_new
        # every pending release rides on this step's kvmanager call, before its allocations
        out.free_req_ids, self.pending_free_req_ids = self.pending_free_req_ids, []
        out.discard_req_ids, self.pending_discard_req_ids = self.pending_discard_req_ids, []
        out.truncate, self.pending_truncate = self.pending_truncate, []
        self.num_free_blocks += self.num_pending_free_blocks
        self.num_pending_free_blocks = 0
        self.max_num_running = max(self.max_num_running, len(self.running))
        if not (out.scheduled or out.free_req_ids or out.discard_req_ids or out.forks or out.swap_out_req_ids
                or out.truncate or self.pending_finished_req_ids):
            return None
        self.next_step_id += 1
        return out

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

    def _blocks_needed(self, req: Request, num_new: int) -> tuple[int, int]:
        """(blocks its table grows by, 1 if its next write copies a shared last block)."""
        growth = max(0, cdiv(req.num_computed_tokens + num_new, self.block_size) - req.num_blocks)
        return growth, int(req.shares_last_block and num_new > 0)

    @staticmethod
    def _fork_parents(out: StepOutput) -> set[str]:
        return {f[0] for f in out.forks}

    def _victim(self, i: int, protected: set[str]) -> Request | None:
        """The last sequence in queue order after position ``i`` (not yet scheduled this step)."""
        for j in range(len(self.running) - 1, i, -1):
            if self.running[j].req_id not in protected:
                return self.running[j]
        return None

    def _seq_cost(self, req: Request) -> int:
        """Against ``max_num_seqs``: a request with choices to fork counts them; a beam search
        counts its width once, whichever beam is admitted first."""
        if req.group is None:
            return req.num_seqs
        return 0 if any(r.group is req.group for r in self.running) else req.group.width

    def _num_seqs(self) -> int:
        groups = {r.group for r in self.running if r.group is not None}
        return sum(r.num_seqs for r in self.running if r.group is None) + sum(g.width for g in groups)

    def _take(self, out: StepOutput, req: Request, num_new: int, need: int, cow: int) -> None:
        if num_new == 0:
            return  # swapped in while it waits for its beam siblings: nothing to compute yet
        out.scheduled.append((req, num_new))
        if num_new > 1 and req.num_tokens - req.num_computed_tokens == 1:
            out.spec_token_ids[req.req_id] = req.spec_token_ids[:num_new - 1]
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.time()
        if need > 0 or cow:
            num_tokens = req.num_computed_tokens + num_new
            out.allocate.append((req.req_id, num_tokens))
            out.num_new_blocks[req.req_id] = need
            is_first = req.num_blocks == 0
            req.num_blocks += need
            req.shares_last_block = False
            self.num_free_blocks -= need + cow
            if req.sampling.prompt_logprobs is None:
                known = min(num_tokens, req.num_tokens)  # draft tokens are not known until accepted
                out.new_token_ids[req.req_id] = req.all_token_ids[req.num_kv_token_ids:known]
                req.num_kv_token_ids = known
            if req.cache_salt is not None and is_first:
                out.cache_salts[req.req_id] = req.cache_salt

    # ------------------------------------------------------------------ forks
    def _issue_forks(self, out: StepOutput) -> None:
        """Fork the choices of first choices that computed all but their last prompt token, and
        the new beams of the last step. A child whose parent lost its table starts on its own."""
        for req in list(self.running):
            if req.pending_forks and req.num_computed_tokens == req.num_prompt_tokens - 1 and req.num_blocks:
                for child in req.pending_forks:
                    self._fork(out, req, child)
                req.pending_forks = []
        unforked, self.unforked = self.unforked, []
        for child in unforked:
            parent = child.fork_parent
            if parent.status == RUNNING and parent.num_blocks and not parent.finished:
                self._fork(out, parent, child)
            else:
                child.reset_for_recompute()
                self._enqueue(self.waiting, child, WAITING)

    def _fork(self, out: StepOutput, parent: Request, child: Request) -> None:
        out.forks.append((parent.req_id, child.req_id, parent.num_computed_tokens))
        out.parents_sharing.setdefault(parent.req_id, parent.shares_last_block)
        child.fork_parent = None
        child.num_blocks = parent.num_blocks
        child.num_shared_blocks = parent.num_shared_blocks = parent.num_blocks
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_kv_token_ids = parent.num_kv_token_ids
        partial = parent.num_computed_tokens % self.block_size != 0
        child.shares_last_block = partial
        parent.shares_last_block |= partial
        child.admitted = True
        child.arrival_time, child.first_scheduled_time = parent.arrival_time, parent.first_scheduled_time
        self.counters["num_forks"] += 1
        self._enqueue(self.running, child, RUNNING)

    # ------------------------------------------------------------------ the kvmanager's answer
    def needs_kv_call(self, out: StepOutput) -> bool:
        """Most decode steps cross no block boundary: then the kvmanager has nothing to do."""
        return bool(out.allocate or out.free_req_ids or out.discard_req_ids or out.forks or out.swap_out_req_ids
                    or out.swap_in_req_ids or out.truncate)

    def build_plan(self, out: StepOutput, kv: KVStepReply | None) -> StepPlan:
        """The executor's per-step diff, from this step's choices and the kvmanager's block ids."""
        failed = set(kv.failed_req_ids) if kv is not None else set()
        if failed:
            self._recover_refused(out, failed)
        new_block_ids = kv.new_block_ids if kv is not None else {}
        tables = kv.block_tables if kv is not None else {}
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
            table = tables.get(req.req_id)
            block_ids = new_block_ids.get(req.req_id, [])
            if req.on_executor:
                running_reqs.append(RunningRequestData(
                    req_id=req.req_id, new_block_ids=[] if table is not None else block_ids,
                    num_computed_tokens=req.num_computed_tokens, new_token_ids=req.unsent_token_ids,
                    block_ids=table))
            else:
                new_reqs.append(NewRequestData(
                    req_id=req.req_id, token_ids=req.all_token_ids, num_prompt_tokens=req.num_prompt_tokens,
                    sampling=req.sampling, block_ids=table if table is not None else req.table + block_ids,
                    num_computed_tokens=req.num_computed_tokens, append_sampled=req.append_sampled))
                req.on_executor = True
            req.unsent_token_ids, req.table = [], []
            num_scheduled[req.req_id] = num_new
            req.num_computed_tokens += num_new
            self.counters["num_scheduled_tokens_total"] += num_new
            kept.append((req, num_new))
        for req_id, table in tables.items():  # forked but not scheduled yet: keep its table for later
            req = self.requests.get(req_id)
            if req is not None and not req.on_executor:
                req.table = table
        out.scheduled = kept
        finished, self.pending_finished_req_ids = self.pending_finished_req_ids, []
        self.counters["num_steps"] += 1
        self.counters["num_scheduled_seqs_total"] += len(kept)
        self.last_batch_size, self.last_num_scheduled_tokens = len(kept), sum(num_scheduled.values())
        copies = dict(block_copies=kv.block_copies, swap_out=kv.swap_out, swap_in=kv.swap_in) if kv else {}
        spec = {req_id: ids for req_id, ids in out.spec_token_ids.items() if req_id in num_scheduled}
        return StepPlan(step_id=out.step_id, new_reqs=new_reqs, running_reqs=running_reqs,
                        num_scheduled_tokens=num_scheduled, finished_req_ids=finished, spec_token_ids=spec, **copies)

    def _recover_refused(self, out: StepOutput, failed: set[str]) -> None:
        """The kvmanager refused part of this step (the mirror was off): the sequences it refused
        drop whatever they hold and start over by recompute."""
        for req in [r for r in self.requests.values() if r.req_id in failed and not r.finished]:
            if req.status == FORKING:
                continue
            growth = out.num_new_blocks.get(req.req_id, 0)
            self._dequeue(req)
            if req.req_id in out.swap_in_req_ids or req.status == SWAPPED:
                # still (or again) on the host tier: those host blocks come back with its release
                self.num_free_host_blocks += req.num_blocks
            else:
                self.num_pending_free_blocks += max(0, req.num_blocks - growth - req.num_shared_blocks)
            if req.on_executor:
                self.pending_finished_req_ids.append(req.req_id)
            self.pending_free_req_ids.append(req.req_id)
            req.reset_for_recompute()
            self.counters["num_preemptions"] += 1
            self._enqueue(self.waiting, req, WAITING)

    def _start_after_cached(self, req: Request, num_new: int, num_cached: int) -> int:
        """A new sequence whose first blocks were cached starts after them; returns what is left
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
                                     num_cached_tokens=req.num_cached_tokens, queue_time_s=self._queue_time(req)))
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
        rejected drafts' slots are not: the table shrinks back in the next kvmanager call."""
        req.num_computed_tokens = req.num_tokens - 1
        keep = cdiv(req.num_computed_tokens, self.block_size)
        if req.num_blocks > keep:
            self.pending_truncate.append((req.req_id, req.num_computed_tokens))
            self.num_pending_free_blocks += req.num_blocks - keep
            req.num_blocks = keep

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
            "num_free_blocks": self.num_free_blocks + self.num_pending_free_blocks,
            "num_blocks_total": self.pool.num_blocks if self.pool else 0,
            "num_free_host_blocks": self.num_free_host_blocks,
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
             "num_blocks": r.num_blocks, "beam_of": r.group.req_id if r.group is not None else None}
            for r in self.requests.values()
        ]
