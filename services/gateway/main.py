"""``folio run gateway``: parse flags into ``GatewayConfig`` and serve HTTP until SIGTERM/SIGINT.

Sockets come from the environment (``folio.shared.config.Endpoints.from_env``), as for every service.
"""

from __future__ import annotations

import asyncio
import sys

from folio.shared.config import Endpoints, GatewayConfig
from folio.shared.flags import config_values, service_parser
from folio.shared.logs import setup_logging


def parse_config(argv: list[str] | None = None) -> GatewayConfig:
    args = service_parser("gateway", __doc__.splitlines()[0]).parse_args(argv)
    return GatewayConfig(endpoints=Endpoints.from_env(), **config_values(GatewayConfig, args, "gateway"))


def main(argv: list[str] | None = None) -> int:
    from folio.shared.loops import freeze_heap, run_until_signal
    from folio.services.gateway.app import serve

    config = parse_config(argv)
    log = setup_logging("gateway", config.log_json, config.log_level)
    freeze_heap()  # what the imports left: out of the cyclic collector's way
    return asyncio.run(run_until_signal(serve(config), log))


if __name__ == "__main__":
    sys.exit(main())
