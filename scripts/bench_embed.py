"""Embeddings throughput on the CPU: folio.LLM's embed against sentence-transformers' encode

An entry point: the benchmark is ``folio.bench.embed`` (``folio bench embed``)."""

import sys

from folio.bench.embed import main

if __name__ == "__main__":
    sys.exit(main())
