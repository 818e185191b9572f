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
with a state digest, without the step waiting for it (``service.py``). The step loop
(``step_loop.py``) drives one step as ``schedule`` -> ``build_plan`` -> executor ->
``update_from_result``; with async scheduling it plans the next step before the last one's result
(``schedule(in_flight)``, when ``can_plan_ahead``).

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

Beside this module: ``state.py`` (the whole state, in one object), ``admission.py`` (requests in
and out), ``forks.py`` (the choices of ``n`` > 1 and beam groups, which share blocks through
forks), ``executor_step.py`` (the executor's plan and result), ``request.py`` (a request and its
``Status``), ``step_loop.py`` (the steps, planned ahead), ``stats.py`` (what the counters and
queues say, for the admin socket).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from folio.core.scheduler.admission import abort, add_request, remove
from folio.core.scheduler.executor_step import build_plan, can_plan_ahead, kv_request, plan_request, update_from_result
from folio.core.scheduler.request import Request, Status
from folio.core.scheduler.state import SchedulerState, StepOutput
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


def set_pool(sched: SchedulerState, info: PoolInfo) -> None:
    """A fresh, empty replica of the allocator for ``info``'s pool."""
    sched.pool = info
    sched.kv = StepLog(BlockAllocator(info.num_blocks, info.block_size, info.num_host_blocks,
                                      enable_prefix_caching=info.enable_prefix_caching, record_events=False,
                                      sliding_window=info.sliding_window, disk_tier=bool(info.kv_disk_dir)))
    sched.disk = None
    if info.kv_disk_dir and sched.kv.alloc.disk_tier:
        try:
            sched.disk = DiskTier(info.kv_disk_dir, info.kv_layout_id, 0, info.bytes_per_block)
        except (OSError, ValueError):
            sched.disk = None
    sched.tier_cost = TierCostModel()
    sched.last_prefill = None
    limits = [n for n in (sched.max_model_len_limit, info.max_model_len) if n]
    sched.max_model_len = min(limits) if limits else None


def new_epoch(sched: SchedulerState, info: PoolInfo) -> int:
    """Start over with empty tables (the executor restarted, the kvmanager restarted, or its
    state digest differed from the replica's): a fresh replica for ``info``'s pool, and every
    running or swapped sequence starts over by recompute, first in line, keeping its tokens.
    The executor is told to drop what it holds. Returns how many start over."""
    restart = sched.running + sched.swapped
    sched.running, sched.swapped = [], []
    sched.pending_finished_req_ids += [r.req_id for r in (*restart, *sched.waiting) if r.on_executor]
    for req in restart:
        req.reset_for_recompute()
        sched.enqueue(sched.waiting, req, Status.WAITING)
    for req in sched.waiting:
        req.on_executor = False
        req.num_computed_tokens = 0
    for req in sched.requests.values():  # a new executor has compiled nothing
        req.grammar_ready = False
    sched.grammar_gate.reset()
    sched.pending_free_req_ids, sched.pending_discard_req_ids, sched.pending_truncate = [], [], []
    set_pool(sched, info)
    sched.counters["num_epochs"] += 1
    return len(restart)


def clear_cache(sched: SchedulerState) -> None:
    """``folio kv clear``: both allocators drop their free cached blocks in the next step."""
    sched.pending_clear = True


# ------------------------------------------------------------------ one step
@dataclass
class _Room:
    """What is left of one step as ``schedule`` fills it, from one phase to the next."""

    num_tokens: int  # of the token budget
    num_seqs: int = 0  # sequences counted against ``max_num_seqs`` (once the queues' turn comes)
    preempted: bool = False  # nothing new is admitted in a step that preempted
    whole_prefill_taken: bool = False  # without chunked prefill: the first whole prompt may pass the budget
    # what pooling requests' prompts may still take (``max_pooling_tokens_per_step`` while a generating
    # request runs: a step of embeddings' prefill stalls every stream decoding beside it)
    pool_tokens: int = 1 << 62
    # image placeholder tokens whose vision tower may still run (``max_num_encoder_input_tokens``)
    encoder_tokens: int = 1 << 62
    encoder_budget: int = 1 << 62
    adapters: set[str] | None = None  # the running adapters, gathered once a request with one asks


def schedule(sched: SchedulerState, in_flight: StepOutput | None = None) -> StepOutput | None:
    """Pick this step's work, applying its allocator operations to the replica as it goes;
    None when there is nothing to compute and nothing to tell the kvmanager or the executor.
    ``in_flight``: the step the executor runs meanwhile (async scheduling, when
    ``can_plan_ahead`` says so); its samplers decode their next token as a placeholder, its
    allocations stay unconfirmed, and a sequence that cannot grow stops the step instead of
    preempting (``needs_sync``: the next step waits for the result)."""
    out = StepOutput(step_id=sched.next_step_id, ahead=in_flight is not None)
    sched.needs_sync = False
    _settle(sched, [op.req_id for op in in_flight.ops if isinstance(op, KVAllocate)] if in_flight else [])
    sched.forks.issue()
    room = _Room(num_tokens=sched.max_num_batched_tokens)
    room.encoder_tokens = room.encoder_budget = sched.max_num_encoder_input_tokens or sched.max_num_batched_tokens
    if sched.max_pooling_tokens_per_step and any(r.sampling.pooling is None for r in sched.running):
        room.pool_tokens = sched.max_pooling_tokens_per_step
    _schedule_running(sched, out, room)
    if not room.preempted and room.num_tokens > 0 and (sched.swapped or sched.waiting):
        room.num_seqs = _num_seqs(sched)
        _swap_in(sched, out, room)
        if not sched.swapped:
            _admit_waiting(sched, out, room)
    return _seal(sched, out)


def _schedule_running(sched: SchedulerState, out: StepOutput, room: _Room) -> None:
    """The running sequences first, in queue order: each gets the tokens it needs to catch up,
    preempting the last ones in line when it cannot grow (a step planned ahead stops instead)."""
    i = 0
    while True:
        i, room.num_tokens = _plain_decodes(sched, out, i, room.num_tokens)
        if i >= len(sched.running) or room.num_tokens <= 0:
            return
        req = sched.running[i]
        num_new = _chunk(sched, req, room)
        if not num_new:
            i += 1
            continue
        if not _grow(sched, req, num_new):
            if out.ahead:  # preemption waits for the running step's result
                sched.needs_sync = room.preempted = True
                return
            room.preempted = True
            if not _preempt_until_grown(sched, req, num_new, i):
                _preempt(sched, req)  # nothing later in line was left to give way
                continue
        room.whole_prefill_taken |= num_new > 1
        _take(sched, out, req, num_new)
        _spend(room, req, num_new)
        i += 1


def _budget(req: Request, room: _Room) -> int:
    """The tokens ``req`` may take this step: the budget's rest, a pooling request's within its share."""
    return room.num_tokens if req.sampling.pooling is None else max(0, min(room.num_tokens, room.pool_tokens))


def _chunk(sched: SchedulerState, req: Request, room: _Room) -> int:
    """``req``'s tokens this step: within the budget (``_budget``) and, for a prompt with images,
    stopping before an image whose tower would pass the step's encoder budget, and before an
    image whose placeholders attend each other both ways that the step cannot hold whole."""
    budget = _budget(req, room)
    if budget <= 0:  # (a prompt the prefix cache holds whole still computes its last token: not past the share)
        return 0
    num_new = _num_new_tokens(sched, req, budget, room.whole_prefill_taken)
    if not req.images:
        return num_new
    num_new = _whole_images(req, num_new, budget)
    if num_new <= 1:
        return num_new
    start, used = req.num_computed_tokens, 0
    for im in sorted(req.images, key=lambda im: im.offset):
        if start <= im.offset < start + num_new:  # its tower runs in the step that reaches its first placeholder
            # one image a step always runs, whatever its size: a budget below it must not stall the prompt
            if used + im.length > room.encoder_tokens and (used or room.encoder_tokens < room.encoder_budget):
                return im.offset - start
            used += im.length
    return num_new


def _whole_images(req: Request, num_new: int, budget: int) -> int:
    """``num_new`` when the chunk ends inside no image attended both ways (Gemma 3's,
    ``ImageInput.both_ways``): every row of such an image sees all its keys, so one step computes
    them all. Else the chunk taken to that image's end where ``budget`` allows (past a long-prefill
    threshold), or cut before it (0 when it starts inside one it cannot finish: it waits for room)."""
    start, end = req.num_computed_tokens, req.num_computed_tokens + num_new
    for im in sorted(req.images, key=lambda im: im.offset):
        if im.both_ways and im.offset < end < im.offset + im.length:
            return im.offset + im.length - start if im.offset + im.length - start <= budget \
                else max(0, im.offset - start)
    return num_new


def _spend(room: _Room, req: Request, num_new: int) -> None:
    """What ``num_new`` tokens of ``req`` take of the step: the token budget, a pooling request's
    share, and the encoder budget (each image whose first placeholder they reach)."""
    room.num_tokens -= num_new
    room.pool_tokens -= num_new if req.sampling.pooling is not None else 0
    start = req.num_computed_tokens - num_new  # (``_take`` has moved it past the chunk)
    room.encoder_tokens -= sum(im.length for im in req.images if start <= im.offset < start + num_new)


def _preempt_until_grown(sched: SchedulerState, req: Request, num_new: int, i: int) -> bool:
    """Preempt the last sequences in line after ``running[i]`` until ``req`` grows (False: none left)."""
    while (victim := _victim(sched, i)) is not None:
        _preempt(sched, victim)
        if _grow(sched, req, num_new):
            return True
    return False


def _preempt(sched: SchedulerState, req: Request) -> None:
    """``req`` gives its device blocks back now: swapped to the host tier when the mode says so
    and there is room, else freed (it starts over by recompute)."""
    sched.running.remove(req)
    sched.counters["num_preemptions"] += 1
    if req.on_executor:
        sched.pending_finished_req_ids.append(req.req_id)
        req.on_executor = False
    req.spec_token_ids = []  # the executor forgets its proposal with it
    seq = sched.alloc.seqs.get(req.req_id)
    if (sched.preemption_mode == "swap" and seq is not None and seq.held_block_ids
            and len(seq.held_block_ids) <= sched.alloc.host.num_free_blocks):
        sched.kv.try_apply(KVSwapOut(req.req_id))
        sched.counters["num_swap_outs"] += 1
        sched.enqueue(sched.swapped, req, Status.SWAPPED)
        return
    sched.kv.try_apply(KVFree([req.req_id]))
    req.reset_for_recompute()
    sched.enqueue(sched.waiting, req, Status.WAITING)


def _swap_in(sched: SchedulerState, out: StepOutput, room: _Room) -> None:
    """Swapped-out sequences come back, in queue order, into fresh device blocks, while the
    budget, the sequence cap and the free blocks allow."""
    while sched.swapped and room.num_tokens > 0:
        req = sched.swapped[0]
        if not _adapter_may_run(sched, req, room):
            return
        num_new = _num_new_tokens(sched, req, room.num_tokens, room.whole_prefill_taken)
        seq = sched.alloc.seqs[req.req_id]
        num_host = len(seq.host_block_ids)
        need = max(num_host, cdiv(req.num_computed_tokens + num_new, sched.block_size) - seq.num_skipped_blocks)
        if room.num_seqs + 1 > sched.max_num_seqs or need > sched.alloc.num_free_blocks:
            return
        sched.swapped.pop(0)
        sched.kv.try_apply(KVSwapIn(req.req_id))
        sched.counters["num_swap_ins"] += 1
        sched.enqueue(sched.running, req, Status.RUNNING)
        if room.adapters is not None and req.lora_name:
            room.adapters.add(req.lora_name)
        if num_new and _grow(sched, req, num_new):
            _take(sched, out, req, num_new)
            room.num_tokens -= num_new
        room.num_seqs += 1


def _admit_waiting(sched: SchedulerState, out: StepOutput, room: _Room) -> None:
    """Waiting requests are admitted in queue order while they fit; nobody else overtakes the
    head of the queue, but a request waiting for its adapter's slot or its grammar lets those
    behind it pass."""
    j = 0
    while j < len(sched.waiting) and room.num_tokens > 0:
        req = sched.waiting[j]
        if not _adapter_may_run(sched, req, room):  # its adapter waits for a free slot; others go on
            j += 1
            continue
        _find_cached(sched, req)
        kv_import = _imports_kv(sched, req)
        # an import takes blocks for all its tokens but computes only its last (the prefill side's token)
        num_new = req.num_tokens - req.num_computed_tokens if kv_import else _chunk(sched, req, room)
        if not num_new and req.req_id in sched.grammar_gate.held and req.num_computed_tokens >= req.num_tokens - 1:
            # all it lacks is its grammar: the others go on
            req.num_computed_tokens = req.num_cached_tokens = 0
            j += 1
            continue
        cost = _seq_cost(sched, req)
        # without chunked prefill a prompt that does not fit waits for the next step
        if not num_new or room.num_seqs + cost > sched.max_num_seqs or not _grow(sched, req, num_new):
            req.num_computed_tokens = req.num_cached_tokens = 0
            return
        sched.waiting.pop(j)
        _admit(sched, out, req, num_new, kv_import, room)
        room.num_seqs += cost


def _admit(sched: SchedulerState, out: StepOutput, req: Request, num_new: int, kv_import: bool,
           room: _Room) -> None:
    """``req`` (its table grown) runs from this step on, with ``num_new`` tokens."""
    sched.enqueue(sched.running, req, Status.RUNNING)
    if room.adapters is not None and req.lora_name:
        room.adapters.add(req.lora_name)
    if not req.admitted:
        req.admitted = True
        sched.counters["num_prompt_tokens_total"] += req.num_prompt_tokens
    sched.counters["num_cached_tokens_total"] += req.num_cached_tokens
    req.counts_sent = False
    if kv_import:
        num_new = _import_kv(sched, out, req)
    room.whole_prefill_taken |= num_new > 1
    _take(sched, out, req, num_new)
    _spend(room, req, num_new)


def _seal(sched: SchedulerState, out: StepOutput) -> StepOutput | None:
    """End the step: its allocator log and copies, the grammars to compile; None when it holds
    nothing for the kvmanager or the executor."""
    sched.max_num_running = max(sched.max_num_running, len(sched.running))
    out.ops, (out.block_copies, out.swap_out, out.swap_in), out.digest = sched.kv.seal()
    out.tier_saves, out.tier_loads = sched.kv.tier_ops
    _time_prefill(sched, out)
    out.grammars, held = sched.grammar_gate.take_step()
    sched.counters["num_grammar_held_steps"] += held
    out.await_grammars = held and not out.scheduled  # nothing to run but a compile to wait for
    if not (out.scheduled or out.ops or sched.pending_finished_req_ids or out.grammars or out.await_grammars):
        return None
    sched.next_step_id += 1
    sched.counters["num_steps_planned_ahead"] += out.ahead
    return out


def _adapter_may_run(sched: SchedulerState, req: Request, room: _Room) -> bool:
    """Whether ``req`` may run beside the adapters running now: at most ``max_loras`` distinct
    adapters run at once, so that every step's fit in the executor's slots."""
    if not (req.lora_name and sched.max_loras):
        return True
    if room.adapters is None:
        room.adapters = {r.lora_name for r in sched.running if r.lora_name}
    return req.lora_name in room.adapters or len(room.adapters) < sched.max_loras


def _settle(sched: SchedulerState, keep: list[str]) -> None:
    """What waited for this step, in the log's fixed order: tables shrunk after rejected drafts,
    the last step's allocations confirmed as computed (not ``keep``'s: their step still runs),
    releases, a cache clear."""
    alloc, kept = sched.alloc, set(keep)
    for req_id, num_tokens in sched.pending_truncate:
        if sched.kv.try_apply(KVTruncate(req_id, num_tokens)) and req_id in sched.requests:
            sched.requests[req_id].table_changed = True
    if any(req_id not in kept for req_id in alloc.unconfirmed):
        sched.kv.try_apply(KVConfirm(sched.pending_discard_req_ids, [r for r in keep if r in alloc.unconfirmed]))
    released = sched.pending_free_req_ids + sched.pending_discard_req_ids
    if released:
        sched.kv.try_apply(KVFree(released))
    if sched.pending_clear:
        sched.num_cache_blocks_cleared = sched.kv.try_apply(KVClear())
    sched.pending_truncate, sched.pending_free_req_ids, sched.pending_discard_req_ids = [], [], []
    sched.pending_clear = False


def _plain_decodes(sched: SchedulerState, out: StepOutput, i: int, budget: int) -> tuple[int, int]:
    """Schedule ``running[i:]`` while they are plain decodes: one token, no forks, drafts or
    grammar, and room for it in the table or a new block for it (no copy). This is most of
    every step and runs for each running sequence, so it is the inline form of
    ``_num_new_tokens``, ``_grow``, ``_take`` and ``plan_request`` for that case. Returns where it
    stopped (a sequence for the general path), and the budget left."""
    running, scheduled, end = sched.running, out.scheduled, len(sched.running)
    num_scheduled, samplers = out.num_scheduled, out.samplers
    bs, seqs, ref_counts = sched.block_size, sched.alloc.seqs, sched.alloc.device.ref_counts
    running_reqs = out.running_reqs
    num_placeholders = 0
    while i < end and budget > 0:
        req = running[i]
        if req.pending_forks or req.spec_token_ids or req.grammar is not None or req.sampling.pooling is not None:
            break  # (a pooling request's last prompt token pools: ``plan_request``)
        start, pending, num_output = req.num_computed_tokens, req.num_pending, len(req.output_token_ids)
        if len(req.prompt_token_ids) + num_output + pending - start != 1:
            break
        if pending and num_output + pending >= req.max_tokens:
            break  # the tokens in flight are its last
        seq = seqs.get(req.req_id)
        if seq is None or seq.host_block_ids is not None:
            break
        num_blocks = len(seq.block_ids)
        if start >= num_blocks * bs:  # its token starts a block: ``_grow``'s case without a copy
            if not _allocate(sched, req, start, start + 1):
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
            plan_request(sched, out, req, 1)
        budget -= 1
        i += 1
    out.num_placeholders += num_placeholders
    return i, budget


def _find_cached(sched: SchedulerState, req: Request) -> None:
    """A sequence new to the allocator starts after the blocks the prefix cache holds for it;
    those tokens cost nothing from the token budget. Requests that want prompt logprobs
    neither hit nor feed the cache (a cached prompt token would have no logprob)."""
    if req.req_id in sched.alloc.seqs or req.sampling.prompt_logprobs is not None or _bidirectional(req):
        return
    end = req.num_prompt_tokens - 1 if req.pending_forks else req.num_tokens
    # at least one token is left to compute: the last one, which samples
    max_blocks = (end - 1) // sched.block_size
    num_blocks = sched.alloc.num_cached_blocks(req.all_token_ids, req.kv_salt, max_blocks)
    req.kv_load_hashes = []
    if sched.disk is not None and num_blocks < max_blocks:  # then the disk tier's files (verified)
        hashes = sched.alloc.prefix_hashes(req.all_token_ids, req.kv_salt, max_blocks)
        req.kv_load_hashes = sched.disk.find_run(hashes[num_blocks:], sched.block_size, sched.tier_cost)
        num_blocks += len(req.kv_load_hashes)
    req.num_computed_tokens = req.num_cached_tokens = num_blocks * sched.block_size


def _time_prefill(sched: SchedulerState, out) -> None:
    """The cost model's prefill rate: a step with a long prefill takes about as long as the
    time to the next plan (rough, and enough: loads win or lose by an order of magnitude)."""
    now = time.perf_counter()
    if sched.last_prefill is not None:
        t, n = sched.last_prefill
        sched.tier_cost.observe_prefill(n, now - t)
    n = sum(k for _, k in out.scheduled if k > 1)
    sched.last_prefill = (now, n) if n >= 256 and sched.disk is not None else None


def _imports_kv(sched: SchedulerState, req: Request) -> bool:
    """Whether ``req`` takes its prompt's KV from a prefill instance now: a handle for exactly its
    prompt, the prefill side's token forced after it, and a plain table (no sliding window, no
    prompt logprobs, no choices to fork)."""
    h = req.kv_transfer
    if h is None:
        return False
    ok = (req.num_tokens == req.num_prompt_tokens + 1 and h.get("num_tokens") == req.num_prompt_tokens
          and h.get("num_blocks") == cdiv(req.num_prompt_tokens, sched.block_size)
          and req.req_id not in sched.alloc.seqs and not sched.alloc.sliding_window
          and req.sampling.prompt_logprobs is None and not req.pending_forks)
    if not ok:
        req.kv_transfer = None  # computed here instead
    return ok


def _import_kv(sched: SchedulerState, out: StepOutput, req: Request) -> int:
    """Plan the pull of ``req``'s prompt KV into its new table (the blocks its prefix-cache hit
    holds already are skipped); the step computes only its last token. Returns that 1."""
    bs, start = sched.block_size, req.num_computed_tokens
    table = sched.alloc.seqs[req.req_id].block_ids
    handle, req.kv_transfer = req.kv_transfer, None
    block_ids = [b if i >= start // bs else -1 for i, b in enumerate(table[:handle["num_blocks"]])]
    out.kv_loads.append(KVLoad(req_id=req.req_id, handle=handle, block_ids=block_ids,
                               fallback_computed_tokens=start))
    sched.counters["num_kv_imported_tokens"] = sched.counters.get("num_kv_imported_tokens", 0) + \
        req.num_prompt_tokens - start
    req.num_computed_tokens = req.num_prompt_tokens
    return 1


def _grow(sched: SchedulerState, req: Request, num_new: int) -> bool:
    """Make room in ``req``'s table for its next ``num_new`` tokens (False: refused, nothing
    changed); a table new here is salted with the request's cache salt and adapter."""
    alloc, start = sched.alloc, req.num_computed_tokens
    end = start + num_new
    if not alloc.changes_table(req.req_id, start, end):
        return True
    num_copies = len(alloc.block_copies)
    if not _allocate(sched, req, start, end, req.kv_salt if req.req_id not in alloc.seqs else None):
        return False
    if len(alloc.block_copies) > num_copies:
        req.table_changed = True  # copy-on-write replaced a block inside its table
    return True


def _allocate(sched: SchedulerState, req: Request, start: int, end: int, cache_salt: str | None = None) -> bool:
    """Apply the allocation of ``req``'s tokens [start, end) to the replica (False: refused,
    nothing changed). The tokens the allocator has not seen ride along, so that it hashes the
    blocks they fill; draft tokens are not known until accepted."""
    # (prompt logprobs and bidirectional inputs leave their tokens out: no block of theirs is hashed)
    known = min(end, req.num_tokens) if req.sampling.prompt_logprobs is None and not _bidirectional(req) \
        else req.num_kv_token_ids
    op = KVAllocate(req.req_id, start, end, req.token_slice(req.num_kv_token_ids, known), cache_salt,
                    (getattr(req, "kv_load_hashes", None) or []) if req.req_id not in sched.alloc.seqs else [])
    if sched.kv.try_apply(op) is None:
        return False
    req.num_kv_token_ids = max(req.num_kv_token_ids, known)
    return True


def _num_new_tokens(sched: SchedulerState, req: Request, budget: int, whole_prefill_taken: bool) -> int:
    """Tokens ``req`` computes this step (0: none, or its whole prompt does not fit)."""
    end = req.num_tokens + req.num_pending  # tokens in flight decode as placeholders
    if req.pending_forks:
        end = req.num_prompt_tokens - 1  # its choices fork off before the last prompt token
        sched.grammar_gate.holds(req)  # (their grammar compiles meanwhile)
    elif sched.grammar_gate.holds(req):
        end -= 1  # the token it samples from waits for its grammar
    elif req.num_pending and len(req.output_token_ids) + req.num_pending >= req.max_tokens:
        return 0  # the tokens in flight are its last
    remaining = end - req.num_computed_tokens
    if remaining == 1 and req.spec_token_ids and req.on_executor and not req.num_pending:  # a decode that verifies its drafts
        # (the executor holds the proposal: a request it dropped, swapped or new, has none)
        left = req.max_tokens - len(req.output_token_ids)  # it gains at most drafts + 1
        room = (sched.max_model_len or 1 << 30) - req.num_tokens
        return 1 + max(0, min(len(req.spec_token_ids), left - 1, room, budget - 1))
    if remaining <= 1:
        return max(remaining, 0)
    if _bidirectional(req):  # its tokens all see each other: the whole input in one step, or it waits
        return remaining if remaining <= budget else 0
    if not sched.enable_chunked_prefill:
        return remaining if remaining <= budget or not whole_prefill_taken else 0
    if sched.long_prefill_token_threshold:
        remaining = min(remaining, sched.long_prefill_token_threshold)
    return min(remaining, budget)


def _bidirectional(req: Request) -> bool:
    """An encoder-only model's input (``PoolingParams.bidirectional``): never chunked, never cached."""
    return req.sampling.pooling is not None and req.sampling.pooling.bidirectional


def _victim(sched: SchedulerState, i: int) -> Request | None:
    """The last sequence in queue order after position ``i`` (not yet scheduled this step)."""
    return sched.running[-1] if len(sched.running) - 1 > i else None


def _seq_cost(sched: SchedulerState, req: Request) -> int:
    """Against ``max_num_seqs``: a request with choices to fork counts them; a beam search
    counts its width once, whichever beam is admitted first."""
    if req.group is None:
        return req.num_seqs
    return 0 if any(r.group is req.group for r in sched.running) else req.group.width


def _num_seqs(sched: SchedulerState) -> int:
    groups = {r.group for r in sched.running if r.group is not None}
    return sum(r.num_seqs for r in sched.running if r.group is None) + sum(g.width for g in groups)


def _take(sched: SchedulerState, out: StepOutput, req: Request, num_new: int) -> None:
    """Schedule ``num_new`` tokens of ``req`` and record its part of the plan (``_plain_decodes``
    does it inline for decodes)."""
    out.scheduled.append((req, num_new))
    if req.pending_forks or req.grammar is not None:
        out.waits_for_result = True
    if num_new > 1 and req.num_tokens - req.num_computed_tokens == 1:
        out.spec_token_ids[req.req_id] = req.spec_token_ids[:num_new - 1]
    if req.first_scheduled_time is None:
        req.first_scheduled_time = time.time()
    plan_request(sched, out, req, num_new)


class Scheduler(SchedulerState):
    """The scheduler: its state (``state.SchedulerState``, read top to bottom) with the policy's
    functions as its verbs."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int | None = None, *,
                 enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                 preemption_mode: str = "recompute", scheduling_policy: str = "fcfs", max_loras: int | None = None,
                 max_pooling_tokens_per_step: int = 16, max_num_encoder_input_tokens: int = 0):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {scheduling_policy!r}")
        super().__init__(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len_limit=max_model_len, max_model_len=max_model_len,
                         enable_chunked_prefill=enable_chunked_prefill,
                         long_prefill_token_threshold=max(0, long_prefill_token_threshold),
                         preemption_mode=preemption_mode, scheduling_policy=scheduling_policy, max_loras=max_loras,
                         max_pooling_tokens_per_step=max(0, max_pooling_tokens_per_step),
                         max_num_encoder_input_tokens=max(0, max_num_encoder_input_tokens))

    # the pool and its epochs (this module)
    set_pool = set_pool
    new_epoch = new_epoch
    clear_cache = clear_cache
    # requests in and out (``admission.py``)
    add_request = add_request
    abort = abort
    remove = remove
    # one step: its choice (this module), its plan and its result (``executor_step.py``)
    schedule = schedule
    build_plan = build_plan
    can_plan_ahead = can_plan_ahead
    kv_request = staticmethod(kv_request)
    update_from_result = update_from_result
