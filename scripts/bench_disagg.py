"""Disaggregated serving's figures.

An entry point: the benchmark is ``folio.bench.disagg`` (``folio bench disagg``)."""

import sys

from folio.bench.disagg import main

if __name__ == "__main__":
    sys.exit(main())
