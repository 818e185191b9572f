"""Requests in and out of the scheduler's queues: admission (or a clear refusal), aborts.
Functions over the scheduler's state (``state.SchedulerState``)."""

from __future__ import annotations

from folio.core.scheduler.request import Request, Status
from folio.core.scheduler.state import SchedulerState
from folio.core.kv.allocator import cdiv
from folio.shared.messages import EngineRequest, TokenDelta


def add_request(sched: SchedulerState, msg: EngineRequest) -> list[TokenDelta]:
    """Queue a request (with its choices); one that can never run is refused with "error" deltas."""
    error, code = _refusal(sched, msg)
    if error is not None:
        sched.counters["num_requests_rejected"] += 1
        return [TokenDelta(req_id=req_id, token_ids=[], finish_reason="error", error=error, error_code=code,
                           num_prompt_tokens=len(msg.prompt_token_ids))
                for req_id in (msg.req_id, *msg.fork_req_ids)]
    priority = msg.priority if sched.scheduling_policy == "priority" else 0
    arrival, sched.next_arrival = sched.next_arrival, sched.next_arrival + 1
    max_tokens = max_tokens_of(sched, msg)
    if msg.sampling.use_beam_search:
        sched.forks.add_beam_search(msg, max_tokens, priority, arrival)
        return []
    first = Request.from_message(msg, max_tokens)
    first.key = (priority, arrival, 0)
    others = [Request.from_message(msg, max_tokens, req_id, msg.sampling.with_seed_offset(i))
              for i, req_id in enumerate(msg.fork_req_ids, start=1)]
    for i, req in enumerate(others, start=1):
        req.key = (priority, arrival, i)
        sched.requests[req.req_id] = req
    # forking needs a computed prefix to share; prompt logprobs are per choice
    if len(first.prompt_token_ids) > 1 and msg.sampling.prompt_logprobs is None:
        sched.forks.defer(first, others)
        others = []
    sched.requests[first.req_id] = first
    for req in (first, *others):
        sched.enqueue(sched.waiting, req, Status.WAITING)
    return []


def max_tokens_of(sched: SchedulerState, msg: EngineRequest) -> int:
    """The output tokens a request may have: its ``max_tokens``, or, when that is None, what the
    context leaves after its prompt (0: the context length is unknown). A pooling request has
    none: it finishes after its prompt."""
    if msg.sampling.pools:
        return 0
    if msg.sampling.max_tokens is not None:
        return msg.sampling.max_tokens
    return max(sched.max_model_len - len(msg.prompt_token_ids), 0) if sched.max_model_len else 0


def _refusal(sched: SchedulerState, msg: EngineRequest) -> tuple[str | None, int]:
    num_prompt, max_tokens = len(msg.prompt_token_ids), max_tokens_of(sched, msg)
    if sched.draining:
        return "the server is draining: it admits no new requests", 503
    ids = [msg.req_id, *msg.fork_req_ids]
    if len(set(ids)) != len(ids) or any(i in sched.requests or i in sched.forks.groups for i in ids):
        return f"request id {msg.req_id!r} (or one of its choices) is already in use", 400
    if num_prompt == 0:
        return "the prompt is empty", 400
    if msg.sampling.pools:
        return _pooling_refusal(sched, msg, num_prompt)
    if msg.sampling.max_tokens is None and not sched.max_model_len:
        return "max_tokens is needed: the model's context length is unknown", 400
    if max_tokens < 1:
        return f"max_tokens must be at least 1, got {max_tokens}", 400
    beam_width = msg.sampling.num_sequences if msg.sampling.use_beam_search else 0
    if msg.forced_token_ids and (beam_width or msg.fork_req_ids):
        return "a continuation (forced output tokens) is one choice, without beam search", 400
    if len(msg.forced_token_ids) >= max_tokens:
        return (f"the continuation has {len(msg.forced_token_ids)} output tokens already, max_tokens is "
                f"{max_tokens}: nothing is left to generate"), 400
    if beam_width and msg.lora_name:
        return "beam search with a LoRA adapter is not supported", 400
    if beam_width and not 1 <= len(ids) <= beam_width:
        return f"beam search returns at most its width ({beam_width}) choices, {len(ids)} asked", 400
    num_seqs = beam_width or len(ids)
    if num_seqs > sched.max_num_seqs:
        return (f"the request runs {num_seqs} sequences at once (its choices or beams) but the server runs at "
                f"most {sched.max_num_seqs} (--max-num-seqs)"), 400
    if sched.max_model_len and num_prompt + max_tokens > sched.max_model_len:
        return (f"This model's maximum context length is {sched.max_model_len} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or completion."), 400
    # the last sampled token is never fed back, so its KV needs no slot
    need = cdiv(num_prompt + max_tokens - 1, sched.block_size)
    window = sched.pool.sliding_window
    if window:  # blocks behind the window go back: a step holds its chunk and the window before it
        chunk = num_prompt if not sched.enable_chunked_prefill else min(num_prompt, sched.max_num_batched_tokens)
        need = min(need, cdiv(window - 1 + chunk, sched.block_size) + 1)
    if need > sched.pool.num_blocks:
        return (f"the request needs {need} KV blocks ({num_prompt} prompt + {max_tokens} completion tokens) "
                f"but the whole KV cache holds {sched.pool.num_blocks}"), 400
    return None, 400


def _pooling_refusal(sched: SchedulerState, msg: EngineRequest, num_prompt: int) -> tuple[str | None, int]:
    """A pooling request: one sequence whose prompt fits the context and the pool (it needs no
    block for a token it will never generate)."""
    if msg.fork_req_ids or msg.sampling.use_beam_search or msg.forced_token_ids:
        return "a pooling request is one sequence: no choices, beams or forced tokens", 400
    if sched.max_model_len and num_prompt > sched.max_model_len:
        return (f"This model's maximum context length is {sched.max_model_len} tokens. However, the input "
                f"has {num_prompt} tokens. Please reduce the length of the input."), 400
    if msg.sampling.pooling.bidirectional and num_prompt > sched.max_num_batched_tokens:
        return (f"the input has {num_prompt} tokens but a step computes at most {sched.max_num_batched_tokens} "
                "(--max-num-batched-tokens), and an encoder-only model computes each input whole in one step"), 400
    need = cdiv(num_prompt, sched.block_size)
    if need > sched.pool.num_blocks:
        return f"the input needs {need} KV blocks but the whole KV cache holds {sched.pool.num_blocks}", 400
    return None, 400


def abort(sched: SchedulerState, req_id: str) -> bool:
    """Drop a request (all of a beam search, whichever choice is named); its blocks go back in
    the next step."""
    if not remove(sched, req_id):
        return False
    sched.counters["num_requests_aborted"] += 1
    return True


def remove(sched: SchedulerState, req_id: str) -> bool:
    """``abort`` without counting it."""
    group = sched.forks.groups.get(req_id)
    if group is not None:
        sched.forks.end_group(group)
        return True
    req = sched.requests.get(req_id)
    if req is None:
        return False
    if req.group is not None:  # one beam named by its own id: the whole search goes
        sched.forks.end_group(req.group)
    elif req.status is Status.FORKING:  # a choice not forked yet
        req.fork_parent.pending_forks.remove(req)
        del sched.requests[req_id]
    else:
        sched.forks.orphan(req)
        sched.dequeue(req)
        sched.release(req)
    return True
