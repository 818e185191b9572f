"""Decode throughput of folio's runtime, fp32 and quantized, against transformers ``generate``

An entry point: the benchmark is ``folio.bench.runtime`` (``folio bench runtime``)."""

import sys

from folio.bench.runtime import main

if __name__ == "__main__":
    sys.exit(main())
