"""``folio run kvmanager``: parse flags, run the kvmanager service until SIGTERM/SIGINT."""

from __future__ import annotations

import sys

from folio.shared.config import KVManagerConfig
from folio.services.shell import ServiceSpec


def open_service(config: KVManagerConfig, ctx, log):
    from folio.services.kvmanager.service import KVManagerService

    return KVManagerService(config, ctx)


SPEC = ServiceSpec("kvmanager", KVManagerConfig, "the KV block allocator service", open_service,
                   starting=lambda config: {"endpoint": config.endpoints.kvmanager})

parse_config, main = SPEC.config, SPEC.main

if __name__ == "__main__":
    sys.exit(main())
