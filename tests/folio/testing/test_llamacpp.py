"""How the CPU peers' binaries are found: each peer's environment variables first, the PATH for mainline
only (ik_llama.cpp's binaries carry the same names), then the ones ``build_peer`` made, kept beside a
build keyed by the pinned sdist; and the server command each peer is started with."""

from __future__ import annotations

import os

import pytest

from folio.testing import llamacpp
from folio.testing.llamacpp import (
    IK_LLAMA_CPP, LLAMA_CPP, built_path, find_binary, find_ik_llama_server, find_llama_server, server_command,
)


@pytest.fixture
def clean(monkeypatch, tmp_path):
    """No peer variable set, an empty PATH folder and an empty folio cache."""
    for name in list(os.environ):
        if name.startswith(("FOLIO_LLAMA_", "FOLIO_IK_LLAMA_")):
            monkeypatch.delenv(name)
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def executable(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


def test_each_peer_has_its_own_variables(clean, monkeypatch):
    monkeypatch.setenv("FOLIO_IK_LLAMA_SERVER", "/opt/ik/llama-server")
    monkeypatch.setenv("FOLIO_LLAMA_PERPLEXITY", "/opt/mainline/llama-perplexity")
    assert find_ik_llama_server() == "/opt/ik/llama-server"
    assert find_llama_server() is None
    assert find_binary(LLAMA_CPP, "llama-perplexity") == "/opt/mainline/llama-perplexity"
    assert find_binary(IK_LLAMA_CPP, "llama-perplexity") is None


def test_the_path_serves_mainline_only(clean):
    on_path = executable(clean / "bin" / "llama-server")
    assert find_llama_server() == on_path
    assert find_ik_llama_server() is None


def test_built_binaries_live_beside_a_build_keyed_by_the_pin(clean):
    for peer in (LLAMA_CPP, IK_LLAMA_CPP):
        path = built_path("llama-server", peer)
        assert path.parent.name == f"bin-{peer.pin}" and path.parent.parent.name == peer.name
        assert find_binary(peer, "llama-server") is None
        executable(path)
        assert find_binary(peer, "llama-server") == str(path)
    assert built_path("llama-server", LLAMA_CPP) != built_path("llama-server", IK_LLAMA_CPP)
    assert IK_LLAMA_CPP.pin == "ik-llama-cpp-python-0.1.5" and "llama-quantize" not in IK_LLAMA_CPP.binaries


def test_ensure_peer_builds_only_what_is_missing(clean, monkeypatch):
    for name in LLAMA_CPP.binaries:
        executable(built_path(name, LLAMA_CPP))
    monkeypatch.setattr(llamacpp, "build_peer", lambda *a, **k: pytest.fail("nothing was missing"))
    found = llamacpp.ensure_peer(LLAMA_CPP, log=None)
    assert found == {name: str(built_path(name, LLAMA_CPP)) for name in LLAMA_CPP.binaries}


def test_each_peer_is_served_with_its_slots_context_and_no_web_ui():
    mainline = server_command("/b/llama-server", "m.gguf", 8080, parallel=32, ctx_per_slot=2048)
    ik = server_command("/b/llama-server", "m.gguf", 8080, parallel=32, ctx_per_slot=2048, peer=IK_LLAMA_CPP)
    for argv in (mainline, ik):
        assert argv[argv.index("-c") + 1] == str(32 * 2048) and argv[argv.index("-np") + 1] == "32"
        assert argv[argv.index("--port") + 1] == "8080" and argv[argv.index("-m") + 1] == "m.gguf"
    assert "--no-webui" in mainline and ik[ik.index("--webui") + 1] == "none"
