"""Prefix caching and forks, measured in one run.

An entry point: the benchmark is ``folio.bench.prefix_cache`` (``folio bench prefix_cache``)."""

import sys

from folio.bench.prefix_cache import main

if __name__ == "__main__":
    sys.exit(main())
