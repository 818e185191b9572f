"""Benchmark: how many tokens per second the gateway and the tokenizer stream to many SSE clients.

An entry point: the benchmark is ``folio.bench.streams`` (``folio bench streams``)."""

import sys

from folio.bench.streams import main

if __name__ == "__main__":
    sys.exit(main())
