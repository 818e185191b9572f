"""The scheduler's state in one object, read top to bottom (``SchedulerState``), and the record of
one step (``StepOutput``).

The policy is functions that read and change this state: ``admission.py`` (requests in and out),
``policy.py`` (one step's choice, the pool and its epochs), ``executor_step.py`` (the executor's plan and
result), ``forks.py`` (choices and beams). ``policy.Scheduler`` is this state with those functions
as its verbs; ``step_loop.py`` runs the steps.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from folio.core.kv.allocator import BlockAllocator
from folio.core.kv.steplog import StepLog
from folio.core.kv.tiers import DiskTier, TierCostModel
from folio.core.scheduler.forks import Forks
from folio.core.scheduler.request import Request, Status
from folio.core.structured.scheduling import GrammarGate
from folio.shared.messages import Grammar, KVLoad, KVOp, NewRequestData, PoolInfo, RunningRequestData

COUNTERS = ("num_steps", "num_preemptions", "num_swap_outs", "num_swap_ins", "num_forks",
            "num_prompt_tokens_total", "num_generation_tokens_total",
            "num_requests_finished", "num_requests_aborted", "num_requests_rejected",
            "num_executor_restarts", "num_epochs", "num_digest_mismatches", "num_scheduled_tokens_total",
            "num_scheduled_seqs_total", "num_cached_tokens_total", "num_spec_drafts", "num_spec_draft_tokens",
            "num_spec_accepted_tokens", "num_grammar_held_steps", "num_grammar_errors", "num_steps_planned_ahead")


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
    grammars: list[Grammar] = field(default_factory=list)  # for the executor to compile
    await_grammars: bool = False  # nothing scheduled: the executor waits a little for a compile
    # the executor's diff, recorded as each sequence is taken (``exchange.plan_request``)
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    running_reqs: list[RunningRequestData] = field(default_factory=list)
    num_placeholders: int = 0
    samplers: list[Request] = field(default_factory=list)  # the sequences that sample, in the plan's order
    poolers: list[Request] = field(default_factory=list)  # pooling requests whose last prompt chunk runs
    ahead: bool = False  # planned while the step before was still running (async scheduling)
    # a sequence in it has choices to fork or a grammar: the next step waits for its result
    waits_for_result: bool = False
    kv_loads: list[KVLoad] = field(default_factory=list)  # prompts' KV to pull from prefill instances
    tier_saves: list[tuple[int, int, bytes]] = field(default_factory=list)  # blocks to write to the disk tier
    tier_loads: list[tuple[int, bytes]] = field(default_factory=list)  # disk-tier files to read into blocks


@dataclass(eq=False)
class SchedulerState:
    # ---- the limits, fixed at start (``policy.Scheduler`` checks them)
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len_limit: int | None = None  # asked for; the pool's own limit may be lower
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: a prefill chunk is bounded by the budget only
    # the pooling requests' share of a step while a generating request runs (0: no share of their own)
    max_pooling_tokens_per_step: int = 16
    max_num_encoder_input_tokens: int = 0  # image placeholders whose tower runs in one step (0: the token budget)
    preemption_mode: str = "recompute"  # or "swap"
    scheduling_policy: str = "fcfs"  # or "priority"
    max_loras: int | None = None  # the most distinct LoRA adapters running at once (None: no limit)

    # ---- the pool and the allocator replica, new at each epoch (``policy.set_pool``)
    pool: PoolInfo | None = None
    kv: StepLog | None = None  # the allocator replica with its step log and digest
    max_model_len: int | None = None  # the lower of the limit asked for and the pool's
    disk: DiskTier | None = None  # the disk tier's folder, looked up by ``policy._find_cached``
    tier_cost: TierCostModel = field(default_factory=TierCostModel)  # whether a disk hit is worth loading
    last_prefill: tuple[float, int] | None = None  # (when, tokens) of the last step with a long prefill

    # ---- the requests: every one by req_id (choices and beams by their own ids), and the three
    # queues, each kept in queue order (``Request.key``)
    requests: dict[str, Request] = field(default_factory=dict)
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    swapped: list[Request] = field(default_factory=list)
    forks: Forks = field(init=False)  # the choices of n > 1 still to fork, beam groups
    grammar_gate: GrammarGate = field(default_factory=GrammarGate)  # structured output: who may sample
    next_arrival: int = 0  # arrival order, the queues' tie-break
    draining: bool = False  # admit nothing new (``folio scheduler drain``)

    # ---- what waits for the start of the next step (``policy._settle``) and for the next plan
    pending_truncate: list[tuple[str, int]] = field(default_factory=list)  # tables shrunk after rejected drafts
    pending_free_req_ids: list[str] = field(default_factory=list)
    pending_discard_req_ids: list[str] = field(default_factory=list)  # freed, their last growth never ran
    pending_clear: bool = False  # ``folio kv clear``: a KVClear in the next log
    num_cache_blocks_cleared: int = 0
    pending_finished_req_ids: list[str] = field(default_factory=list)  # for the executor, in the next plan

    # ---- the steps: planned, in flight, and whether the next may be planned ahead of a result
    next_step_id: int = 0
    in_flight: deque[StepOutput] = field(default_factory=deque)  # sent to the executor, oldest first (at most 2)
    speculative: bool = False  # the executor proposes drafts: no step is planned ahead of a result
    drafts_next: bool = True  # ... unless its last result said the next step's result has none
    needs_sync: bool = False  # a step planned ahead needed a preemption: the next waits for the result

    # ---- the statistics (``stats.py`` derives what people read from them)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    spec_accepted_per_pos: list[int] = field(default_factory=list)  # speculative decoding: accepted drafts by position
    max_num_running: int = 0
    last_batch_size: int = 0
    last_num_scheduled_tokens: int = 0

    def __post_init__(self):
        self.forks = Forks(self)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def alloc(self) -> BlockAllocator:
        return self.kv.alloc

    def has_work(self) -> bool:
        return bool(self.in_flight or self.running or self.waiting or self.swapped or self.forks.unforked
                    or self.pending_free_req_ids or self.pending_finished_req_ids or self.pending_discard_req_ids
                    or self.pending_truncate or self.pending_clear)

    # ---- the queues' primitives
    def enqueue(self, queue: list[Request], req: Request, status: Status) -> None:
        req.status = status
        bisect.insort(queue, req, key=_queue_key)

    def dequeue(self, req: Request) -> None:
        queue = {Status.RUNNING: self.running, Status.WAITING: self.waiting, Status.SWAPPED: self.swapped}[req.status]
        queue.remove(req)

    def release(self, req: Request) -> None:
        """A request that is done: its blocks go at the start of the next step, its state in the next plan."""
        req.status = Status.FINISHED
        del self.requests[req.req_id]
        self.pending_free_req_ids.append(req.req_id)
        if req.on_executor:
            self.pending_finished_req_ids.append(req.req_id)


def _queue_key(req: Request) -> tuple[int, int, int]:
    return req.key
