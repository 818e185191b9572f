"""The house's layout rules, read from the sources' imports (every import, those inside functions
too: a lazy import hides a cycle from the interpreter, not from this test).

- No import cycle between folio's modules.
- The core (``folio/core``) never imports a service; each service shell imports the core, the
  shared library and its own package, never another service.
- ``folio.shared`` imports neither torch nor any service nor the core; the scheduler's policy, the
  output processing and the front door never import torch (directly or through what they import).
- Nothing outside ``tests/`` imports ``tests``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"folio": ROOT / "folio", "folio.services": ROOT / "services", "folio.shared": ROOT / "shared",
                "folio.cuda": ROOT / "cuda"}


def module_files() -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGE_DIRS.items():
        for f in folder.rglob("*.py"):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([pkg, *parts])] = f
    return mods


MODULES = module_files()


def imports_of(path: Path, name: str) -> set[str]:
    """Every absolute module name ``path`` imports (a ``from pkg import mod`` names pkg.mod)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)
    return found


GRAPH = {name: {d for d in imports_of(path, name) if d in MODULES and d != name} for name, path in MODULES.items()}
EXTERNAL = {name: {d.split(".")[0] for d in imports_of(path, name) if not d.startswith("folio")}
            for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def closure(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(GRAPH[v])
    return seen


def service_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if parts[:2] == ["folio", "services"] and len(parts) > 3 else None


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(GRAPH) == []


def test_the_core_imports_no_service():
    bad = {m: sorted(d for d in deps if d.startswith("folio.services"))
           for m, deps in GRAPH.items() if m.startswith("folio.core")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_a_service_shell_imports_no_other_service():
    bad = {}
    for m, deps in GRAPH.items():
        own = service_of(m)
        if own is None:
            continue
        others = sorted(d for d in deps if service_of(d) not in (None, own))
        if others:
            bad[m] = others
    assert bad == {}


def test_shared_imports_no_torch_no_service_no_core():
    bad = {}
    for m in MODULES:
        if not m.startswith("folio.shared"):
            continue
        reach = closure(m)
        wrong = sorted(d for d in reach if d.startswith(("folio.services", "folio.core")))
        wrong += sorted(x for d in reach for x in EXTERNAL[d] if x == "torch")
        if wrong:
            bad[m] = wrong
    assert bad == {}


def test_scheduler_policy_output_processing_and_front_door_never_import_torch():
    torchless = [m for m in MODULES if m.startswith(("folio.core.scheduler", "folio.core.tokenizer",
                                                      "folio.core.frontdoor"))]
    assert torchless
    bad = {m: sorted(d for d in closure(m) if "torch" in EXTERNAL[d]) for m in torchless}
    assert {m: d for m, d in bad.items() if d} == {}


def test_nothing_outside_tests_imports_tests():
    offenders = []
    for f in [*MODULES.values(), *(ROOT / "scripts").rglob("*.py")]:
        name = next((m for m, p in MODULES.items() if p == f), f.stem)
        if any(d == "tests" or d.startswith("tests.") for d in imports_of(f, name)):
            offenders.append(str(f.relative_to(ROOT)))
    assert offenders == []
