"""The cost of structured output per decode step: a batch whose every row follows a JSON schema

An entry point: the benchmark is ``folio.bench.structured`` (``folio bench structured``)."""

import sys

from folio.bench.structured import main

if __name__ == "__main__":
    sys.exit(main())
