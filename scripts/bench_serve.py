"""Any OpenAI-compatible endpoint under load, with vLLM's `bench serve` figures.

An entry point: the benchmark is ``folio.bench.serve`` (``folio bench serve``)."""

import sys

from folio.bench.serve import main

if __name__ == "__main__":
    sys.exit(main())
