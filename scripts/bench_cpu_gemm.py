"""The CPU's quantized GEMM per GGUF type, against the read bandwidth.

An entry point: the benchmark is ``folio.bench.cpu_gemm`` (``folio bench cpu_gemm``)."""

import sys

from folio.bench.cpu_gemm import main

if __name__ == "__main__":
    sys.exit(main())
