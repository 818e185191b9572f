"""llama.cpp's own tools for comparisons and test oracles: its sources, its converter, its binaries.

More in docs/modules.md (folio/testing/llamacpp.py).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from contextlib import contextmanager
from pathlib import Path

from folio.shared.config import cache_dir

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # whose sdist vendors the llama.cpp used here
BINARIES = ("llama-server", "llama-quantize")


def _root() -> Path:
    return cache_dir() / "llama.cpp"


@contextmanager
def _locked(name: str):
    """An exclusive lock file under the cache, so two processes never download or build at once."""
    _root().mkdir(parents=True, exist_ok=True)
    with open(_root() / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def llamacpp_source(log=sys.stderr) -> Path:
    """The vendored llama.cpp source folder of the pinned sdist, downloaded and extracted once."""
    extracted = _root() / "src" / LLAMA_CPP_PYTHON.replace("==", "-")
    source = extracted / "vendor" / "llama.cpp"
    if (extracted / ".complete").is_file():
        return source
    with _locked("source"):
        if (extracted / ".complete").is_file():
            return source
        extracted.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="folio-llama-", dir=extracted.parent) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            "-d", tmp, LLAMA_CPP_PYTHON], check=True, stdout=log, stderr=log)
            (sdist,) = Path(tmp).glob("*.tar.gz")
            with tarfile.open(sdist) as tar:
                tar.extractall(Path(tmp) / "x", filter="data")
            (top,) = (Path(tmp) / "x").iterdir()
            if extracted.exists():
                shutil.rmtree(extracted)
            top.rename(extracted)
        (extracted / ".complete").touch()
    return source


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


def built_path(name: str = "llama-server") -> Path:
    return _root() / name


def _find(name: str, env_var: str) -> str | None:
    explicit = os.environ.get(env_var)
    if explicit:
        return explicit
    on_path = shutil.which(name)
    if on_path:
        return on_path
    built = built_path(name)
    return str(built) if built.is_file() and os.access(built, os.X_OK) else None


def find_llama_server() -> str | None:
    return _find("llama-server", "FOLIO_LLAMA_SERVER")


def find_llama_quantize() -> str | None:
    return _find("llama-quantize", "FOLIO_LLAMA_QUANTIZE")


def build_llama_cpp(targets: tuple[str, ...] = BINARIES, jobs: int = 2, log=sys.stderr) -> dict[str, str]:
    """Build ``targets`` into the cache folder and return their paths (raises on failure).

    The CMake build folder stays in the cache, so building one more target later is incremental.
    """
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        raise RuntimeError("building llama.cpp needs cmake and a C++ compiler")
    source = llamacpp_source(log)
    build = _root() / "build"
    with _locked("build"):
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
                        "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                        "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON"],
                       check=True, stdout=log, stderr=log)
        subprocess.run(["cmake", "--build", str(build), "--target", *targets, "-j", str(jobs)],
                       check=True, stdout=log, stderr=log)
        paths = {}
        for name in targets:
            (binary,) = build.glob(f"bin/{name}")
            target = built_path(name)
            shutil.copy2(binary, target.with_suffix(".tmp"))
            os.replace(target.with_suffix(".tmp"), target)
            paths[name] = str(target)
    return paths


def build_llama_server(jobs: int = 2, log=sys.stderr) -> str:
    """Build ``llama-server`` (and ``llama-quantize`` beside it) and return the server's path."""
    return build_llama_cpp(BINARIES, jobs=jobs, log=log)["llama-server"]


def server_command(binary: str, gguf: str, port: int, parallel: int = 4) -> list[str]:
    """``llama-server`` on ``gguf`` at 127.0.0.1:``port`` with ``parallel`` slots."""
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-c", str(512 * parallel),
            "-np", str(parallel), "--no-webui"]


def quantize(binary: str, src: str | Path, dst: str | Path, qtype: str = "Q4_1", threads: int = 2,
             log=sys.stderr) -> Path:
    """``llama-quantize src dst qtype``: llama.cpp's own quantizer."""
    result = subprocess.run([binary, str(src), str(dst), qtype, str(threads)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"llama-quantize failed ({result.returncode}):\n{result.stderr[-4000:]}")
    if log is not None:
        print(result.stdout[-1000:], file=log)
    return Path(dst)


if __name__ == "__main__":
    print(build_llama_cpp(jobs=int(sys.argv[1]) if len(sys.argv) > 1 else 2))
