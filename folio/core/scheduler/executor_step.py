"""The executor's side of a step: the plan it is sent and its result. Functions over the
scheduler's state (``state.SchedulerState``).

``plan_request`` records, as ``schedule`` takes each sequence, its part of the executor's per-step
diff (new requests in full, running ones as the blocks they gained), and ``build_plan`` sends what
was recorded; ``update_from_result`` appends the sampled tokens,
finishes what is done (stop tokens, ``max_tokens``, a failed step), hands beams' candidates to their
group (``forks.py``), counts accepted drafts and shrinks tables back after rejected ones.
"""

from __future__ import annotations

from folio.core.scheduler.admission import remove
from folio.core.scheduler.forks import BeamGroup
from folio.core.scheduler.request import Request, Status
from folio.core.scheduler.state import SchedulerState, StepOutput
from folio.core.kv.allocator import cdiv
from folio.shared.messages import (
    KVStepRequest,
    NewRequestData,
    RunningRequestData,
    StepPlan,
    StepResult,
    TokenBatch,
    TokenDelta,
)


def plan_request(sched: SchedulerState, out: StepOutput, req: Request, num_new: int) -> None:
    """Record ``req``'s part of the executor's per-step diff as ``schedule`` takes it: a new
    request in full; a running one only when the executor must learn something it does not
    hold (blocks it gained, its whole table when blocks inside it changed, tokens appended
    here, or a count of computed tokens other than the one it advanced to itself: drafts
    rolled back, a failed step). A plain decode is just its count (``_plain_decodes`` has the
    inline form of that case). Its computed tokens advance past the step's."""
    req_id, start, pending = req.req_id, req.num_computed_tokens, req.num_pending
    if pending:
        out.num_placeholders += 1
    table = sched.alloc.seqs[req_id].block_ids
    if not req.on_executor:
        out.new_reqs.append(NewRequestData(
            req_id=req_id, token_ids=req.all_token_ids, num_prompt_tokens=req.num_prompt_tokens,
            sampling=req.sampling, grammar=req.grammar, block_ids=list(table), num_computed_tokens=start,
            append_sampled=req.append_sampled, lora_name=req.lora_name, kv_export_peer=req.kv_export_peer,
            images=req.images))
        req.on_executor = True
        req.unsent_token_ids, req.num_sent_blocks, req.table_changed = [], len(table), False
    elif (req.table_changed or len(table) > req.num_sent_blocks or req.unsent_token_ids
          or start != req.executor_computed):
        changed = req.table_changed
        out.running_reqs.append(RunningRequestData(
            req_id=req_id, new_block_ids=[] if changed else table[req.num_sent_blocks:],
            num_computed_tokens=start, new_token_ids=req.unsent_token_ids,
            block_ids=list(table) if changed else None))
        req.unsent_token_ids, req.num_sent_blocks, req.table_changed = [], len(table), False
    out.num_scheduled[req_id] = num_new
    req.num_computed_tokens = req.executor_computed = end = start + num_new
    if end >= len(req.prompt_token_ids) + len(req.output_token_ids) + pending:  # it samples (or pools)
        if req.sampling.pooling is not None:  # prefill only: it ends with this step, nothing pending
            out.poolers.append(req)
            return
        out.samplers.append(req)
        req.num_pending = pending + 1


def build_plan(sched: SchedulerState, out: StepOutput) -> StepPlan:
    """The executor's per-step diff that ``schedule`` recorded, with the requests that
    finished since the last plan."""
    finished, sched.pending_finished_req_ids = sched.pending_finished_req_ids, []
    c = sched.counters
    c["num_steps"] += 1
    c["num_scheduled_seqs_total"] += len(out.scheduled)
    sched.last_batch_size, sched.last_num_scheduled_tokens = len(out.scheduled), sum(out.num_scheduled.values())
    c["num_scheduled_tokens_total"] += sched.last_num_scheduled_tokens
    return StepPlan(step_id=out.step_id, new_reqs=out.new_reqs, running_reqs=out.running_reqs,
                    num_scheduled_tokens=out.num_scheduled, finished_req_ids=finished,
                    spec_token_ids=out.spec_token_ids, block_copies=out.block_copies,
                    swap_out=out.swap_out, swap_in=out.swap_in, grammars=out.grammars,
                    await_grammars=out.await_grammars, num_placeholder_tokens=out.num_placeholders,
                    kv_loads=out.kv_loads, tier_saves=out.tier_saves, tier_loads=out.tier_loads)


def can_plan_ahead(sched: SchedulerState, in_flight: StepOutput) -> bool:
    """Whether the next step may be planned before ``in_flight``'s result (async scheduling):
    not when the result decides what the next step is beyond one more token per sampler:
    drafts to verify or about to be proposed (the executor says in each result whether the next
    one may carry drafts), beams to pick, choices to fork, grammars (a row whose grammar ended
    must not sample again), or growth that needs preemption (``needs_sync``)."""
    return not ((sched.speculative and sched.drafts_next) or sched.needs_sync or sched.forks.unforked or sched.forks.groups
                or in_flight.spec_token_ids or in_flight.grammars or in_flight.await_grammars
                or in_flight.waits_for_result)


def kv_request(out: StepOutput, generation: int) -> KVStepRequest:
    return KVStepRequest(step_id=out.step_id, generation=generation, ops=out.ops)


def update_from_result(sched: SchedulerState, out: StepOutput, result: StepResult) -> TokenBatch:
    """Append sampled tokens, finish requests that are done; one delta per request that moved,
    in the step's ``TokenBatch`` for the tokenizer. A request's first delta after each
    admission carries its prompt and cached token counts (and the first its queue time);
    later ones carry just their tokens, unless they finish: those go into the batch's flat
    plain arrays."""
    deltas: list[TokenDelta] = _grammar_reports(sched, result)
    sched.drafts_next = result.drafts_next
    plain_req_ids: list[str] = []
    plain_token_ids: list[int] = []
    groups: list[BeamGroup] = []
    requests, finished_status = sched.requests, Status.FINISHED
    for req in out.samplers:
        req.num_pending -= 1
    num_generated = num_finished = 0
    # most steps: one token per request and nothing else (no logprobs, drafts or proposals);
    # those requests take this loop's inline path, the rest ``_update_one``
    plain = not (result.logprobs or result.spec_token_ids or result.prompt_logprobs or out.spec_token_ids
                 or result.num_sampled)
    token_ids, num_sampled, at = result.token_ids, result.num_sampled, 0
    for idx, req_id in enumerate(result.req_ids):
        req = requests.get(req_id)
        if plain and req is not None and req.group is None and req.counts_sent and req.status is not finished_status:
            if req.spec_token_ids:
                req.spec_token_ids = []
            token_id = token_ids[idx]
            output = req.output_token_ids
            output.append(token_id)
            num_generated += 1
            if not (token_id in req.stop_token_ids or (token_id == req.eos_token_id and not req.sampling.ignore_eos)
                    or len(output) >= req.max_tokens):
                plain_req_ids.append(req_id)
                plain_token_ids.append(token_id)
                continue
            deltas.append(TokenDelta(req_id=req_id, token_ids=[token_id], finish_reason=req.stop_reason(token_id)))
            sched.release(req)
        else:
            if num_sampled:  # several tokens for some request: this one's run of them
                sampled = token_ids[at : at + num_sampled[idx]]
                at += num_sampled[idx]
            else:
                sampled = token_ids[idx : idx + 1]
            if req is None or req.status is finished_status:
                continue  # aborted while the step ran
            num_generated += _update_one(sched, req, idx, sampled, result, out, deltas, groups)
            if req.status is not finished_status:
                continue
        num_finished += 1
    if out.poolers:
        num_finished += _pooled(sched, out, result, deltas)
    c = sched.counters
    c["num_generation_tokens_total"] += num_generated
    c["num_requests_finished"] += num_finished
    _end_step(sched, out, result, deltas, groups, released=num_finished > 0)
    return TokenBatch(step_id=out.step_id, deltas=deltas, plain_req_ids=plain_req_ids,
                      plain_token_ids=plain_token_ids)


def _pooled(sched: SchedulerState, out: StepOutput, result: StepResult, deltas: list[TokenDelta]) -> int:
    """Pooling requests whose last prompt chunk ran end with their vector (one delta each, no
    token). One the result left out is failed by ``_end_step``. Returns how many ended here."""
    num = 0
    for req in out.poolers:
        vector = result.pooled.get(req.req_id)
        if vector is None or req.status is Status.FINISHED:
            continue  # aborted while the step ran, or left out (failed below)
        deltas.append(TokenDelta(req_id=req.req_id, token_ids=[], finish_reason="stop", pooled=vector,
                                 num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
                                 queue_time_s=req.take_queue_time()))
        req.counts_sent = True
        sched.release(req)
        num += 1
    return num


def _end_step(sched: SchedulerState, out: StepOutput, result: StepResult, deltas: list[TokenDelta],
              groups: list[BeamGroup], released: bool) -> None:
    """After the step's tokens are appended: the beam searches whose every beam reported move on,
    samplers the result left out fail, and what finished leaves the running queue."""
    for group in groups:
        deltas.extend(sched.forks.advance_beams(group))
        released = True
    if (result.error or result.req_ids != [req.req_id for req in out.samplers]
            or any(req.req_id not in result.pooled for req in out.poolers)):
        released |= _fail_unreported(sched, out, result, deltas)
    if released:
        sched.running = [r for r in sched.running if r.status is not Status.FINISHED]


def _update_one(sched: SchedulerState, req: Request, idx: int, sampled: list[int], result: StepResult, out: StepOutput,
                deltas: list[TokenDelta], groups: list[BeamGroup]) -> int:
    """``update_from_result`` for a request off its inline path: a beam, drafts verified,
    logprobs, several tokens, or its first delta. Returns the tokens it gained; a request
    that ends here is released (``status`` says so)."""
    req_id = req.req_id
    all_logprobs = result.logprobs
    logprobs = all_logprobs[idx] if idx < len(all_logprobs) else None
    if req.group is not None:
        if logprobs:
            sched.forks.report_beam(req, logprobs[-1], groups)
        return 0
    drafts = out.spec_token_ids.get(req_id) if out.spec_token_ids else None
    if drafts:
        _count_accepted(sched, len(drafts), len(sampled) - 1)
    if idx < len(result.spec_token_ids):
        req.spec_token_ids = result.spec_token_ids[idx]
    elif req.spec_token_ids:
        req.spec_token_ids = []
    token_ids, reason = _append(req, sampled)
    prompt_lp, prompt_lps = None, result.prompt_logprobs
    if prompt_lps and req_id in prompt_lps and not req.prompt_logprobs_sent:
        prompt_lp, req.prompt_logprobs_sent = prompt_lps[req_id], True
    if req.counts_sent and reason is None:
        deltas.append(TokenDelta(req_id=req_id, token_ids=token_ids, logprobs=logprobs, prompt_logprobs=prompt_lp))
    else:
        req.counts_sent = True
        deltas.append(TokenDelta(req_id=req_id, token_ids=token_ids, logprobs=logprobs,
                                 prompt_logprobs=prompt_lp, finish_reason=reason,
                                 num_prompt_tokens=len(req.prompt_token_ids),
                                 num_cached_tokens=req.num_cached_tokens, queue_time_s=req.take_queue_time()))
    if reason is not None:
        sched.release(req)
    elif drafts:
        _roll_back(sched, req)
    return len(token_ids)


def _fail_unreported(sched: SchedulerState, out: StepOutput, result: StepResult, deltas: list[TokenDelta]) -> bool:
    """Samplers that got nothing: the executor failed the step for them; never leave them
    stuck. The step's other requests may not have advanced there either: the next plan tells
    the executor their counts again. A step the executor refused or failed (``error``) ends
    every request it scheduled: their KV for it was never written."""
    reported = set(result.req_ids) | set(result.pooled)
    failing = [req for req, _ in out.scheduled] if result.error else out.samplers + out.poolers
    failed = False
    for req in failing:
        if not req.finished and req.req_id not in reported:
            deltas.extend(_fail(sched, req, result.error))
            failed = True
    if failed:
        for req, _ in out.scheduled:
            req.executor_computed = -1
    return failed


def _grammar_reports(sched: SchedulerState, result: StepResult) -> list[TokenDelta]:
    """Grammars the executor compiled (their requests may sample from now on), and those it
    could not: their requests end with the reason."""
    if not (result.grammars_ready or result.grammar_errors):
        return []
    errors = result.grammar_errors
    sched.grammar_gate.report(result.grammars_ready, errors)
    failed = [r for r in sched.requests.values() if r.grammar is not None and r.grammar.key in errors]
    deltas = []
    for req in failed:
        if req.req_id in sched.requests and remove(sched, req.req_id):
            sched.counters["num_grammar_errors"] += 1
            deltas.append(TokenDelta(req_id=req.req_id, token_ids=[], finish_reason="error", error_code=500,
                                     error=errors[req.grammar.key],
                                     num_prompt_tokens=req.num_prompt_tokens))
    return deltas


def _append(req: Request, token_ids: list[int]) -> tuple[list[int], str | None]:
    """Append sampled tokens up to the first that ends the request (the caller counts them)."""
    for n, token_id in enumerate(token_ids, start=1):
        req.output_token_ids.append(token_id)
        reason = req.stop_reason(token_id)
        if reason is not None:
            return token_ids[:n], reason
    return token_ids, None


def _fail(sched: SchedulerState, req: Request, why: str = "") -> list[TokenDelta]:
    error = f"the executor did not run this request's step: {why}" if why \
        else "the executor did not return a token for this request"
    if req.group is not None:
        group = req.group
        sched.forks.end_group(group)
        ids = group.choice_ids
    else:
        sched.release(req)
        ids = [req.req_id]
    _discard(sched, req.req_id)  # its step failed: its blocks may hold nothing
    return [TokenDelta(req_id=i, token_ids=[], finish_reason="error", error=error,
                       num_prompt_tokens=req.num_prompt_tokens) for i in ids]


def _discard(sched: SchedulerState, req_id: str) -> None:
    """Its release becomes a discard: the allocator must not index what never ran."""
    if req_id in sched.pending_free_req_ids:
        sched.pending_free_req_ids.remove(req_id)
        sched.pending_discard_req_ids.append(req_id)


def _roll_back(sched: SchedulerState, req: Request) -> None:
    """After verification the KV of the last token and the accepted drafts is kept; the
    rejected drafts' slots are not: the table shrinks back first thing in the next step
    (``KVTruncate``), and the executor then gets it whole."""
    req.num_computed_tokens = req.num_tokens - 1
    seq = sched.alloc.seqs.get(req.req_id)
    if seq is not None and len(seq.block_ids) > cdiv(req.num_computed_tokens, sched.block_size):
        sched.pending_truncate.append((req.req_id, req.num_computed_tokens))


def _count_accepted(sched: SchedulerState, num_drafts: int, num_accepted: int) -> None:
    c = sched.counters
    c["num_spec_drafts"] += 1
    c["num_spec_draft_tokens"] += num_drafts
    c["num_spec_accepted_tokens"] += num_accepted
    per_pos = sched.spec_accepted_per_pos
    per_pos.extend([0] * (num_drafts - len(per_pos)))
    for pos in range(num_accepted):
        per_pos[pos] += 1
