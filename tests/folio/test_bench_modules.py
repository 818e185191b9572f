"""Every benchmark module (``folio.bench.NAME``, which ``folio bench NAME`` runs) imports and parses its
flags: ``--help`` prints its usage and exits 0, without running anything. The benchmarks themselves
run in ``scripts/`` and CI's benchmark jobs, not here; this keeps each module under the fast tier."""

from __future__ import annotations

import importlib

import pytest

from folio.cli.bench import benchmarks

NAMES = sorted(benchmarks())


def test_the_benchmarks_are_found():
    assert {"serving", "soak", "step", "streams"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_a_benchmark_parses_its_flags(name, capsys):
    module = importlib.import_module(f"folio.bench.{name}")
    with pytest.raises(SystemExit) as stop:
        module.main(["--help"])
    assert stop.value.code in (0, None)
    assert capsys.readouterr().out.startswith("usage:")
