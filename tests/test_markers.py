"""The markers mean what ``docs/testing.md`` says: the markers pyproject declares are the ones the docs
describe and the only ones the tests use (besides pytest's own and its plugins'), and a test that
loads SmolLM2 without the ``slow`` mark fails (``tests/conftest.py``), so ``-m "not slow"`` skips
every test that loads it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings", "asyncio", "timeout"}


def declared() -> dict[str, str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    return dict(m.split(": ", 1) for m in config["markers"])


def test_the_declared_markers_are_the_documented_ones():
    docs = (ROOT / "docs" / "testing.md").read_text()
    documented = set(re.findall(r"Tests marked `(\w+)`", docs))
    assert documented == set(declared()), (documented, set(declared()))
    assert '`-m "not slow"` skips' in docs


def test_the_tests_use_only_declared_markers():
    used = {m for f in ROOT.joinpath("tests").rglob("*.py")
            for m in re.findall(r"pytest\.mark\.(\w+)", f.read_text())}
    assert used - BUILTIN <= set(declared()), used - BUILTIN - set(declared())


def fake_item(fixtures: list[str], slow: bool):
    return SimpleNamespace(nodeid="tests/x.py::test_x", fixturenames=fixtures,
                           get_closest_marker=lambda name: object() if slow and name == "slow" else None)


def test_a_test_that_asks_for_smollm_dir_must_be_marked_slow():
    with pytest.raises(pytest.fail.Exception, match="loads SmolLM2 .* not marked slow"):
        conftest.pytest_runtest_setup(fake_item(["tmp_path", "smollm_dir"], slow=False))
    conftest.pytest_runtest_setup(fake_item(["tmp_path", "smollm_dir"], slow=True))
    conftest.pytest_runtest_setup(fake_item(["tmp_path", "smollm_tokenizer_dir"], slow=False))


def test_loading_the_packaged_model_in_a_fast_test_fails(tiny_model_dir):
    from folio.core.executor.model.loader import load_model
    from folio.core.model_files import default_model_dir

    with pytest.raises(pytest.fail.Exception, match="loads the packaged SmolLM2 but is not marked slow"):
        load_model(default_model_dir(), torch.float32, torch.device("cpu"), "none")
    assert load_model(tiny_model_dir, torch.float32, torch.device("cpu"), "none") is not None
