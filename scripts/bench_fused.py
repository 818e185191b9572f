"""The fused layer kernels (cuda/fused_ops.cu) against the torch ops they replace, on a GPU.

An entry point: the benchmark is ``folio.bench.fused`` (``folio bench fused``)."""

import sys

from folio.bench.fused import main

if __name__ == "__main__":
    sys.exit(main())
