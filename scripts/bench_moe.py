"""A mixture-of-experts decode step against a dense one with the same active parameters, on the CPU.

An entry point: the benchmark is ``folio.bench.moe`` (``folio bench moe``)."""

import sys

from folio.bench.moe import main

if __name__ == "__main__":
    sys.exit(main())
