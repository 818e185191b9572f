"""No function in the shipped package (``folio/``, ``services/``, ``shared/``) is over 80 lines.

A function's length is ``end_lineno - lineno + 1`` of its ``def`` (decorators not counted, its
docstring and any function nested in it counted); methods and nested functions are checked too,
by their qualified name. ``OVER_80_TODAY`` lists the functions that were longer when the rule came
in: each is to be split into named steps, then struck off. An entry that is no longer over 80
lines (split, renamed, moved) fails too, so that the list only ever shrinks.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("folio", "services", "shared")
MAX_LINES = 80

# (file under the root, qualified name): what each is, and why it was left for later
OVER_80_TODAY: set[tuple[str, str]] = set()


def long_functions(source: str, max_lines: int = MAX_LINES) -> dict[str, int]:
    """Every function of ``source`` longer than ``max_lines``: its qualified name -> its lines."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                num_lines = child.end_lineno - child.lineno + 1
                if num_lines > max_lines:
                    found[name] = num_lines
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


@cache
def shipped_long_functions() -> dict[tuple[str, str], int]:
    found = {}
    for folder in SHIPPED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for name, num_lines in long_functions(path.read_text()).items():
                found[(rel, name)] = num_lines
    return found


def function(header: str, num_lines: int, indent: str = "") -> str:
    """A function ``num_lines`` long, its ``def`` line included."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(num_lines - 1))
    return f"{indent}{header}:\n{body}"


def test_the_measure_finds_a_long_function_method_and_nested_function():
    source = ("@decorator\n" + function("def fits()", 80)  # decorators do not count
              + function("def too_long()", 81)
              + "class C:\n" + function("async def method(self)", 81, "    ")
              + function("def outer()", 2) + function("def inner()", 81, "    "))
    assert long_functions(source) == {"too_long": 81, "C.method": 81, "outer": 83, "outer.inner": 81}


def test_no_function_in_the_package_is_over_80_lines():
    found = shipped_long_functions()
    new = {f"{path}:{name} ({n} lines)" for (path, name), n in found.items() if (path, name) not in OVER_80_TODAY}
    assert not new, f"split these into named steps (at most {MAX_LINES} lines each): {sorted(new)}"


def test_the_list_of_long_functions_holds_only_long_functions():
    found = shipped_long_functions()
    stale = sorted(f"{path}:{name}" for path, name in OVER_80_TODAY if (path, name) not in found)
    assert not stale, f"no longer over {MAX_LINES} lines (or gone): strike them off OVER_80_TODAY: {stale}"
