"""The CPU peers' own tools for comparisons and test oracles: their sources, converter and binaries.

More in docs/modules.md (folio/testing/llamacpp.py).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from folio.shared.config import cache_dir


@dataclass(frozen=True)
class Peer:
    """A CPU engine built from the llama.cpp sources vendored by one pinned sdist."""

    name: str  # its folder under the cache and its name in reports
    requirement: str  # the pinned sdist that vendors it
    vendor: str  # the sources' folder inside the sdist
    env_prefix: str  # $<prefix><BINARY> names a binary explicitly
    binaries: tuple[str, ...]  # what build_peer builds
    cmake_flags: tuple[str, ...]
    on_path: bool  # whether a binary on the PATH counts as this peer's
    missing_files: tuple[tuple[str, str], ...] = ()  # (path in the sources, text): what the sdist left out

    @property
    def pin(self) -> str:
        return self.requirement.replace("==", "-")


_COMMON_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
                 "-DGGML_NATIVE=ON", "-DGGML_CCACHE=OFF", "-DLLAMA_BUILD_SERVER=ON")
LLAMA_CPP = Peer(
    "llama.cpp", "llama-cpp-python==0.3.36", "vendor/llama.cpp", "FOLIO_LLAMA_",
    ("llama-server", "llama-quantize", "llama-perplexity"),
    _COMMON_FLAGS + ("-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_OPENSSL=OFF"), on_path=True)
# the script that writes build-info.cpp (the build's commit and compiler, printed at start), which
# ik-llama-cpp-python's sdist leaves out; as upstream's, run from the source root
_BUILD_INFO_GEN = """include(${CMAKE_CURRENT_SOURCE_DIR}/cmake/build-info.cmake)
configure_file(${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp.in ${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp)
"""
# its server and perplexity tool are examples there; the flash-attention kernels for quantized KV
# caches (every K/V type pair, most of the build's time) are left out: every run here keeps f16 KV
IK_LLAMA_CPP = Peer(
    "ik_llama.cpp", "ik-llama-cpp-python==0.1.5", "vendor/ik_llama.cpp", "FOLIO_IK_LLAMA_",
    ("llama-server", "llama-perplexity"),
    _COMMON_FLAGS + ("-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_SERVER_SSL=OFF", "-DGGML_IQK_FA_ALL_QUANTS=OFF"),
    on_path=False, missing_files=(("common/cmake/build-info-gen-cpp.cmake", _BUILD_INFO_GEN),))
PEERS = {p.name: p for p in (LLAMA_CPP, IK_LLAMA_CPP)}
LLAMA_CPP_PYTHON = LLAMA_CPP.requirement  # the pin the GGUF writers key their files by
BINARIES = LLAMA_CPP.binaries


def _root(peer: Peer = LLAMA_CPP) -> Path:
    return cache_dir() / peer.name


@contextmanager
def _locked(name: str, peer: Peer = LLAMA_CPP):
    """An exclusive lock file under the cache, so two processes never download or build at once."""
    _root(peer).mkdir(parents=True, exist_ok=True)
    with open(_root(peer) / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def peer_source(peer: Peer, log=sys.stderr) -> Path:
    """The vendored source folder of ``peer``'s pinned sdist, downloaded and extracted once."""
    extracted = _root(peer) / "src" / peer.pin
    source = extracted / peer.vendor
    if (extracted / ".complete").is_file():
        return source
    with _locked("source", peer):
        if (extracted / ".complete").is_file():
            return source
        extracted.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="folio-llama-", dir=extracted.parent) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            "-d", tmp, peer.requirement], check=True, stdout=log, stderr=log)
            (sdist,) = Path(tmp).glob("*.tar.gz")
            with tarfile.open(sdist) as tar:
                tar.extractall(Path(tmp) / "x", filter="data")
            (top,) = (Path(tmp) / "x").iterdir()
            if extracted.exists():
                shutil.rmtree(extracted)
            top.rename(extracted)
        (extracted / ".complete").touch()
    return source


def llamacpp_source(log=sys.stderr) -> Path:
    """Mainline llama.cpp's source folder (the converter and the quantizer come from it)."""
    return peer_source(LLAMA_CPP, log)


def convert_script(log=sys.stderr) -> Path:
    return llamacpp_source(log) / "convert_hf_to_gguf.py"


# one interpreter for many conversions: importing the converter (torch, transformers, its ~90
# model modules) costs more than converting a tiny model
_CONVERT_MANY = """
import json, sys, traceback
import convert_hf_to_gguf
jobs, report = json.loads(sys.argv[1]), sys.argv[2]
errors = {}
for argv in jobs:
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    try:
        convert_hf_to_gguf.main()
    except BaseException:
        errors[argv[2]] = traceback.format_exc()
with open(report, "w") as f:
    json.dump(errors, f)
"""


def convert_many(jobs: list[tuple[str | Path, str | Path, str]], log=sys.stderr) -> dict[str, str]:
    """Convert each (model folder, out file, outtype) with llama.cpp's own converter, in one process;
    returns {out: the converter's traceback} for those that failed."""
    import json

    script = convert_script(log)
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # so it imports its own gguf-py
    argvs = [[str(folder), "--outfile", str(out), "--outtype", outtype] for folder, out, outtype in jobs]
    with tempfile.TemporaryDirectory(prefix="folio-convert-") as tmp:
        report = Path(tmp) / "errors.json"
        # the script's folder is the working directory, so ``import convert_hf_to_gguf`` finds it
        result = subprocess.run([sys.executable, "-c", _CONVERT_MANY, json.dumps(argvs), str(report)],
                                cwd=script.parent, env=env, capture_output=True, text=True)
        if result.returncode != 0 or not report.is_file():
            raise RuntimeError(f"convert_hf_to_gguf.py failed ({result.returncode}):\n{result.stderr[-4000:]}")
        errors = json.loads(report.read_text())
    if log is not None and result.stderr:
        print(result.stderr[-2000:], file=log)
    return errors


def convert_hf_to_gguf(model_dir: str | Path, out: str | Path, outtype: str = "f32", log=sys.stderr) -> Path:
    """Convert a Hugging Face checkpoint folder to ``out`` with llama.cpp's own converter."""
    errors = convert_many([(model_dir, out, outtype)], log)
    if errors:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}:\n{errors[str(out)][-4000:]}")
    return Path(out)


def built_path(name: str = "llama-server", peer: Peer = LLAMA_CPP) -> Path:
    """Where ``build_peer`` puts ``name``: beside the build, keyed by the pin."""
    return _root(peer) / f"bin-{peer.pin}" / name


def find_binary(peer: Peer, name: str) -> str | None:
    """``name`` of ``peer``: its environment variable, the PATH (mainline only), or the one built here."""
    explicit = os.environ.get(peer.env_prefix + name.removeprefix("llama-").upper())
    if explicit:
        return explicit
    on_path = shutil.which(name) if peer.on_path else None
    if on_path:
        return on_path
    built = built_path(name, peer)
    return str(built) if built.is_file() and os.access(built, os.X_OK) else None


def find_llama_server() -> str | None:
    return find_binary(LLAMA_CPP, "llama-server")


def find_llama_quantize() -> str | None:
    return find_binary(LLAMA_CPP, "llama-quantize")


def find_ik_llama_server() -> str | None:
    return find_binary(IK_LLAMA_CPP, "llama-server")


def build_peer(peer: Peer, targets: tuple[str, ...] | None = None, jobs: int = 2, log=sys.stderr) -> dict[str, str]:
    """Build ``targets`` (default: all of the peer's binaries) into the cache and return their
    paths (raises on failure). The CMake build folder stays in the cache, so building one more
    target later is incremental."""
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        raise RuntimeError(f"building {peer.name} needs cmake and a C++ compiler")
    targets = targets or peer.binaries
    source = peer_source(peer, log)
    build = _root(peer) / f"build-{peer.pin}"
    with _locked("build", peer):
        for relative, text in peer.missing_files:
            if not (source / relative).is_file():
                (source / relative).parent.mkdir(parents=True, exist_ok=True)
                (source / relative).write_text(text)
        if not (build / "CMakeCache.txt").is_file():
            subprocess.run(["cmake", "-S", str(source), "-B", str(build), *peer.cmake_flags],
                           check=True, stdout=log, stderr=log)
        subprocess.run(["cmake", "--build", str(build), "--target", *targets, "-j", str(jobs)],
                       check=True, stdout=log, stderr=log)
        paths = {}
        for name in targets:
            (binary,) = build.glob(f"bin/{name}")
            target = built_path(name, peer)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(binary, target.with_suffix(".tmp"))
            os.replace(target.with_suffix(".tmp"), target)
            paths[name] = str(target)
    return paths


def ensure_peer(peer: Peer, names: tuple[str, ...] | None = None, jobs: int = 2, log=sys.stderr) -> dict[str, str]:
    """``names`` of ``peer`` (default: all its binaries) found, or built when one is missing."""
    names = names or peer.binaries
    found = {name: find_binary(peer, name) for name in names}
    missing = tuple(name for name, path in found.items() if path is None)
    if missing:
        print(f"building {', '.join(missing)} of {peer.name} from {peer.requirement}'s sources (minutes, once)",
              file=log)
        found.update(build_peer(peer, missing, jobs=jobs, log=log))
    return found


def build_llama_cpp(targets: tuple[str, ...] = BINARIES, jobs: int = 2, log=sys.stderr) -> dict[str, str]:
    """Mainline's ``targets`` built into the cache (``build_peer`` for ``LLAMA_CPP``)."""
    return build_peer(LLAMA_CPP, targets, jobs=jobs, log=log)


def build_llama_server(jobs: int = 2, log=sys.stderr) -> str:
    """Build mainline's binaries and return its server's path."""
    return build_llama_cpp(BINARIES, jobs=jobs, log=log)["llama-server"]


def server_command(binary: str, gguf: str, port: int, parallel: int = 4, ctx_per_slot: int = 512,
                   peer: Peer = LLAMA_CPP) -> list[str]:
    """``llama-server`` of ``peer`` on ``gguf`` at 127.0.0.1:``port``: ``parallel`` slots of
    ``ctx_per_slot`` tokens each (``-c`` is their sum), no web UI."""
    webui = ["--webui", "none"] if peer is IK_LLAMA_CPP else ["--no-webui"]
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-c", str(ctx_per_slot * parallel),
            "-np", str(parallel), *webui]


def quantize(binary: str, src: str | Path, dst: str | Path, qtype: str = "Q4_1", threads: int = 2,
             log=sys.stderr) -> Path:
    """``llama-quantize src dst qtype``: llama.cpp's own quantizer."""
    result = subprocess.run([binary, str(src), str(dst), qtype, str(threads)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"llama-quantize failed ({result.returncode}):\n{result.stderr[-4000:]}")
    if log is not None:
        print(result.stdout[-1000:], file=log)
    return Path(dst)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m folio.testing.llamacpp", description="build the CPU peers' binaries")
    p.add_argument("jobs", nargs="?", type=int, default=2, help="parallel compile jobs")
    p.add_argument("--peer", choices=[*PEERS, "all"], default="llama.cpp")
    args = p.parse_args(argv)
    for peer in PEERS.values() if args.peer == "all" else [PEERS[args.peer]]:
        print(peer.name, build_peer(peer, jobs=args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
