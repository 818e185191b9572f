"""``folio bench``: the benchmarks, one command.

    folio bench serve [flags]                 # any OpenAI-compatible endpoint (folio.cli.bench_serve)
    folio bench list                          # the benchmarks and their first lines
    folio bench NAME [--save-result F.json] [flags of scripts/bench_NAME.py]

``NAME`` runs ``scripts/bench_NAME.py`` of the source checkout as that script runs by itself (its
``__main__``, with its own flags: ``folio bench step --steps 40`` is ``python scripts/bench_step.py
--steps 40``), then prints one summary block in the shared format (``folio.cli.bench_report``): the
figures the script printed as ``label: number [unit]`` lines, its wall time and exit status;
``--save-result`` writes the same as JSON with the script's whole output. The scripts that start
servers of their own and compare against baselines (serving, streams, router, soak, prefix_cache)
stay subcommands; their workloads, pointed at any endpoint, are ``folio bench serve --preset``
(mixed, streams, prefix, soak). The scripts live in the checkout, not in the wheel.
"""

from __future__ import annotations

import io
import runpy
import sys
import time
from pathlib import Path

from folio.cli.bench_report import figures_in, print_block, write_json

SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "scripts"
USAGE = "usage: folio bench serve [flags] | folio bench list | folio bench NAME [--save-result FILE.json] [flags]"


def scripts() -> dict[str, Path]:
    """``name`` -> ``scripts/bench_name.py`` (``-`` and ``_`` both accepted on the command line)."""
    if not SCRIPTS_DIR.is_dir():
        return {}
    return {p.stem[len("bench_"):]: p for p in sorted(SCRIPTS_DIR.glob("bench_*.py"))}


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


def run_script(name: str, path: Path, argv: list[str], save_result: str | None) -> int:
    """Run ``path`` as ``__main__`` with ``argv``; print the shared summary; its exit status."""
    root = str(path.parent.parent)
    old_argv, old_path, old_stdout = sys.argv, list(sys.path), sys.stdout
    sys.argv = [str(path), *argv]
    sys.path[:0] = [str(path.parent), root]  # as `python scripts/bench_x.py` from the checkout sees it
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    start = time.perf_counter()
    rc = 0
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    finally:
        sys.stdout, sys.argv, sys.path[:] = old_stdout, old_argv, old_path
    wall = time.perf_counter() - start
    output = tee.copy.getvalue()
    figures = figures_in(output)
    rows = [(f"{label}:", f"{value:.6g}") for label, value in figures.items()]  # as precise as printed
    rows += [("Wall time (s):", wall), ("Exit status:", rc)]
    print_block(f" folio bench {name} ", rows)
    if save_result:
        write_json(save_result, {"benchmark": name, "script": str(path), "argv": argv, "wall_s": wall,
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
        from folio.cli.bench_serve import main as serve_main

        return serve_main(rest)
    known = scripts()
    if name == "list":
        print("serve        any OpenAI-compatible endpoint: vLLM's bench serve figures (folio bench serve -h)")
        for key, path in known.items():
            print(f"{key:<12} {first_line(path)}")
        if not known:
            print(f"(no scripts/bench_*.py here: {SCRIPTS_DIR} is not a source checkout)")
        return 0
    key = name.replace("-", "_")
    if key not in known:
        where = f"one of: serve, list, {', '.join(known)}" if known else \
            f"serve or list ({SCRIPTS_DIR} is missing: the other benchmarks run from a source checkout)"
        print(f"folio bench: unknown benchmark '{name}'; {where}", file=sys.stderr)
        return 2
    save_result = None
    if "--save-result" in rest:
        i = rest.index("--save-result")
        if i + 1 >= len(rest):
            print("folio bench: --save-result needs a FILE", file=sys.stderr)
            return 2
        save_result = rest[i + 1]
        rest = rest[:i] + rest[i + 2:]
    return run_script(key, known[key], rest, save_result)
