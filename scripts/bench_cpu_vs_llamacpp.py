"""folio against llama.cpp's own server on the CPU, on the same GGUF.

An entry point: the benchmark is ``folio.bench.cpu_vs_llamacpp`` (``folio bench cpu-vs-llamacpp``)."""

import sys

from folio.bench.cpu_vs_llamacpp import main

if __name__ == "__main__":
    sys.exit(main())
