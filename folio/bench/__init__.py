"""The benchmarks, one module each: ``folio bench NAME`` runs ``folio.bench.NAME``'s ``main(argv)``
(``folio bench list`` names them), as ``python -m folio.bench.NAME`` and the checkout's
``scripts/bench_NAME.py`` entry points do. A module with a ``main`` is a benchmark; the others
(``cpu_meter``) are what they share. They ship in the wheel, so an installed folio runs them."""
