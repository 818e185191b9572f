"""Quantized projections on a GPU against bf16 ``F.linear``, on the Llama-3.2-1B shape.

An entry point: the benchmark is ``folio.bench.quant_gpu`` (``folio bench quant_gpu``)."""

import sys

from folio.bench.quant_gpu import main

if __name__ == "__main__":
    sys.exit(main())
