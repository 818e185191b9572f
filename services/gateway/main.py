"""``folio run gateway``: parse flags into ``GatewayConfig`` and serve HTTP until SIGTERM/SIGINT.

Sockets come from the environment (``folio.shared.config.Endpoints.from_env``), as for every service.
"""

from __future__ import annotations

import sys

from folio.shared.config import GatewayConfig
from folio.services.shell import ServiceSpec


def open_service(config: GatewayConfig, ctx, log):
    from folio.services.gateway.app import serve

    return serve(config)


SPEC = ServiceSpec("gateway", GatewayConfig, __doc__.splitlines()[0], open_service)

parse_config, main = SPEC.config, SPEC.main

if __name__ == "__main__":
    sys.exit(main())
