"""Fixtures of the CUDA kernel tests: the CPU emulation library, and skipping ``gpu`` tests.

``gpu``-marked tests need a CUDA device and CuPy; without them they are skipped, so this suite
runs on a CPU-only CI machine (compile checks + emulation) and fully on a lent GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.cuda.emu_runtime import EmulatedLauncher, build_library


HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    # pytest hands every conftest all items: touch only this folder's
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords and HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def emu_lib():
    """Built once per session (and cached on disk by content hash across sessions)."""
    return build_library()


@pytest.fixture
def emu_launcher(emu_lib) -> EmulatedLauncher:
    return EmulatedLauncher(emu_lib)
