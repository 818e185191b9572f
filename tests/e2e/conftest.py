"""``folio serve`` started for real (five processes, ipc:// sockets, HTTP) on SmolLM2-135M-Instruct."""

from __future__ import annotations

import pytest

from folio.testing.server import start_server, stop_server


@pytest.fixture(scope="session")
def default_server(smollm_dir):
    srv = start_server(smollm_dir, "--num-kv-blocks", "512", "--max-num-batched-tokens", "512")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def server(default_server):
    return default_server


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
