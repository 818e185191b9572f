"""Serving benchmark: folio served over HTTP against baselines measured in the same run.

An entry point: the benchmark is ``folio.bench.serving`` (``folio bench serving``)."""

import sys

from folio.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
