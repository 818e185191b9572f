"""The one output format of ``folio bench``: a titled block of ``name: value`` rows, printed in
vLLM's layout (a 50-column ``=`` title, the name padded to 40 columns, ``-`` section rules), and
the same figures written as JSON.

``folio bench serve`` prints its result block with it; every ``folio bench NAME`` subcommand that
runs a benchmark module (``folio.bench.NAME``) prints its summary with it (the figures it printed as
``label: number`` lines, the wall time and the exit status) and writes it with ``--save-result``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Iterable

WIDTH = 50

Row = tuple  # (name, value) or (None, section title)


def rule(title: str = "", char: str = "=") -> str:
    """``title`` centred in a 50-column rule (vLLM's block title is passed with its spaces)."""
    return f"{title:{char}^{WIDTH}}"


def format_value(value) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:<10}"
    if isinstance(value, float):
        return f"{value:<10.2f}" if math.isfinite(value) else f"{value!s:<10}"
    return f"{value!s:<10}"


def format_block(title: str, rows: Iterable[Row]) -> str:
    """``rows``: ``(name, value)`` pairs; ``(None, "Section")`` starts a ``-`` section rule."""
    lines = [rule(title)]
    for name, value in rows:
        if name is None:
            lines.append(rule(value, "-"))
        else:
            lines.append(f"{name:<40} {format_value(value)}".rstrip())
    lines.append(rule())
    return "\n".join(lines)


def print_block(title: str, rows: Iterable[Row]) -> None:
    print(format_block(title, rows), flush=True)


def write_json(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


# "label: 12.5", "label: 12.5 tok/s", "label = 0.81x": what the scripts print
_NUMBER = r"(-?\d+(?:\.\d+)?(?:e[-+]?\d+)?)\s*([A-Za-z%][A-Za-z%/]*)?\s*$"
_FIGURE = re.compile(r"^\s*([A-Za-z(][^:]{0,78}?)\s*:\s*" + _NUMBER)
_FIGURE_EQ = re.compile(r"^\s*([A-Za-z(][^:=]{0,78}?)\s*=\s*" + _NUMBER)


def figures_in(text: str) -> dict[str, float]:
    """The ``label: number [unit]`` lines of a benchmark's output, in order (a later line with the
    same label wins); the unit joins the label in parentheses."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _FIGURE.match(line) or _FIGURE_EQ.match(line)
        if m:
            label = m.group(1).strip() + (f" ({m.group(3)})" if m.group(3) else "")
            out[label] = float(m.group(2))
    return out
