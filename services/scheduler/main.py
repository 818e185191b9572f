"""``folio run scheduler``: parse flags (vLLM's names), run the scheduler until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import sys

import zmq.asyncio

from shared.config import Endpoints, RuntimeConfig, SchedulerConfig, log_json_from_env
from shared.flags import add_common_args
from shared.logs import setup_logging
from shared.loops import run_until_signal


def parse_config(argv: list[str] | None) -> tuple[SchedulerConfig, argparse.Namespace]:
    defaults = RuntimeConfig()
    parser = argparse.ArgumentParser(prog="folio run scheduler", description="the continuous-batching scheduler")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                        help="most requests running in one step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                        help="token budget of one step (prefill chunks and decodes together)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + completion (default: the model's context length)")
    add_scheduling_args(parser)
    add_common_args(parser)
    args = parser.parse_args(argv)
    config = SchedulerConfig(endpoints=Endpoints.from_env(), max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=args.max_model_len, enable_chunked_prefill=args.enable_chunked_prefill,
                             long_prefill_token_threshold=args.long_prefill_token_threshold,
                             preemption_mode=args.preemption_mode, scheduling_policy=args.scheduling_policy,
                             log_json=args.log_json or log_json_from_env())
    return config, args


def add_scheduling_args(parser: argparse.ArgumentParser, defaults_none: bool = False) -> None:
    """The scheduling flags, shared with ``folio serve`` (where they default to None: not passed on)."""
    d = SchedulerConfig(endpoints=None)

    def default(value):
        return None if defaults_none else value

    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=default(d.enable_chunked_prefill),
                        help="split long prompts across steps, mixed with decodes (default: on)")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=default(d.long_prefill_token_threshold),
                        help="most tokens one prefill takes per step (0: up to the token budget)")
    parser.add_argument("--preemption-mode", choices=["recompute", "swap"], default=default(d.preemption_mode),
                        help="when blocks run out: free and recompute later, or swap to the host tier")
    parser.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=default(d.scheduling_policy),
                        help="queue order: arrival, or the request's priority (lower first) then arrival")


async def serve(config: SchedulerConfig) -> None:
    from services.scheduler.service import SchedulerService

    ctx = zmq.asyncio.Context()
    try:
        await SchedulerService(config, ctx).run()
    finally:
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    config, args = parse_config(argv)
    log = setup_logging("scheduler", json=config.log_json, level=args.log_level)
    log.info("starting", max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
             enable_chunked_prefill=config.enable_chunked_prefill, preemption_mode=config.preemption_mode,
             scheduling_policy=config.scheduling_policy)
    return asyncio.run(run_until_signal(serve(config), log))


if __name__ == "__main__":
    sys.exit(main())
