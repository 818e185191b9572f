"""Quality of quantized weights against the fp32 reference, on text the model itself writes.

An entry point: the benchmark is ``folio.bench.eval_quant`` (``folio bench eval_quant``)."""

import sys

from folio.bench.eval_quant import main

if __name__ == "__main__":
    sys.exit(main())
