"""The prefix cache with images: cold and warm time to first token on a 1B-shape LLaVA

An entry point: the benchmark is ``folio.bench.vision`` (``folio bench vision``)."""

import sys

from folio.bench.vision import main

if __name__ == "__main__":
    sys.exit(main())
