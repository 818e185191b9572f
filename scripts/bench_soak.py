"""Soak: sustained load on a real ``folio serve`` while a service is killed every N seconds.

An entry point: the benchmark is ``folio.bench.soak`` (``folio bench soak``)."""

import sys

from folio.bench.soak import main

if __name__ == "__main__":
    sys.exit(main())
