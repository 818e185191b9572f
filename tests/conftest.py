"""Shared fixtures: tiny random-weight models written to disk, and the real default model."""

from __future__ import annotations

import os

# the engine's tests run batch-invariant (off by default in production for its cost), services started by
# the tests included: they inherit the environment
os.environ.setdefault("FOLIO_BATCH_INVARIANT", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from folio.testing.models import write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm_dir() -> str:
    """The packaged SmolLM2-135M-Instruct, converted once into the cache folder."""
    from folio.core.models import prepare_default_model

    return str(prepare_default_model(quiet=True))


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
