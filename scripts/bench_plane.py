"""What CURVE costs: served tok/s on tcp endpoints with CURVE against the same stack in the clear.

An entry point: the benchmark is ``folio.bench.plane`` (``folio bench plane``)."""

import sys

from folio.bench.plane import main

if __name__ == "__main__":
    sys.exit(main())
