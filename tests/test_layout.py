"""The house's layout rules, read from the sources' imports (every import, those inside functions
too: a lazy import hides a cycle from the interpreter, not from this test).

- No import cycle between folio's modules.
- The core (``folio/core``) never imports a service; each service shell imports the core, the
  shared library and its own package, never another service.
- ``folio.shared`` imports neither torch nor any service nor the core; the scheduler's policy, the
  output processing and the front door never import torch (directly or through what they import).
- ``shared/`` holds only what crosses a socket or configures a service (``SHARED_MODULES``).
- The core's folders depend on each other one way, in the order ``CORE_LAYERS`` declares.
- ``pyproject.toml`` lists every package folder, so the wheel holds what the checkout does.
- Nothing outside ``tests/`` imports ``tests``.
"""

from __future__ import annotations

import ast
import re
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


# what shared/ may hold: the wire contract, transport and socket loops, config and flags (with the
# --speculative-config parser), logs, tracing and start-up timing; engine logic belongs in the core
SHARED_MODULES = {"folio.shared", "folio.shared.messages", "folio.shared.transport", "folio.shared.loops",
                  "folio.shared.config", "folio.shared.flags", "folio.shared.logs", "folio.shared.tracing",
                  "folio.core.executor.startup", "folio.core.executor.runtime.spec_config",
                  "folio.shared.keys", "folio.shared.curve"}  # keys, plane: the transport's CURVE

# The core's folders (and top-level modules), lowest first. A unit imports only units of lower
# layers, never one of its own layer or above; a new folder must be placed here.
CORE_LAYERS = [
    ["kv", "structured", "tokenizer", "frontdoor", "models"],  # over folio.shared only
    ["executor.parallel", "executor.kernels"],  # process groups; kernels and the layouts they share
    ["executor.quant", "executor.sampling", "executor.lora"],  # each over the kernels
    ["executor.model"],  # model families and loading
    ["executor.runtime", "scheduler"],  # the model runner and its workers; the scheduler's policy
    ["engine"],  # both in one process
]
CORE_PACKAGES = {"folio.core", "folio.core.executor"}  # their __init__ only, importing no unit


def core_unit(name: str) -> str | None:
    """The core unit a module belongs to: ``executor.<folder>`` or ``<folder or module>``."""
    parts = name.split(".")
    if parts[:2] != ["folio", "core"] or name in CORE_PACKAGES:
        return None
    if parts[2] == "executor":
        return ".".join(parts[2:4])
    return parts[2]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a core unit from a unit not below it (or of a unit not in ``CORE_LAYERS``)."""
    layer = {unit: i for i, units in enumerate(CORE_LAYERS) for unit in units}
    bad = []
    for m, deps in sorted(graph.items()):
        here = core_unit(m)
        if m in CORE_PACKAGES and any(core_unit(d) for d in deps):
            bad.append(f"{m} (a package's __init__) imports {sorted(d for d in deps if core_unit(d))}")
        if here is None:
            continue
        if here not in layer:
            bad.append(f"{m}: its unit {here} is not in CORE_LAYERS")
            continue
        for d in sorted(deps):
            there = core_unit(d)
            if there is not None and there != here and layer.get(there, len(CORE_LAYERS)) >= layer[here]:
                bad.append(f"{m} ({here}) imports {d} ({there}), not below it")
    return bad


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


def test_shared_holds_only_the_wire_config_transport_logs_and_tracing():
    assert sorted(m for m in MODULES if m.startswith("folio.shared")) == sorted(SHARED_MODULES)


def test_the_layer_check_finds_a_back_edge():
    ok = {"folio.core.executor.quant.gpu": {"folio.core.executor.kernels.cuda_kernels", "folio.shared.messages"}}
    assert layer_violations(ok) == []
    back = {"folio.core.executor.kernels.attention": {"folio.core.executor.quant.formats"}}
    same_layer = {"folio.core.executor.sampling.sampler": {"folio.core.executor.lora.punica"}}
    unplaced = {"folio.core.newfolder.x": set()}
    for graph in (back, same_layer, unplaced):
        assert len(layer_violations(graph)) == 1


def test_core_folders_depend_on_each_other_one_way():
    placed = {unit for units in CORE_LAYERS for unit in units}
    assert {core_unit(m) for m in MODULES if core_unit(m)} == placed  # no layer names a unit that is gone
    assert layer_violations(GRAPH) == []


def test_scheduler_policy_output_processing_and_front_door_never_import_torch():
    torchless = [m for m in MODULES if m.startswith(("folio.core.scheduler", "folio.core.tokenizer",
                                                      "folio.core.frontdoor"))]
    assert torchless
    bad = {m: sorted(d for d in closure(m) if "torch" in EXTERNAL[d]) for m in torchless}
    assert {m: d for m, d in bad.items() if d} == {}


def test_pyproject_lists_every_package():
    """The wheel takes the packages ``pyproject.toml`` names: a folder added or moved is listed there."""
    block = (ROOT / "pyproject.toml").read_text().split("\npackages = [", 1)[1].split("]", 1)[0]
    listed = set(re.findall(r'"([\w.]+)"', block))
    assert listed == {m for m, p in MODULES.items() if p.name == "__init__.py"}


def test_nothing_outside_tests_imports_tests():
    offenders = []
    for f in [*MODULES.values(), *(ROOT / "scripts").rglob("*.py")]:
        name = next((m for m, p in MODULES.items() if p == f), f.stem)
        if any(d == "tests" or d.startswith("tests.") for d in imports_of(f, name)):
            offenders.append(str(f.relative_to(ROOT)))
    assert offenders == []
