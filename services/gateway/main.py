"""``folio run gateway``: parse flags into ``GatewayConfig`` and serve HTTP until SIGTERM/SIGINT.

Sockets come from the environment (``shared.config.Endpoints.from_env``), as for every service.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from shared.config import (
    DEFAULT_MODEL_NAME,
    Endpoints,
    GatewayConfig,
    api_key_from_env,
    log_json_from_env,
)
from shared.flags import add_common_args
from shared.logs import setup_logging


def add_limit_args(parser: argparse.ArgumentParser, defaults_none: bool = False) -> None:
    """The gateway's deadlines and limits; ``folio serve`` takes them too (None: the default)."""
    d = GatewayConfig.__dataclass_fields__

    def default(name):
        return None if defaults_none else d[name].default

    parser.add_argument("--request-timeout", dest="request_timeout", type=float, default=default("request_timeout_s"),
                        help=f"seconds a request may take in all, queue included; 0: no limit "
                             f"(default {d['request_timeout_s'].default:g})")
    parser.add_argument("--max-queue-len", type=int, default=default("max_queue_len"),
                        help=f"requests accepted but without output yet; more get 429 "
                             f"(default {d['max_queue_len'].default})")
    parser.add_argument("--max-concurrent-requests", type=int, default=default("max_concurrent_requests"),
                        help=f"open generation requests, streams included; more get 429 "
                             f"(default {d['max_concurrent_requests'].default})")
    parser.add_argument("--max-body-bytes", type=int, default=default("max_body_bytes"),
                        help=f"larger request bodies get 413 (default {d['max_body_bytes'].default})")


def parse_config(argv: list[str] | None = None) -> GatewayConfig:
    parser = argparse.ArgumentParser(prog="folio run gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="the default model's name or a model folder")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients use (default: the model's name or folder name)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or $FOLIO_API_KEY)")
    add_limit_args(parser)
    add_common_args(parser)  # --log-json, --log-level
    args = parser.parse_args(argv)
    return GatewayConfig(
        endpoints=Endpoints.from_env(),
        model=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        api_key=args.api_key or api_key_from_env(),
        log_json=args.log_json or log_json_from_env(),
        log_level=args.log_level,
        request_timeout_s=args.request_timeout,
        max_queue_len=args.max_queue_len,
        max_concurrent_requests=args.max_concurrent_requests,
        max_body_bytes=args.max_body_bytes,
    )


def main(argv: list[str] | None = None) -> int:
    from shared.loops import run_until_signal
    from services.gateway.app import serve

    config = parse_config(argv)
    log = setup_logging("gateway", config.log_json, config.log_level)
    return asyncio.run(run_until_signal(serve(config), log))


if __name__ == "__main__":
    sys.exit(main())
