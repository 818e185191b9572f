"""The executor's own cost per step: the real runner with a null model.

An entry point: the benchmark is ``folio.bench.step`` (``folio bench step``)."""

import sys

from folio.bench.step import main

if __name__ == "__main__":
    sys.exit(main())
