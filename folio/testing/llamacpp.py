"""llama.cpp's own HTTP server (``llama-server``) for comparisons: found, or built from source.

``find_llama_server()`` looks at ``$FOLIO_LLAMA_SERVER``, then ``llama-server`` on the PATH, then
the one built here before (``<folio cache>/llama.cpp/llama-server``). ``build_llama_server()``
builds that one: it downloads the llama-cpp-python source distribution from the package index
with pip (the llama.cpp sources it vendors; the pin below) and compiles only the ``llama-server``
target with CMake for this CPU (no CURL, no OpenSSL, no GPU back-end): minutes on a small
machine, once. ``python -m folio.testing.llamacpp`` builds it; the tests only use one that exists
(or build it when ``FOLIO_BUILD_LLAMA_SERVER=1``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from folio.shared.config import cache_dir

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # whose sdist vendors the llama.cpp that gets built


def built_path() -> Path:
    return cache_dir() / "llama.cpp" / "llama-server"


def find_llama_server() -> str | None:
    explicit = os.environ.get("FOLIO_LLAMA_SERVER")
    if explicit:
        return explicit
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path
    built = built_path()
    return str(built) if built.is_file() and os.access(built, os.X_OK) else None


def build_llama_server(jobs: int = 2, log=sys.stderr) -> str:
    """Build ``llama-server`` into the cache folder and return its path (raises on failure)."""
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        raise RuntimeError("building llama-server needs cmake and a C++ compiler")
    target = built_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="folio-llama-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", tmp, LLAMA_CPP_PYTHON], check=True, stdout=log, stderr=log)
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (src,) = Path(tmp).glob("*/vendor/llama.cpp")
        build = Path(tmp) / "build"
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON"],
                       check=True, stdout=log, stderr=log)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
                       check=True, stdout=log, stderr=log)
        (binary,) = build.glob("bin/llama-server")
        shutil.copy2(binary, target)
    return str(target)


def server_command(binary: str, gguf: str, port: int, parallel: int = 4) -> list[str]:
    """``llama-server`` on ``gguf`` at 127.0.0.1:``port`` with ``parallel`` slots."""
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-c", str(512 * parallel),
            "-np", str(parallel), "--no-webui"]


if __name__ == "__main__":
    print(build_llama_server(jobs=int(sys.argv[1]) if len(sys.argv) > 1 else 2))
