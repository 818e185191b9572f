"""Speculative decoding, measured in one run: decode tokens/s with and without speculation.

An entry point: the benchmark is ``folio.bench.spec_decode`` (``folio bench spec_decode``)."""

import sys
from folio.cli.bench import spin_as_served

spin_as_served("spec_decode", sys.argv[1:])  # before torch loads, as the executor service sets it
from folio.bench.spec_decode import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
