"""One decode step of a quantized model on the CPU, part by part.

An entry point: the benchmark is ``folio.bench.cpu_step`` (``folio bench cpu_step``)."""

import sys
from folio.cli.bench import spin_as_served

spin_as_served("cpu_step", sys.argv[1:])  # before torch loads, as the executor service sets it
from folio.bench.cpu_step import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
