"""Multi-LoRA throughput: SmolLM2 (the int4 default) with 32 concurrent streams, the base model

An entry point: the benchmark is ``folio.bench.lora`` (``folio bench lora``)."""

import sys

from folio.bench.lora import main

if __name__ == "__main__":
    sys.exit(main())
