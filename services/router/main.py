"""``folio run router``: parse flags into ``RouterConfig`` and route HTTP until SIGTERM/SIGINT.

Its admin socket comes from the environment (``shared.config.Endpoints.from_env``), as for every
service; the replicas come from ``--replica`` (repeatable) and ``--replica-dns``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from shared.config import DEFAULT_MODEL_NAME, Endpoints, RouterConfig, log_json_from_env
from shared.flags import add_common_args
from shared.logs import setup_logging


def parse_config(argv: list[str] | None = None) -> RouterConfig:
    from services.router.replicas import parse_replica
    from services.router.routing import POLICIES

    parser = argparse.ArgumentParser(prog="folio run router", description=__doc__.splitlines()[0])
    defaults = RouterConfig(endpoints=None)
    parser.add_argument("--replica", action="append", default=[], metavar="URL[,kv_events_port=P][,kv_snapshot_port=Q]",
                        help="a replica's HTTP base URL (repeat for more); its kvmanager's ports default to "
                             "--kv-events-port and --kv-snapshot-port on the same host")
    parser.add_argument("--replica-dns", default=None, metavar="NAME:PORT",
                        help="every address NAME resolves to is a replica on PORT (a Kubernetes headless Service)")
    parser.add_argument("--kv-events-port", type=int, default=defaults.kv_events_port,
                        help="where replicas publish KV events (default: the tcp layout's, 5555)")
    parser.add_argument("--kv-snapshot-port", type=int, default=defaults.kv_snapshot_port,
                        help="where replicas answer KV snapshots (default: the tcp layout's, 5561)")
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME,
                        help="the replicas' model (name or folder): prompts are tokenized as they do")
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument("--policy", choices=POLICIES, default=defaults.policy,
                        help="cache_aware (default), or the baselines least_loaded and round_robin")
    parser.add_argument("--load-cost-tokens", type=int, default=defaults.load_cost_tokens,
                        help="what one running or waiting request on a replica weighs, in prompt tokens to compute")
    parser.add_argument("--poll-interval", type=float, default=defaults.poll_interval_s,
                        help="seconds between reads of each replica's /metrics (load and liveness)")
    parser.add_argument("--poll-timeout", type=float, default=defaults.poll_timeout_s,
                        help="a poll slower than this is slow; 3 slow polls in a row mark the replica down")
    parser.add_argument("--dns-interval", type=float, default=defaults.dns_interval_s)
    parser.add_argument("--max-attempts", type=int, default=defaults.max_attempts,
                        help="replicas a request is tried on before the client gets a 503")
    parser.add_argument("--block-size", type=int, default=defaults.block_size,
                        help="the replicas' KV block size until their snapshots say it")
    add_common_args(parser)  # --log-json, --log-level
    args = parser.parse_args(argv)
    if not args.replica and not args.replica_dns:
        parser.error("give at least one --replica URL or --replica-dns NAME:PORT")
    if args.replica_dns and not args.replica_dns.rpartition(":")[2].isdigit():
        parser.error(f"--replica-dns wants NAME:PORT, got {args.replica_dns!r}")
    if args.max_attempts < 1:
        parser.error("--max-attempts must be at least 1")
    for spec in args.replica:
        try:
            parse_replica(spec, args.kv_events_port, args.kv_snapshot_port)
        except ValueError as exc:
            parser.error(str(exc))
    return RouterConfig(
        endpoints=Endpoints.from_env(), model=args.model, replicas=tuple(args.replica), replica_dns=args.replica_dns,
        kv_events_port=args.kv_events_port, kv_snapshot_port=args.kv_snapshot_port, host=args.host, port=args.port,
        policy=args.policy, block_size=args.block_size, load_cost_tokens=args.load_cost_tokens,
        poll_interval_s=args.poll_interval, poll_timeout_s=args.poll_timeout, dns_interval_s=args.dns_interval, max_attempts=args.max_attempts,
        log_json=args.log_json or log_json_from_env(), log_level=args.log_level)


def main(argv: list[str] | None = None) -> int:
    import zmq.asyncio

    from shared.loops import run_until_signal
    from services.router.prompt import PromptEncoder
    from services.router.service import RouterService

    config = parse_config(argv)
    log = setup_logging("router", config.log_json, config.log_level)
    encoder = None
    if config.policy == "cache_aware":
        from shared.models import resolve_model
        from shared.text import TextTokenizer

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
