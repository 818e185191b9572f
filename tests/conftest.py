"""Shared fixtures: tiny random-weight models written to disk, SmolLM2's tokenizer alone, and the real
default model, which only tests marked ``slow`` may load (``docs/testing.md``; checked here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings as hypothesis_settings

from folio.testing.models import write_tiny_model

# CI (CI=true) runs each property test on the same examples every time, so a run is repeatable and
# the suite's verdict is the code's, not the draw's; elsewhere the examples are new on every run.
hypothesis_settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    hypothesis_settings.load_profile("ci")


@pytest.fixture(scope="session", autouse=True)
def stack_keys_dir(tmp_path_factory) -> str:
    """One key folder for the session's stacks (``FOLIO_KEYS_DIR``, inherited by every service the
    tests start): tcp sockets speak CURVE with it, as a deployment's do."""
    import os

    from folio.shared.keys import init_keys

    folder = str(tmp_path_factory.mktemp("keys") / "stack")
    init_keys(folder)
    os.environ["FOLIO_KEYS_DIR"] = folder
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(params=[False, True], ids=["default", "invariant"])
def batch_invariant(request) -> bool:
    """Both executor paths, for the oracles against transformers and peft: the default one that
    ``folio serve`` takes (torch/SDPA for fp32) and ``--batch-invariant`` (the per-row kernels).
    The suite's other tests run the default; those that need invariance turn it on themselves."""
    return request.param


@pytest.fixture(scope="session")
def smollm_dir() -> str:
    """The packaged SmolLM2-135M-Instruct, converted once into the cache folder."""
    from folio.core.model_files import prepare_default_model

    return str(prepare_default_model(quiet=True))


@pytest.fixture(scope="session")
def smollm_tokenizer_dir(tmp_path_factory) -> str:
    """SmolLM2's tokenizer files (no weights), for tiny models that need a real tokenizer: the
    prepared model's folder when it exists, else the tokenizer and config read from the packaged GGUF."""
    from folio.core.model_files import default_model_dir, is_prepared, packaged_gguf

    if is_prepared(default_model_dir()):
        return str(default_model_dir())
    from transformers import AutoConfig, AutoTokenizer

    gguf = packaged_gguf()
    folder = tmp_path_factory.mktemp("smollm-tokenizer")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return str(folder)


def pytest_runtest_setup(item):
    """``-m "not slow"`` must skip every test that loads SmolLM2: one that is not marked ``slow`` and
    asks for ``smollm_dir`` fails here, before the model is prepared."""
    if "smollm_dir" in item.fixturenames and item.get_closest_marker("slow") is None:
        pytest.fail(f"{item.nodeid} loads SmolLM2 (smollm_dir) but is not marked slow", pytrace=False)


@pytest.fixture(autouse=True)
def only_slow_tests_load_the_default_model(request, monkeypatch):
    """A test not marked ``slow`` that loads the packaged model's weights in this process (``LLM``
    or a runner given its name or folder) fails, saying so. Its tokenizer alone is allowed."""
    if request.node.get_closest_marker("slow") is not None:
        return
    from folio.core.executor.model import loader
    from folio.core.executor.runtime import runner, spec_decode
    from folio.core.model_files import default_model_dir

    def guarded(load):
        def load_model(path, *args, **kwargs):
            if Path(path).resolve() == default_model_dir().resolve():
                pytest.fail(f"{request.node.nodeid} loads the packaged SmolLM2 but is not marked slow", pytrace=False)
            return load(path, *args, **kwargs)
        return load_model

    for module in (loader, runner, spec_decode):
        monkeypatch.setattr(module, "load_model", guarded(module.load_model))


@pytest.fixture(autouse=True)
def one_torch_thread_for_tiny_models(request):
    """Tests without the real model run tiny ones, whose GEMMs are far too small to share between
    threads: with two threads on two busy cores each step waited on the other thread, twenty
    times slower than one thread in a measured run. Tests of the real model keep the default."""
    if "smollm_dir" in request.fixturenames:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
