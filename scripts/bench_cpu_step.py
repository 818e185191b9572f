"""One decode step of a quantized model on the CPU, part by part.

An entry point: the benchmark is ``folio.bench.cpu_step`` (``folio bench cpu_step``)."""

import sys

from folio.bench.cpu_step import main

if __name__ == "__main__":
    sys.exit(main())
