"""Speculative decoding, measured in one run: decode tokens/s with and without speculation.

An entry point: the benchmark is ``folio.bench.spec_decode`` (``folio bench spec_decode``)."""

import sys

from folio.bench.spec_decode import main

if __name__ == "__main__":
    sys.exit(main())
