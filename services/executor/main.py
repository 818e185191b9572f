"""``folio run executor``: parse flags (vLLM's names), load the model, serve steps until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import sys

import zmq.asyncio

from folio.shared.config import Endpoints, ExecutorServiceConfig, RuntimeConfig
from folio.shared.flags import config_values, service_parser
from folio.shared.logs import setup_logging
from folio.shared.loops import freeze_heap, run_until_signal


def parse_config(argv: list[str] | None) -> tuple[ExecutorServiceConfig, argparse.Namespace]:
    from folio.core.models import resolve_model

    parser = service_parser("executor", "the model runtime service")
    args = parser.parse_args(argv)
    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    runtime = RuntimeConfig(**config_values(RuntimeConfig, args, "executor"))
    config = ExecutorServiceConfig(endpoints=Endpoints.from_env(), runtime=runtime,
                                   model_path=str(resolve_model(args.model)),
                                   **config_values(ExecutorServiceConfig, args, "executor"))
    return config, args


async def serve(config: ExecutorServiceConfig, log) -> None:
    from folio.services.executor.service import ExecutorService

    ctx = zmq.asyncio.Context()
    try:
        service = ExecutorService(config, ctx)
        log.info("model loaded", **service.runner.stats())
        # torch, the model and what loading it left: ~180,000 objects, a 100 ms walk for every full
        # collection (measured: 10 in a bench_serving run, 1.3 s in all, one of 210 ms, each a
        # stalled step), now out of the cyclic collector's way
        freeze_heap()
        await service.run()
    finally:
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    config, args = parse_config(argv)
    log = setup_logging("executor", json=config.log_json, level=args.log_level)
    log.info("starting", model=config.model_path)
    return asyncio.run(run_until_signal(serve(config, log), log))


if __name__ == "__main__":
    sys.exit(main())
