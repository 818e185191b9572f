"""No pickle on bytes from outside: the package is read (its syntax tree, not its text) for every
call that unpickles (``pickle``/``cloudpickle``/``dill``/``marshal`` loads, ``torch.load`` without
``weights_only=True``, ``numpy.load(allow_pickle=True)``).

A peer's or a client's bytes are msgpack or raw KV frames, never pickles. The one call allowed is
named below with why: it reads a file this process's own user wrote into its own cache folder.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("folio", "services", "shared")
# path -> why its unpickling never sees a peer's or a client's bytes
ALLOWED = {
    "folio/core/executor/model/loader.py":
        "load_prepared maps back the model this user's folio wrote into its own cache folder (prepared/)",
}
_UNPICKLERS = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "_pickle"}


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def _kw(call: ast.Call, name: str):
    for k in call.keywords:
        if k.arg == name:
            return k.value.value if isinstance(k.value, ast.Constant) else "?"
    return None


def unsafe_calls(source: str) -> list[str]:
    """Each call in ``source`` that may unpickle, as ``line: call``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        head, _, tail = name.rpartition(".")
        bad = (head in _UNPICKLERS and tail in ("load", "loads", "Unpickler")) \
            or (name == "Unpickler") \
            or (tail == "load" and head == "torch" and _kw(node, "weights_only") is not True) \
            or (tail == "load" and head in ("np", "numpy") and _kw(node, "allow_pickle") not in (None, False))
        if bad:
            out.append(f"{node.lineno}: {name}")
    return out


def test_the_checker_finds_each_kind():
    planted = ("import pickle, torch, numpy as np\npickle.loads(b)\ntorch.load(f)\ntorch.load(f, weights_only=False)\n"
               "np.load(f, allow_pickle=True)\ntorch.load(f, weights_only=True)\nnp.load(f)\n")
    assert [c.split(": ")[1] for c in unsafe_calls(planted)] == ["pickle.loads", "torch.load", "torch.load", "np.load"]


def test_no_pickle_on_bytes_from_outside():
    found = {}
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            calls = unsafe_calls(path.read_text())
            if calls and rel not in ALLOWED:
                found[rel] = calls
    assert not found, f"unpickling outside {sorted(ALLOWED)}: {found}"
    for rel in ALLOWED:  # an allowance outlives its call: drop it
        assert unsafe_calls((ROOT / rel).read_text()), f"{rel} no longer unpickles: remove it from ALLOWED"
