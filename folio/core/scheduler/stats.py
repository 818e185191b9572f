"""The scheduler's statistics, as ``folio scheduler stats|requests`` and ``/metrics`` read them.

The policy (``policy.py``, ``executor_step.py``, ``forks.py``) only counts (``Scheduler.counters``) and
keeps its queues; what is derived from them for people is built here, when asked.
"""

from __future__ import annotations

from folio.core.scheduler.policy import Scheduler


def scheduler_stats(sched: Scheduler) -> dict:
    """Queue lengths, counters, batch sizes and token-budget use, speculative acceptance, limits."""
    c, steps = sched.counters, max(1, sched.counters["num_steps"])
    return {
        "num_running": len(sched.running),
        "num_waiting": len(sched.waiting) + sum(len(r.pending_forks) for r in sched.waiting),
        "num_swapped": len(sched.swapped),
        **c,
        "num_free_blocks": sched.alloc.num_free_blocks,
        "num_blocks_total": sched.pool.num_blocks if sched.pool else 0,
        "num_free_host_blocks": sched.alloc.host.num_free_blocks,
        "max_num_running": sched.max_num_running,
        "last_batch_size": sched.last_batch_size,
        "mean_batch_size": c["num_scheduled_seqs_total"] / steps,
        "last_token_budget_use": sched.last_num_scheduled_tokens / sched.max_num_batched_tokens,
        "mean_token_budget_use": c["num_scheduled_tokens_total"] / steps / sched.max_num_batched_tokens,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_model_len": sched.max_model_len,
        "enable_chunked_prefill": sched.enable_chunked_prefill,
        "long_prefill_token_threshold": sched.long_prefill_token_threshold,
        "max_pooling_tokens_per_step": sched.max_pooling_tokens_per_step,
        "max_num_encoder_input_tokens": sched.max_num_encoder_input_tokens,
        "preemption_mode": sched.preemption_mode,
        "scheduling_policy": sched.scheduling_policy,
        "draining": sched.draining,
        "spec_accepted_per_pos": list(sched.spec_accepted_per_pos),
        "spec_acceptance_rate": (sched.counters["num_spec_accepted_tokens"]
                                 / max(1, sched.counters["num_spec_draft_tokens"])),
        "spec_mean_accepted_length": 1 + (sched.counters["num_spec_accepted_tokens"]
                                          / max(1, sched.counters["num_spec_drafts"])),
    }


def describe_requests(sched: Scheduler) -> list[dict]:
    """Each request: its status, sizes, blocks, and the beam search it belongs to."""
    return [
        {"req_id": r.req_id, "status": r.status.value, "priority": r.key[0],
         "num_prompt_tokens": r.num_prompt_tokens, "num_output_tokens": len(r.output_token_ids),
         "num_computed_tokens": r.num_computed_tokens, "num_cached_tokens": r.num_cached_tokens,
         "num_blocks": len(sched.alloc.block_table(r.req_id)), "beam_of": r.group.req_id if r.group is not None else None}
        for r in sched.requests.values()
    ]
