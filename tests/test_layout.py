"""The house's layout rules, read from the sources' imports (every import, those inside functions
too: a lazy import hides a cycle from the interpreter, not from this test).

Each rule is a function from the scanned tree (modules, their imports) to the list of its breaches,
derived from the layers declared below (``PACKAGE_IMPORTS``, ``WIRE_LIBRARIES``, ``CORE_LAYERS``,
``TORCH_FREE_UNITS``), never from a list of today's files. The tree must have no breach of any rule,
and each rule is shown to fail on a deliberate breach: a synthetic import graph, and a small tree
written to disk with a breach of every kind. README.md and docs/architecture.md state the rules.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"folio": "folio", "folio.services": "services", "folio.shared": "shared", "folio.cuda": "cuda"}

# ------------------------------------------------------------------ the declared layers

# What each part of the package may import from folio besides itself. ``folio`` stands for the
# modules of the top-level package (the offline API: ``folio.llm``, ``folio.outputs``...).
PACKAGE_IMPORTS = {
    "folio.cuda": set(),  # the CUDA sources, package data
    "folio.shared": set(),  # the wire: messages, transport with its CURVE, config and flags, logs, tracing
    "folio.core": {"folio.shared", "folio.cuda"},  # everything that computes, no sockets
    "folio": {"folio.core", "folio.shared"},  # the offline API over the core
    "folio.services": {"folio.core", "folio.shared"},  # the shells around the core
    "folio.testing": {"folio", "folio.core", "folio.shared"},  # ships in the wheel: starts services as processes
    "folio.bench": {"folio", "folio.core", "folio.shared", "folio.services", "folio.testing", "folio.cuda"},
    "folio.cli": {"folio", "folio.core", "folio.shared", "folio.services", "folio.bench"},
}
# The libraries the wire may use besides the standard library (never torch, numpy or a model library).
WIRE_LIBRARIES = {"msgspec", "zmq", "structlog", "opentelemetry"}
# The library that opens sockets: the core never reaches it, directly or through what it imports.
SOCKET_LIBRARIES = {"zmq"}

# The core's units, lowest first. A unit is a folder or module of ``folio/core`` (``executor.X`` for
# the executor's folders; a dotted unit such as ``kv.tensors`` is a subfolder of its own). A unit
# imports only units of lower layers, never one of its own layer or above; a new one must be placed.
CORE_LAYERS = [
    ["gguf_file"],  # a GGUF's metadata and tensors, read (numpy, no torch)
    ["kv", "structured", "tokenizer", "frontdoor", "model_files", "executor.startup"],  # over folio.shared only
    ["executor.parallel", "executor.kernels", "executor.threads"],  # process groups; kernels; torch's threads
    ["executor.quant", "executor.sampling", "executor.lora", "kv.tensors"],  # over the kernels; the KV memory
    ["executor.model"],  # model families and loading
    ["executor.runtime", "scheduler"],  # the model runner and its workers; the scheduler's policy
    ["engine"],  # both in one process
]
CORE_PACKAGES = {"folio.core", "folio.core.executor"}  # their __init__ only, importing no unit
# Units that never reach torch: the scheduler's policy, the allocator, output processing, the front door.
TORCH_FREE_UNITS = {"scheduler", "kv", "tokenizer", "frontdoor", "gguf_file"}
# Module names that every service repeats by convention, and the benchmarks, named for their commands.
REPEATED_MODULE_NAMES = {"__init__", "main", "service", "metrics"}
COMMAND_NAMED_PACKAGES = ("folio.bench.",)
# A class still defined twice, to be renamed once the sampling refactor lands (its two files are in flux).
PENDING_CLASS_RENAMES = {"DetokenizeRequest"}


# ------------------------------------------------------------------ the scan


@dataclass
class Tree:
    files: dict[str, Path]  # module name -> file
    graph: dict[str, set[str]]  # module -> the folio modules it imports
    external: dict[str, set[str]]  # module -> the top-level names of what else it imports
    tests_importers: list[str]  # modules (and scripts) that import ``tests``
    classes: dict[str, list[str]]  # class name -> the modules that define it


def module_files(root: Path) -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGE_DIRS.items():
        for f in (root / folder).rglob("*.py"):
            parts = list(f.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([pkg, *parts])] = f
    return mods


def imports_of(tree: ast.Module, name: str, is_pkg: bool, known: set[str]) -> set[str]:
    """Every absolute module name the module imports (a ``from pkg import mod`` names pkg.mod)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known)
    return found


def scan(root: Path) -> Tree:
    files = module_files(root)
    graph, external, tests_importers, classes = {}, {}, [], {}
    scripts = {f"scripts/{p.name}": p for p in (root / "scripts").glob("*.py")} if (root / "scripts").is_dir() else {}
    for name, path in {**files, **scripts}.items():
        tree = ast.parse(path.read_text())
        deps = imports_of(tree, name, path.name == "__init__.py", set(files))
        if any(d == "tests" or d.startswith("tests.") for d in deps):
            tests_importers.append(name)
        if name in scripts:
            continue
        graph[name] = {d for d in deps if d in files and d != name}
        external[name] = {d.split(".")[0] for d in deps if d and not d.startswith("folio")}
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(name)
    return Tree(files, graph, external, sorted(tests_importers), classes)


TREE = scan(ROOT)


def closure(graph: dict[str, set[str]], name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(graph.get(v, ()))
    return seen


def package_of(name: str) -> str:
    """The declared part of the package a module belongs to (``folio`` for the top-level modules)."""
    for pkg in sorted(PACKAGE_IMPORTS, key=len, reverse=True):
        if name == pkg or name.startswith(pkg + "."):
            return pkg
    return name.split(".")[0]


def core_unit(name: str) -> str | None:
    """The core unit a module belongs to: the longest declared unit it lies in, else its folder
    (``executor.<folder>``) or top-level module, which the layer rule reports as not placed."""
    parts = name.split(".")
    if parts[:2] != ["folio", "core"] or name in CORE_PACKAGES:
        return None
    rest = ".".join(parts[2:])
    declared = [u for layer in CORE_LAYERS for u in layer if rest == u or rest.startswith(u + ".")]
    if declared:
        return max(declared, key=len)
    return ".".join(parts[2:4]) if parts[2] == "executor" else parts[2]


def service_of(name: str) -> str | None:
    """The service a module belongs to (``folio.services.<name>.*``); None for the top-level modules."""
    parts = name.split(".")
    return parts[2] if parts[:2] == ["folio", "services"] and len(parts) > 3 else None


# ------------------------------------------------------------------ the rules: each lists its breaches


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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


def cycle_breaches(tree: Tree) -> list[str]:
    return [" -> ".join(c) for c in cycles(tree.graph)]


def package_breaches(tree: Tree) -> list[str]:
    """Each import of a part of the package that the importer's part may not import."""
    bad = []
    for m, deps in sorted(tree.graph.items()):
        here = package_of(m)
        allowed = PACKAGE_IMPORTS.get(here, set()) | {here}
        bad += [f"{m} ({here}) imports {d}" for d in sorted(deps) if package_of(d) not in allowed]
    return bad


def wire_breaches(tree: Tree) -> list[str]:
    """Each library a module of ``folio.shared`` imports beyond the standard library and the wire's."""
    allowed = set(sys.stdlib_module_names) | WIRE_LIBRARIES | {"__future__"}
    return [f"{m} imports {x}" for m, xs in sorted(tree.external.items()) if package_of(m) == "folio.shared"
            for x in sorted(xs - allowed)]


def socket_breaches(tree: Tree) -> list[str]:
    """Each core module that reaches a socket library, directly or through what it imports."""
    bad = []
    for m in sorted(tree.graph):
        if package_of(m) == "folio.core":
            reach = sorted(d for d in closure(tree.graph, m) if tree.external.get(d, set()) & SOCKET_LIBRARIES)
            if reach:
                bad.append(f"{m} reaches a socket library through {reach}")
    return bad


def service_breaches(tree: Tree) -> list[str]:
    """Each import by a service of another service, or of a top-level module of ``folio.services``
    that itself imports a service (the launcher, the in-process stack): a service imports the core,
    ``folio.shared``, its own package and the service framework only."""
    tops = {m for m in tree.graph if package_of(m) == "folio.services" and service_of(m) is None}
    framework = {m for m in tops if not any(service_of(d) for d in closure(tree.graph, m))}
    bad = []
    for m, deps in sorted(tree.graph.items()):
        own = service_of(m)
        if own is None:
            continue
        bad += [f"{m} imports {d}" for d in sorted(deps)
                if service_of(d) not in (None, own) or (d in tops and d not in framework)]
    return bad


def layer_breaches(tree: Tree) -> list[str]:
    """Each import of a core unit from a unit not below it, and each unit not in ``CORE_LAYERS``."""
    layer = {unit: i for i, units in enumerate(CORE_LAYERS) for unit in units}
    bad = []
    for m, deps in sorted(tree.graph.items()):
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


def torch_breaches(tree: Tree) -> list[str]:
    """Each module of a torch-free unit that reaches torch, directly or through what it imports."""
    bad = []
    for m in sorted(tree.graph):
        if core_unit(m) in TORCH_FREE_UNITS:
            reach = sorted(d for d in closure(tree.graph, m) if "torch" in tree.external.get(d, set()))
            if reach:
                bad.append(f"{m} reaches torch through {reach}")
    return bad


def importing_tests_breaches(tree: Tree) -> list[str]:
    """Each module of the package, or script, that imports ``tests``."""
    return [f"{m} imports tests" for m in tree.tests_importers]


def name_breaches(tree: Tree) -> list[str]:
    """Each class defined twice in the package, and each module name used twice (but the names every
    service repeats by convention and the benchmarks, named for their commands)."""
    bad = [f"class {c} in {sorted(ms)}" for c, ms in sorted(tree.classes.items())
           if len(ms) > 1 and c not in PENDING_CLASS_RENAMES]
    by_name: dict[str, list[str]] = {}
    for m, path in tree.files.items():
        if path.stem not in REPEATED_MODULE_NAMES and not m.startswith(COMMAND_NAMED_PACKAGES):
            by_name.setdefault(path.stem, []).append(m)
    return bad + [f"module {n}.py in {sorted(ms)}" for n, ms in sorted(by_name.items()) if len(ms) > 1]


def pyproject_breaches(listed: set[str], packages: set[str]) -> list[str]:
    """Each package folder ``pyproject.toml`` does not list (the wheel would lack it), and each it
    lists that is gone."""
    return [f"not listed: {p}" for p in sorted(packages - listed)] + [f"listed, gone: {p}" for p in sorted(listed - packages)]


RULES = [cycle_breaches, package_breaches, wire_breaches, socket_breaches, service_breaches, layer_breaches,
         torch_breaches, importing_tests_breaches, name_breaches]


def pyproject_packages(root: Path) -> set[str]:
    block = (root / "pyproject.toml").read_text().split("\npackages = [", 1)[1].split("]", 1)[0]
    return set(re.findall(r'"([\w.]+)"', block))


# ------------------------------------------------------------------ the tree keeps every rule


def test_every_rule_holds_for_the_tree():
    assert {rule.__name__: rule(TREE) for rule in RULES} == {rule.__name__: [] for rule in RULES}


def test_pyproject_lists_every_package():
    """The wheel takes the packages ``pyproject.toml`` names: a folder added or moved is listed there."""
    packages = {m for m, p in TREE.files.items() if p.name == "__init__.py"}
    assert pyproject_breaches(pyproject_packages(ROOT), packages) == []


def test_the_declared_layers_name_what_exists():
    """No layer names a unit or a package that is gone, so the declarations stay the map of the tree."""
    units = {core_unit(m) for m in TREE.files if core_unit(m)}
    assert {u for layer in CORE_LAYERS for u in layer} == units
    assert set(PACKAGE_IMPORTS) == {package_of(m) for m in TREE.files}


# ------------------------------------------------------------------ each rule fails on a breach


def tree_of(graph: dict[str, set[str]], external: dict[str, set[str]] | None = None, tests_importers=(),
            classes=None) -> Tree:
    names = set(graph) | {d for ds in graph.values() for d in ds}
    files = {m: Path(m.replace(".", "/") + ".py") for m in names}
    ext = {m: set() for m in names} | (external or {})
    return Tree(files, {m: set(graph.get(m, ())) for m in names}, ext, list(tests_importers), classes or {})


BREACHES = {
    cycle_breaches: tree_of({"folio.core.kv.a": {"folio.core.kv.b"}, "folio.core.kv.b": {"folio.core.kv.a"}}),
    package_breaches: tree_of({"folio.shared.messages": {"folio.core.engine"}}),
    wire_breaches: tree_of({"folio.shared.messages": set()}, {"folio.shared.messages": {"torch"}}),
    socket_breaches: tree_of({"folio.core.engine": {"folio.shared.transport"}}, {"folio.shared.transport": {"zmq"}}),
    service_breaches: tree_of({"folio.services.gateway.app": {"folio.services.tokenizer.service"}}),
    layer_breaches: tree_of({"folio.core.executor.kernels.attention": {"folio.core.executor.quant.formats"}}),
    torch_breaches: tree_of({"folio.core.scheduler.policy": {"folio.core.kv.tensors.pool"}},
                            {"folio.core.kv.tensors.pool": {"torch"}}),
    importing_tests_breaches: tree_of({"folio.testing.models": set()}, tests_importers=["folio.testing.models"]),
    name_breaches: tree_of({"folio.core.kv.a": set(), "folio.services.b.c": set()},
                           classes={"Server": ["folio.core.kv.a", "folio.services.b.c"]}),
}


def test_every_rule_has_a_breach():
    assert set(BREACHES) == set(RULES)


def test_each_rule_fails_on_its_breach():
    for rule, tree in BREACHES.items():
        assert rule(tree), f"{rule.__name__} let its breach pass"
        others = [other.__name__ for other in RULES if other is not rule and other(tree)]
        assert others == [], f"{rule.__name__}'s breach also breaks {others}"


def test_the_package_rule_covers_each_declared_boundary():
    """The boundaries the README names, each a breach of the package rule."""
    for importer, imported in [("folio.core.engine", "folio.services.scheduler.service"),  # core -> service
                               ("folio.testing.server", "folio.services.serve"),  # testing -> service
                               ("folio.shared.config", "folio.core.model_files"),  # wire -> core
                               ("folio.llm", "folio.services.serve")]:  # offline API -> service
        assert package_breaches(tree_of({importer: {imported}})), (importer, imported)
    assert package_breaches(tree_of({"folio.services.serve": {"folio.core.engine", "folio.shared.config"}})) == []


def test_the_service_rule_lets_in_the_framework_only():
    ok = {"folio.services.gateway.main": {"folio.services.shell", "folio.services.gateway.app"},
          "folio.services.shell": {"folio.shared.transport"}}
    assert service_breaches(tree_of(ok)) == []
    launcher = {"folio.services.gateway.main": {"folio.services.serve"},
                "folio.services.serve": {"folio.services.tokenizer.main"}}
    assert len(service_breaches(tree_of(launcher))) == 1


def test_the_layer_rule_finds_each_kind_of_back_edge():
    ok = {"folio.core.executor.quant.gpu": {"folio.core.executor.kernels.cuda_kernels", "folio.shared.messages"},
          "folio.core.kv.tensors.pool": {"folio.core.executor.kernels.kv_quant", "folio.core.kv.tiers"}}
    assert layer_breaches(tree_of(ok)) == []
    for graph in ({"folio.core.executor.kernels.attention": {"folio.core.executor.quant.formats"}},  # upward
                  {"folio.core.executor.sampling.sampler": {"folio.core.executor.lora.punica"}},  # same layer
                  {"folio.core.kv.allocator": {"folio.core.kv.tensors.pool"}},  # a unit into its subfolder
                  {"folio.core.newfolder.x": set()},  # not placed
                  {"folio.core": {"folio.core.engine"}}):  # a package's __init__
        assert len(layer_breaches(tree_of(graph))) == 1, graph


def test_the_name_rule_finds_a_module_name_twice():
    tree = tree_of({"folio.core.tokenizer.outputs": set(), "folio.outputs": set(), "folio.bench.serve": set(),
                    "folio.cli.serve": set(), "folio.services.gateway.metrics": set(),
                    "folio.services.router.metrics": set()})
    assert name_breaches(tree) == ["module outputs.py in ['folio.core.tokenizer.outputs', 'folio.outputs']"]


def test_the_pyproject_rule_finds_a_missing_package():
    assert pyproject_breaches({"folio", "folio.core"}, {"folio", "folio.core", "folio.core.kv"}) == [
        "not listed: folio.core.kv"]


def test_a_tree_on_disk_with_a_breach_of_each_kind(tmp_path):
    """The whole path, files to breaches: a small tree of the package's shape, scanned as the real one."""
    files = {
        "folio/__init__.py": "",
        "folio/core/__init__.py": "",
        "folio/core/kv/__init__.py": "",
        "folio/core/kv/allocator.py": "from folio.core.kv import steplog\n",  # a cycle with steplog
        "folio/core/kv/steplog.py": "def f():\n    from folio.core.kv.allocator import x\n",  # lazy, still seen
        "folio/core/engine.py": "import zmq\nfrom folio.services.scheduler import service\n",  # socket; a service
        "folio/core/scheduler/__init__.py": "",
        "folio/core/scheduler/policy.py": "from ..executor.kernels import attention\n",  # reaches torch
        "folio/core/kv/window.py": "from folio.core.scheduler.policy import plan\n",  # a layer above its own
        "folio/core/executor/__init__.py": "",
        "folio/core/executor/kernels/__init__.py": "",
        "folio/core/executor/kernels/attention.py": "import torch\n",
        "folio/testing/__init__.py": "",
        "folio/testing/server.py": "import tests.conftest\nfrom folio.services.serve import serve\n",
        "services/__init__.py": "",
        "services/serve.py": "from folio.services.scheduler import service\n",
        "services/scheduler/__init__.py": "",
        "services/scheduler/service.py": "class Server: pass\n",
        "services/gateway/__init__.py": "",
        "services/gateway/app.py": "from folio.services.scheduler.service import Server\nclass Server: pass\n",
        "shared/__init__.py": "",
        "shared/config.py": "import numpy\n",
        "cuda/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    tree = scan(tmp_path)
    found = {rule.__name__: rule(tree) for rule in RULES}
    assert found["cycle_breaches"] == ["folio.core.kv.allocator -> folio.core.kv.steplog"]
    assert "folio.core.engine (folio.core) imports folio.services.scheduler.service" in found["package_breaches"]
    assert "folio.testing.server (folio.testing) imports folio.services.serve" in found["package_breaches"]
    assert found["wire_breaches"] == ["folio.shared.config imports numpy"]
    assert found["socket_breaches"] == ["folio.core.engine reaches a socket library through ['folio.core.engine']"]
    assert found["service_breaches"] == ["folio.services.gateway.app imports folio.services.scheduler.service"]
    assert found["layer_breaches"] == ["folio.core.kv.window (kv) imports folio.core.scheduler.policy "
                                       "(scheduler), not below it"]
    assert found["torch_breaches"] == [
        "folio.core.kv.window reaches torch through ['folio.core.executor.kernels.attention']",
        "folio.core.scheduler.policy reaches torch through ['folio.core.executor.kernels.attention']"]
    assert found["importing_tests_breaches"] == ["folio.testing.server imports tests"]
    assert found["name_breaches"] == ["class Server in ['folio.services.gateway.app', "
                                      "'folio.services.scheduler.service']"]
