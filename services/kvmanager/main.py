"""``folio run kvmanager``: parse flags, run the kvmanager service until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import sys

import zmq.asyncio

from shared.config import Endpoints, KVManagerConfig, log_json_from_env
from shared.flags import add_common_args
from shared.logs import setup_logging
from shared.loops import run_until_signal


def parse_config(argv: list[str] | None) -> tuple[KVManagerConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="folio run kvmanager", description="the KV block allocator service")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV of cached full blocks across requests (default: on)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    return KVManagerConfig(endpoints=Endpoints.from_env(), log_json=args.log_json or log_json_from_env(),
                           enable_prefix_caching=args.enable_prefix_caching), args


async def serve(config: KVManagerConfig) -> None:
    from services.kvmanager.service import KVManagerService

    ctx = zmq.asyncio.Context()
    try:
        await KVManagerService(config, ctx).run()
    finally:
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    config, args = parse_config(argv)
    log = setup_logging("kvmanager", json=config.log_json, level=args.log_level)
    log.info("starting", endpoint=config.endpoints.kvmanager)
    return asyncio.run(run_until_signal(serve(config), log))


if __name__ == "__main__":
    sys.exit(main())
