"""``folio run router``: parse flags into ``RouterConfig`` and route HTTP until SIGTERM/SIGINT.

Its admin socket comes from the environment (``folio.shared.config.Endpoints.from_env``), as for every
service; the replicas come from ``--replica`` (repeatable) and ``--replica-dns``, or, disaggregated,
from ``--prefill`` and ``--decode`` (``disagg.py``).
"""

from __future__ import annotations

import asyncio
import sys

from folio.shared.config import Endpoints, RouterConfig
from folio.shared.flags import config_values, service_parser
from folio.shared.logs import setup_logging


def parse_config(argv: list[str] | None = None) -> RouterConfig:
    from folio.services.router.replicas import parse_replica

    parser = service_parser("router", __doc__.splitlines()[0])
    args = parser.parse_args(argv)
    if bool(args.prefill) != bool(args.decode):
        parser.error("disaggregated serving needs both --prefill and --decode instances")
    if not args.replica and not args.replica_dns and not args.prefill:
        parser.error("give at least one --replica URL or --replica-dns NAME:PORT (or --prefill and --decode URLs)")
    if args.replica_dns and not args.replica_dns.rpartition(":")[2].isdigit():
        parser.error(f"--replica-dns wants NAME:PORT, got {args.replica_dns!r}")
    if args.max_attempts < 1:
        parser.error("--max-attempts must be at least 1")
    for spec in [*args.replica, *args.prefill, *args.decode]:
        try:
            parse_replica(spec, args.kv_events_port, args.kv_snapshot_port)
        except ValueError as exc:
            parser.error(str(exc))
    return RouterConfig(endpoints=Endpoints.from_env(), **config_values(RouterConfig, args, "router"))


def main(argv: list[str] | None = None) -> int:
    import zmq.asyncio

    from folio.shared.loops import run_until_signal
    from folio.services.router.prompt import PromptEncoder
    from folio.services.router.service import RouterService

    config = parse_config(argv)
    log = setup_logging("router", config.log_json, config.log_level)
    encoder = None
    if config.policy == "cache_aware":
        from folio.core.models import resolve_model
        from folio.core.tokenizer.text import TextTokenizer

        try:
            encoder = PromptEncoder(TextTokenizer(resolve_model(config.model)))
        except (FileNotFoundError, OSError, ValueError) as exc:
            log.error("cannot load the replicas' tokenizer; give --model", model=config.model, error=str(exc))
            return 1

    async def serve() -> None:
        ctx = zmq.asyncio.Context()
        try:
            await RouterService(config, encoder, ctx).run()
        finally:
            ctx.destroy(linger=0)

    return asyncio.run(run_until_signal(serve(), log))


if __name__ == "__main__":
    sys.exit(main())
