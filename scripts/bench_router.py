"""The KV-cache-aware router against round-robin routing, measured in one run.

An entry point: the benchmark is ``folio.bench.router`` (``folio bench router``)."""

import sys

from folio.bench.router import main

if __name__ == "__main__":
    sys.exit(main())
