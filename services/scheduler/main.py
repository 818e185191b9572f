"""``folio run scheduler``: parse flags (vLLM's names), run the scheduler until SIGTERM/SIGINT."""

from __future__ import annotations

import sys

from folio.shared.config import SchedulerConfig
from folio.services.shell import ServiceSpec


def open_service(config: SchedulerConfig, ctx, log):
    from folio.services.scheduler.service import SchedulerService

    return SchedulerService(config, ctx)


def starting(config: SchedulerConfig) -> dict:
    return {"max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
            "enable_chunked_prefill": config.enable_chunked_prefill, "preemption_mode": config.preemption_mode,
            "scheduling_policy": config.scheduling_policy}


SPEC = ServiceSpec("scheduler", SchedulerConfig, "the continuous-batching scheduler", open_service,
                   starting=starting)

parse_config, main = SPEC.config, SPEC.main

if __name__ == "__main__":
    sys.exit(main())
