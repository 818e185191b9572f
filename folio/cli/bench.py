"""``folio bench``: the benchmarks, one command.

    folio bench serve [flags]                 # any OpenAI-compatible endpoint (folio.bench.serve)
    folio bench list                          # the benchmarks and their first lines
    folio bench NAME [--save-result F.json] [flags of folio.bench.NAME]

``NAME`` runs the benchmark module ``folio.bench.NAME`` (its ``main``, with its own flags: ``folio
bench step --steps 40`` is ``python -m folio.bench.step --steps 40``, and ``python
scripts/bench_step.py --steps 40`` in a checkout), then prints one summary block in the shared
format (``folio.bench.report``): the figures it printed as ``label: number [unit]`` lines, its
wall time and exit status; ``--save-result`` writes the same as JSON with its whole output. The
benchmarks that start servers of their own and compare against baselines (serving, streams,
router, soak, prefix_cache) stay subcommands; their workloads, pointed at any endpoint, are
``folio bench serve --preset`` (mixed, streams, prefix, soak). The benchmarks ship in the wheel.
"""

from __future__ import annotations

import argparse

import importlib
import io
import sys
import time
from pathlib import Path

from folio.bench.report import figures_in, print_block, write_json

PACKAGE = "folio.bench"
USAGE = "usage: folio bench serve [flags] | folio bench list | folio bench NAME [--save-result FILE.json] [flags]"


def benchmarks() -> dict[str, Path]:
    """``name`` -> the source of ``folio.bench.name``: every module there with a ``main`` (``-`` and
    ``_`` both accepted on the command line). Read, not imported: listing them loads no torch."""
    folder = Path(importlib.import_module(PACKAGE).__path__[0])
    return {p.stem: p for p in sorted(folder.glob("*.py"))
            if not p.stem.startswith("_") and "\ndef main(" in p.read_text()}


def first_line(path: Path) -> str:
    for line in path.read_text().splitlines():
        text = line.strip().strip('"').strip()
        if text:
            return text
    return ""


class _Tee(io.TextIOBase):
    """Writes through to the terminal and keeps a copy for the summary."""

    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()


# benchmarks that step a model in this process on the CPU, as the executor service does: torch's
# OpenMP spin is chosen for their model as the service chooses it (folio.core.executor.threads)
IN_PROCESS_CPU = ("cpu_step", "spec_decode")


def spin_as_served(name: str, argv: list[str]) -> str | None:
    """``GOMP_SPINCOUNT`` for an in-process CPU benchmark's ``--model`` and ``--quantization``, set
    before torch loads, as ``folio run executor`` sets it; the value set, or None."""
    if name not in IN_PROCESS_CPU:
        return None
    from folio.core.executor.threads import choose_spin_count
    from folio.core.model_files import resolve_model
    from folio.shared.config import DEFAULT_MODEL_NAME

    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--model", default=DEFAULT_MODEL_NAME)
    flags.add_argument("--quantization", default="auto")
    known, _ = flags.parse_known_args(argv)
    try:
        path = str(resolve_model(known.model))
    except (OSError, ValueError):
        return None  # the benchmark says what is wrong with the model
    return choose_spin_count(path, known.quantization, "cpu")


def run_benchmark(name: str, argv: list[str], save_result: str | None) -> int:
    """Run ``folio.bench.name``'s ``main(argv)``; print the shared summary; its exit status."""
    spin_as_served(name, argv)
    old_argv, old_stdout = sys.argv, sys.stdout
    sys.argv = [f"folio bench {name}", *argv]  # argparse's usage line names the command
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    start = time.perf_counter()
    rc = 0
    try:
        result = importlib.import_module(f"{PACKAGE}.{name}").main(argv)
        rc = result if isinstance(result, int) else 0
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    finally:
        sys.stdout, sys.argv = old_stdout, old_argv
    wall = time.perf_counter() - start
    output = tee.copy.getvalue()
    figures = figures_in(output)
    rows = [(f"{label}:", f"{value:.6g}") for label, value in figures.items()]  # as precise as printed
    rows += [("Wall time (s):", wall), ("Exit status:", rc)]
    print_block(f" folio bench {name} ", rows)
    if save_result:
        write_json(save_result, {"benchmark": name, "module": f"{PACKAGE}.{name}", "argv": argv, "wall_s": wall,
                                 "exit_status": rc, "figures": figures, "output": output})
        print(f"Saved the result to {save_result}")
    return rc


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        print(__doc__.split("\n\n", 2)[2].strip())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "serve":
        from folio.bench.serve import main as serve_main

        return serve_main(rest)
    known = benchmarks()
    if name == "list":
        for key, path in known.items():
            print(f"{key:<12} {first_line(path)}")
        return 0
    key = name.replace("-", "_")
    if key not in known:
        print(f"folio bench: unknown benchmark '{name}'; one of: serve, list, {', '.join(known)}", file=sys.stderr)
        return 2
    save_result = None
    if "--save-result" in rest:
        i = rest.index("--save-result")
        if i + 1 >= len(rest):
            print("folio bench: --save-result needs a FILE", file=sys.stderr)
            return 2
        save_result = rest[i + 1]
        rest = rest[:i] + rest[i + 2:]
    return run_benchmark(key, rest, save_result)
