"""Benchmark: what the scheduler and the kvmanager cost per step, against an executor that answers at once.

An entry point: the benchmark is ``folio.bench.scheduler`` (``folio bench scheduler``)."""

import sys

from folio.bench.scheduler import main

if __name__ == "__main__":
    sys.exit(main())
