"""Kernel figures of the cuda backend on a GPU (run by scripts/gpu_check.sh).

An entry point: the benchmark is ``folio.bench.kernels`` (``folio bench kernels``)."""

import sys

from folio.bench.kernels import main

if __name__ == "__main__":
    sys.exit(main())
