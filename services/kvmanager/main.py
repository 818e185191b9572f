"""``folio run kvmanager``: parse flags, run the kvmanager service until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import sys

import zmq.asyncio

from folio.shared.config import Endpoints, KVManagerConfig
from folio.shared.flags import config_values, service_parser
from folio.shared.logs import setup_logging
from folio.shared.loops import freeze_heap, run_until_signal


def parse_config(argv: list[str] | None) -> tuple[KVManagerConfig, argparse.Namespace]:
    args = service_parser("kvmanager", "the KV block allocator service").parse_args(argv)
    return KVManagerConfig(endpoints=Endpoints.from_env(), **config_values(KVManagerConfig, args, "kvmanager")), args


async def serve(config: KVManagerConfig) -> None:
    from folio.services.kvmanager.service import KVManagerService

    ctx = zmq.asyncio.Context()
    try:
        service = KVManagerService(config, ctx)
        freeze_heap()  # what the imports left (as in the scheduler): out of the cyclic collector's way
        await service.run()
    finally:
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    config, args = parse_config(argv)
    log = setup_logging("kvmanager", json=config.log_json, level=args.log_level)
    log.info("starting", endpoint=config.endpoints.kvmanager)
    return asyncio.run(run_until_signal(serve(config), log))


if __name__ == "__main__":
    sys.exit(main())
