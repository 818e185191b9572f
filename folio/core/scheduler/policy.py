"""The iteration-level batching policy, free of sockets so that it can be read (and tested) alone.

Each step every running sequence gets the tokens it needs to catch up (a decode: 1; a prefill
chunk: up to the remaining token budget, and at most ``long_prefill_token_threshold``), in queue
order, then swapped-out sequences come back and waiting ones are admitted while the budget
(``max_num_batched_tokens``), the sequence cap (``max_num_seqs``) and the free blocks allow.
Queue order is first come first served, or ``(priority, arrival)`` with the priority policy.
With ``max_loras``, at most that many distinct LoRA adapters run at once (so every step fits the
executor's adapter slots): a waiting request whose adapter would be one more waits, and those
behind it may go first.
Without chunked prefill a prompt is computed whole: the first one of a step even beyond the
budget, the others only while they fit.

The scheduler plans with its own replica of the block allocator (``folio.core.kv``): ``schedule``
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
as ``schedule`` -> ``build_plan`` -> executor -> ``update_from_result``; with async scheduling it
plans the next step before the last one's result (``schedule(in_flight)``, when ``can_plan_ahead``).

A sequence new to the allocator first looks up the prefix cache: with lower tiers, the device's
hits, then the host tier's (the replica knows them), then the disk tier's files (verified here,
loaded when ``TierCostModel`` says loading beats recomputing; their hashes ride in the
``KVAllocate``): it starts after the blocks found there (whole blocks, at least one token left to
compute), and those tokens cost nothing from the token budget nor from the free blocks beyond reviving them. Tokens reach the allocator
with each allocation (those it has not seen), so that it can hash blocks as they fill; blocks
become findable once the step that computed them ran (``KVConfirm`` at the start of the next
step). Requests that want prompt logprobs send none: they neither hit nor feed the cache, since a
cached prompt token would have no logprob.

A model whose every layer is windowed (``PoolInfo.sliding_window``, from the executor's model)
gets a replica that gives back the blocks behind the window: an allocation writing from position
p skips the blocks before p - W + 1 (``folio.core.kv.allocator``); the scheduler passes p, the
sequence's computed tokens, which never moves back (drafts are verified from p on, rollbacks stop
at or after it, preemption frees the whole table). A request is refused only when its prefill
chunk and the window before it cannot fit in the whole pool.

Beside this module: ``admission.py`` (requests in and out, the queues), ``forks.py`` (the choices
of ``n`` > 1 and beam groups, which share blocks through forks), ``executor_step.py`` (the executor's
plan and result), ``request.py`` (a request and its ``Status``), ``stats.py`` (what the counters
and queues say, for the admin socket).
"""

from __future__ import annotations

import time

from folio.core.scheduler.admission import Admission
from folio.core.scheduler.executor_step import ExecutorExchange, StepOutput
from folio.core.scheduler.forks import Forks
from folio.core.structured.scheduling import GrammarGate
from folio.core.scheduler.request import Request, Status
from folio.core.kv.allocator import BlockAllocator, cdiv
from folio.core.kv.steplog import StepLog
from folio.core.kv.tiers import DiskTier, TierCostModel
from folio.shared.messages import (
    KVAllocate,
    KVClear,
    KVConfirm,
    KVFree,
    KVLoad,
    KVSwapIn,
    KVSwapOut,
    KVTruncate,
    PoolInfo,
    RunningRequestData,
)

PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")


class Scheduler(Admission, ExecutorExchange):
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int | None = None, *,
                 enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                 preemption_mode: str = "recompute", scheduling_policy: str = "fcfs", max_loras: int | None = None):
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
        self.max_loras = max_loras  # the most distinct LoRA adapters running at once (None: no limit)
        self.max_model_len_limit = max_model_len
        self.max_model_len: int | None = max_model_len
        self.pool: PoolInfo | None = None
        self.kv: StepLog | None = None  # the allocator replica, set with the pool
        # the queues, each kept in queue order (``Request.key``)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}  # every request by req_id (choices and beams by their own ids)
        self.forks = Forks(self)  # the choices of n > 1 still to fork, beam groups
        self.grammar_gate = GrammarGate()  # structured output: who may sample (``structured/scheduling.py``)
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
        self.speculative = False  # the executor proposes drafts: no step is planned ahead of a result
        self.drafts_next = True  # ... unless its last result said the next step's result has none
        self.needs_sync = False  # a step planned ahead needed a preemption: the next waits for the result
        self.max_num_running = 0
        self.last_batch_size = 0
        self.last_num_scheduled_tokens = 0
        self.counters = dict(num_steps=0, num_preemptions=0, num_swap_outs=0, num_swap_ins=0, num_forks=0,
                             num_prompt_tokens_total=0, num_generation_tokens_total=0,
                             num_requests_finished=0, num_requests_aborted=0, num_requests_rejected=0,
                             num_executor_restarts=0, num_epochs=0, num_digest_mismatches=0, num_scheduled_tokens_total=0, num_scheduled_seqs_total=0,
                             num_cached_tokens_total=0, num_spec_drafts=0, num_spec_draft_tokens=0,
                             num_spec_accepted_tokens=0, num_grammar_held_steps=0, num_grammar_errors=0,
                             num_steps_planned_ahead=0)

    # ------------------------------------------------------------------ pool
    def set_pool(self, info: PoolInfo) -> None:
        """A fresh, empty replica of the allocator for ``info``'s pool."""
        self.pool = info
        self.kv = StepLog(BlockAllocator(info.num_blocks, info.block_size, info.num_host_blocks,
                                         enable_prefix_caching=info.enable_prefix_caching, record_events=False,
                                         sliding_window=info.sliding_window, disk_tier=bool(info.kv_disk_dir)))
        self.disk = None  # the disk tier's folder, looked up by ``_find_cached`` (``folio.core.kv.tiers``)
        if info.kv_disk_dir and self.kv.alloc.disk_tier:
            try:
                self.disk = DiskTier(info.kv_disk_dir, info.kv_layout_id, 0, info.bytes_per_block)
            except (OSError, ValueError):
                self.disk = None
        self.tier_cost = TierCostModel()
        self._last_prefill: tuple[float, int] | None = None
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
        if (self.preemption_mode == "swap" and seq is not None and seq.held_block_ids
                and len(seq.held_block_ids) <= self.alloc.host.num_free_blocks):
            self.kv.try_apply(KVSwapOut(req.req_id))
            self.counters["num_swap_outs"] += 1
            self.enqueue(self.swapped, req, Status.SWAPPED)
            return
        self.kv.try_apply(KVFree([req.req_id]))
        req.reset_for_recompute()
        self.enqueue(self.waiting, req, Status.WAITING)

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
            self.enqueue(self.waiting, req, Status.WAITING)
        for req in self.waiting:
            req.on_executor = False
            req.num_computed_tokens = 0
        for req in self.requests.values():  # a new executor has compiled nothing
            req.grammar_ready = False
        self.grammar_gate.reset()
        self.pending_free_req_ids, self.pending_discard_req_ids, self.pending_truncate = [], [], []
        self.set_pool(info)
        self.counters["num_epochs"] += 1
        return len(restart)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.swapped or self.forks.unforked or self.pending_free_req_ids
                    or self.pending_finished_req_ids or self.pending_discard_req_ids or self.pending_truncate
                    or self.pending_clear)

    # ------------------------------------------------------------------ one step
    def schedule(self, in_flight: StepOutput | None = None) -> StepOutput | None:
        """Pick this step's work, applying its allocator operations to the replica as it goes;
        None when there is nothing to compute and nothing to tell the kvmanager or the executor.
        ``in_flight``: the step the executor runs meanwhile (async scheduling, when
        ``can_plan_ahead`` says so); its samplers decode their next token as a placeholder, its
        allocations stay unconfirmed, and a sequence that cannot grow stops the step instead of
        preempting (``needs_sync``: the next step waits for the result)."""
        out = StepOutput(step_id=self.next_step_id, ahead=in_flight is not None)
        self.needs_sync = False
        self._settle([op.req_id for op in in_flight.ops if isinstance(op, KVAllocate)] if in_flight else [])
        self.forks.issue()
        budget = self.max_num_batched_tokens
        preempted = False
        whole_prefill_taken = False  # without chunked prefill: the first whole prompt may pass the budget
        i = 0
        while True:
            i, budget = self._plain_decodes(out, i, budget)
            if i >= len(self.running) or budget <= 0:
                break
            req = self.running[i]
            num_new = self._num_new_tokens(req, budget, whole_prefill_taken)
            if not num_new:
                i += 1
                continue
            grown = self._grow(req, num_new)
            if not grown and out.ahead:  # preemption waits for the running step's result
                self.needs_sync = preempted = True
                break
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
        num_seqs = self._num_seqs() if self.swapped or self.waiting else 0
        adapters: set[str] | None = None  # the running adapters, gathered once a request with one asks
        while self.swapped and budget > 0 and not preempted:
            req = self.swapped[0]
            if req.lora_name and self.max_loras:
                adapters = self._running_adapters() if adapters is None else adapters
                if not self._adapter_fits(req, adapters):
                    break
            num_new = self._num_new_tokens(req, budget, whole_prefill_taken)
            seq = self.alloc.seqs[req.req_id]
            num_host = len(seq.host_block_ids)
            need = max(num_host, cdiv(req.num_computed_tokens + num_new, self.block_size) - seq.num_skipped_blocks)
            if num_seqs + 1 > self.max_num_seqs or need > self.alloc.num_free_blocks:
                break
            self.swapped.pop(0)
            self.kv.try_apply(KVSwapIn(req.req_id))
            self.counters["num_swap_ins"] += 1
            self.enqueue(self.running, req, Status.RUNNING)
            if adapters is not None and req.lora_name:
                adapters.add(req.lora_name)
            if num_new and self._grow(req, num_new):
                self._take(out, req, num_new)
                budget -= num_new
            num_seqs += 1
        j = 0
        while j < len(self.waiting) and budget > 0 and not preempted and not self.swapped:
            req = self.waiting[j]
            if req.lora_name and self.max_loras:
                adapters = self._running_adapters() if adapters is None else adapters
                if not self._adapter_fits(req, adapters):  # its adapter waits for a free slot; others go on
                    j += 1
                    continue
            self._find_cached(req)
            kv_import = self._imports_kv(req)
            # an import takes blocks for all its tokens but computes only its last (the prefill side's token)
            num_new = req.num_tokens - req.num_computed_tokens if kv_import else \
                self._num_new_tokens(req, budget, whole_prefill_taken)
            if not num_new and req.req_id in self.grammar_gate.held and req.num_computed_tokens >= req.num_tokens - 1:
                # all it lacks is its grammar: the others go on
                req.num_computed_tokens = req.num_cached_tokens = 0
                j += 1
                continue
            cost = self._seq_cost(req)
            # nobody else overtakes the head of the queue; without chunked prefill a prompt that
            # does not fit waits for the next step
            if not num_new or num_seqs + cost > self.max_num_seqs or not self._grow(req, num_new):
                req.num_computed_tokens = req.num_cached_tokens = 0
                break
            self.waiting.pop(j)
            self.enqueue(self.running, req, Status.RUNNING)
            if adapters is not None and req.lora_name:
                adapters.add(req.lora_name)
            num_seqs += cost
            if not req.admitted:
                req.admitted = True
                self.counters["num_prompt_tokens_total"] += req.num_prompt_tokens
            self.counters["num_cached_tokens_total"] += req.num_cached_tokens
            req.counts_sent = False
            if kv_import:
                num_new = self._import_kv(out, req)
            whole_prefill_taken |= num_new > 1
            self._take(out, req, num_new)
            budget -= num_new
        self.max_num_running = max(self.max_num_running, len(self.running))
        out.ops, (out.block_copies, out.swap_out, out.swap_in), out.digest = self.kv.seal()
        out.tier_saves, out.tier_loads = self.kv.tier_ops
        self._time_prefill(out)
        out.grammars, held = self.grammar_gate.take_step()
        self.counters["num_grammar_held_steps"] += held
        out.await_grammars = held and not out.scheduled  # nothing to run but a compile to wait for
        if not (out.scheduled or out.ops or self.pending_finished_req_ids or out.grammars or out.await_grammars):
            return None
        self.next_step_id += 1
        self.counters["num_steps_planned_ahead"] += out.ahead
        return out

    def _running_adapters(self) -> set[str]:
        return {r.lora_name for r in self.running if r.lora_name}

    def _adapter_fits(self, req: Request, adapters: set[str]) -> bool:
        """Whether ``req`` (with an adapter) may run beside ``adapters``: at most ``max_loras``
        distinct adapters run at once, so that every step's fit in the executor's slots."""
        return req.lora_name in adapters or len(adapters) < self.max_loras

    def _settle(self, keep: list[str]) -> None:
        """What waited for this step, in the log's fixed order: tables shrunk after rejected drafts,
        the last step's allocations confirmed as computed (not ``keep``'s: their step still runs),
        releases, a cache clear."""
        alloc, kept = self.alloc, set(keep)
        for req_id, num_tokens in self.pending_truncate:
            if self.kv.try_apply(KVTruncate(req_id, num_tokens)) and req_id in self.requests:
                self.requests[req_id].table_changed = True
        if any(req_id not in kept for req_id in alloc.unconfirmed):
            self.kv.try_apply(KVConfirm(self.pending_discard_req_ids, [r for r in keep if r in alloc.unconfirmed]))
        released = self.pending_free_req_ids + self.pending_discard_req_ids
        if released:
            self.kv.try_apply(KVFree(released))
        if self.pending_clear:
            self.num_cache_blocks_cleared = self.kv.try_apply(KVClear())
        self.pending_truncate, self.pending_free_req_ids, self.pending_discard_req_ids = [], [], []
        self.pending_clear = False

    def _plain_decodes(self, out: StepOutput, i: int, budget: int) -> tuple[int, int]:
        """Schedule ``running[i:]`` while they are plain decodes: one token, no forks, drafts or
        grammar, and room for it in the table or a new block for it (no copy). This is most of
        every step and runs for each running sequence, so it is the inline form of
        ``_num_new_tokens``, ``_grow``, ``_take`` and ``plan_request`` for that case. Returns where it
        stopped (a sequence for the general path), and the budget left."""
        running, scheduled, end = self.running, out.scheduled, len(self.running)
        num_scheduled, samplers = out.num_scheduled, out.samplers
        bs, seqs, ref_counts = self.block_size, self.alloc.seqs, self.alloc.device.ref_counts
        running_reqs = out.running_reqs
        num_placeholders = 0
        while i < end and budget > 0:
            req = running[i]
            if req.pending_forks or req.spec_token_ids or req.sampling.grammar is not None:
                break
            start, pending, num_output = req.num_computed_tokens, req.num_pending, len(req.output_token_ids)
            if len(req.prompt_token_ids) + num_output + pending - start != 1:
                break
            if pending and num_output + pending >= req.sampling.max_tokens:
                break  # the tokens in flight are its last
            seq = seqs.get(req.req_id)
            if seq is None or seq.host_block_ids is not None:
                break
            num_blocks = len(seq.block_ids)
            if start >= num_blocks * bs:  # its token starts a block: ``_grow``'s case without a copy
                if not self._allocate(req, start, start + 1):
                    break  # refused: the general path preempts (or stops a step planned ahead)
                num_blocks = len(seq.block_ids)
            elif start % bs and ref_counts[seq.block_ids[start // bs]] > 1:
                break  # a shared last block: copy-on-write
            scheduled.append((req, 1))
            if (num_blocks >= req.num_sent_blocks and start == req.executor_computed and req.on_executor
                    and not (req.table_changed or req.unsent_token_ids)):
                # the executor lacks nothing but the blocks it gained: the plan names it by its
                # count (``plan_request``), and by those blocks
                if num_blocks > req.num_sent_blocks:
                    running_reqs.append(RunningRequestData(req_id=req.req_id, num_computed_tokens=start,
                                                           new_block_ids=seq.block_ids[req.num_sent_blocks:]))
                    req.num_sent_blocks = num_blocks
                num_scheduled[req.req_id] = 1
                req.num_computed_tokens = req.executor_computed = start + 1
                samplers.append(req)
                req.num_pending = pending + 1
                if pending:
                    num_placeholders += 1
            else:
                self.plan_request(out, req, 1)
            budget -= 1
            i += 1
        out.num_placeholders += num_placeholders
        return i, budget

    def _find_cached(self, req: Request) -> None:
        """A sequence new to the allocator starts after the blocks the prefix cache holds for it;
        those tokens cost nothing from the token budget. Requests that want prompt logprobs
        neither hit nor feed the cache (a cached prompt token would have no logprob)."""
        if req.req_id in self.alloc.seqs or req.sampling.prompt_logprobs is not None:
            return
        end = req.num_prompt_tokens - 1 if req.pending_forks else req.num_tokens
        # at least one token is left to compute: the last one, which samples
        max_blocks = (end - 1) // self.block_size
        num_blocks = self.alloc.num_cached_blocks(req.all_token_ids, req.kv_salt, max_blocks)
        req.kv_load_hashes = []
        if self.disk is not None and num_blocks < max_blocks:  # then the disk tier's files (verified)
            hashes = self.alloc.prefix_hashes(req.all_token_ids, req.kv_salt, max_blocks)
            req.kv_load_hashes = self.disk.find_run(hashes[num_blocks:], self.block_size, self.tier_cost)
            num_blocks += len(req.kv_load_hashes)
        req.num_computed_tokens = req.num_cached_tokens = num_blocks * self.block_size

    def _time_prefill(self, out) -> None:
        """The cost model's prefill rate: a step with a long prefill takes about as long as the
        time to the next plan (rough, and enough: loads win or lose by an order of magnitude)."""
        now = time.perf_counter()
        if self._last_prefill is not None:
            t, n = self._last_prefill
            self.tier_cost.observe_prefill(n, now - t)
        n = sum(k for _, k in out.scheduled if k > 1)
        self._last_prefill = (now, n) if n >= 256 and self.disk is not None else None

    def _imports_kv(self, req: Request) -> bool:
        """Whether ``req`` takes its prompt's KV from a prefill instance now: a handle for exactly its
        prompt, the prefill side's token forced after it, and a plain table (no sliding window, no
        prompt logprobs, no choices to fork)."""
        h = req.kv_transfer
        if h is None:
            return False
        ok = (req.num_tokens == req.num_prompt_tokens + 1 and h.get("num_tokens") == req.num_prompt_tokens
              and h.get("num_blocks") == cdiv(req.num_prompt_tokens, self.block_size)
              and req.req_id not in self.alloc.seqs and not self.alloc.sliding_window
              and req.sampling.prompt_logprobs is None and not req.pending_forks)
        if not ok:
            req.kv_transfer = None  # computed here instead
        return ok

    def _import_kv(self, out: StepOutput, req: Request) -> int:
        """Plan the pull of ``req``'s prompt KV into its new table (the blocks its prefix-cache hit
        holds already are skipped); the step computes only its last token. Returns that 1."""
        bs, start = self.block_size, req.num_computed_tokens
        table = self.alloc.seqs[req.req_id].block_ids
        handle, req.kv_transfer = req.kv_transfer, None
        block_ids = [b if i >= start // bs else -1 for i, b in enumerate(table[:handle["num_blocks"]])]
        out.kv_loads.append(KVLoad(req_id=req.req_id, handle=handle, block_ids=block_ids,
                                   fallback_computed_tokens=start))
        self.counters["num_kv_imported_tokens"] = self.counters.get("num_kv_imported_tokens", 0) + \
            req.num_prompt_tokens - start
        req.num_computed_tokens = req.num_prompt_tokens
        return 1

    def _grow(self, req: Request, num_new: int) -> bool:
        """Make room in ``req``'s table for its next ``num_new`` tokens (False: refused, nothing
        changed); a table new here is salted with the request's cache salt and adapter."""
        alloc, start = self.alloc, req.num_computed_tokens
        end = start + num_new
        if not alloc.changes_table(req.req_id, start, end):
            return True
        num_copies = len(alloc.block_copies)
        if not self._allocate(req, start, end, req.kv_salt if req.req_id not in alloc.seqs else None):
            return False
        if len(alloc.block_copies) > num_copies:
            req.table_changed = True  # copy-on-write replaced a block inside its table
        return True

    def _allocate(self, req: Request, start: int, end: int, cache_salt: str | None = None) -> bool:
        """Apply the allocation of ``req``'s tokens [start, end) to the replica (False: refused,
        nothing changed). The tokens the allocator has not seen ride along, so that it hashes the
        blocks they fill; draft tokens are not known until accepted."""
        known = min(end, req.num_tokens) if req.sampling.prompt_logprobs is None else req.num_kv_token_ids
        op = KVAllocate(req.req_id, start, end, req.token_slice(req.num_kv_token_ids, known), cache_salt,
                        (getattr(req, "kv_load_hashes", None) or []) if req.req_id not in self.alloc.seqs else [])
        if self.kv.try_apply(op) is None:
            return False
        req.num_kv_token_ids = max(req.num_kv_token_ids, known)
        return True

    def _num_new_tokens(self, req: Request, budget: int, whole_prefill_taken: bool) -> int:
        """Tokens ``req`` computes this step (0: none, or its whole prompt does not fit)."""
        end = req.num_tokens + req.num_pending  # tokens in flight decode as placeholders
        if req.pending_forks:
            end = req.num_prompt_tokens - 1  # its choices fork off before the last prompt token
            self.grammar_gate.holds(req)  # (their grammar compiles meanwhile)
        elif self.grammar_gate.holds(req):
            end -= 1  # the token it samples from waits for its grammar
        elif req.num_pending and len(req.output_token_ids) + req.num_pending >= req.sampling.max_tokens:
            return 0  # the tokens in flight are its last
        remaining = end - req.num_computed_tokens
        if remaining == 1 and req.spec_token_ids and req.on_executor and not req.num_pending:  # a decode that verifies its drafts
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
        """Schedule ``num_new`` tokens of ``req`` and record its part of the plan (``_plain_decodes``
        does it inline for decodes)."""
        out.scheduled.append((req, num_new))
        if req.pending_forks or req.sampling.grammar is not None:
            out.waits_for_result = True
        if num_new > 1 and req.num_tokens - req.num_computed_tokens == 1:
            out.spec_token_ids[req.req_id] = req.spec_token_ids[:num_new - 1]
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.time()
        self.plan_request(out, req, num_new)

