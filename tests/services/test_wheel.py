"""The wheel carries the kernels and the benchmarks: built from the checkout's files and installed
into a fresh folder, folio compiles its CUDA kernels (NVRTC, through CuPy; no GPU needed) and its CPU
C kernels from the installed package, and ``folio bench`` runs a benchmark from a folder outside the
checkout, with nothing read from the checkout.

The wheel is built from a copy of the checkout's files (what a fresh clone holds), not in place: an
in-place build reuses ``build/`` and ``folio.egg-info/SOURCES.txt`` from earlier builds, which still
list the kernel sources, so a dropped package-data line would go unnoticed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# run from outside the checkout, with only the installed folder added to the path (the venv still
# provides torch, CuPy and NVRTC); it reports where each part was loaded from
PROBE = r"""
import json, sys
from pathlib import Path

import folio
from folio.core.executor.kernels import cpu_kernels, cuda_kernels as ck
from cupy.cuda import compiler

module = "cache"
names = ck.all_name_expressions()[module]
program = compiler._NVRTCProgram(ck.module_source(module), f"{module}.cu", name_expressions=names, method="cubin")
cubin, mapping = program.compile(ck.cupy_nvrtc_options("80"))
lib = cpu_kernels.library()
print(json.dumps({
    "folio": folio.__file__,
    "kernel_dir": str(ck.KERNEL_DIR),
    "csrc": str(cpu_kernels.CSRC),
    "names": sorted(names),
    "lowered": sorted(mapping),
    "cubin_bytes": len(cubin),
    "cpu_library": getattr(lib, "_name", None),
}))
"""


def _tracked(*folders: str) -> list[str]:
    return subprocess.run(["git", "ls-files", *folders], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the wheel, the folder it is installed into)"""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    for name in files:
        if (ROOT / name).is_file():  # a tracked file deleted in the working tree is left out
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(src)], check=True, timeout=600, stdout=subprocess.DEVNULL)
    (wheel,) = dist.glob("folio-*.whl")
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target",
                    str(site), str(wheel)], check=True, timeout=600, stdout=subprocess.DEVNULL)
    return wheel, site


@pytest.mark.parametrize("folder, installed_as", [("cuda", "folio/cuda"),
                                                  ("folio/core/executor/kernels/csrc",
                                                   "folio/core/executor/kernels/csrc")])
def test_every_kernel_source_is_in_the_wheel(installed, folder, installed_as):
    wheel, site = installed
    tracked = _tracked(folder)
    assert tracked, folder
    expected = sorted(installed_as + name[len(folder):] for name in tracked)
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = sorted(n for n in zf.namelist() if n.startswith(installed_as + "/") and "__pycache__" not in n)
    assert in_wheel == expected
    missing = [name for name in expected if not (site / name).is_file()]
    assert missing == [], missing


@pytest.mark.slow  # about 8 s: a compiler run
def test_installed_package_compiles_its_kernels(installed, tmp_path):
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("CuPy (the test extras' NVRTC wrapper) is not installed")
    _, site = installed
    cache = tmp_path / "cache"  # empty: the CPU kernels are compiled now, not found from an earlier run
    env = {**os.environ, "PYTHONPATH": str(site), "FOLIO_CACHE_DIR": str(cache),
           "CUPY_CACHE_DIR": str(tmp_path / "cupy")}
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    # the code and the kernel sources are the installed ones, not the checkout's
    assert Path(out["folio"]).is_relative_to(site), out
    assert Path(out["kernel_dir"]) == site / "folio" / "cuda", out
    assert Path(out["csrc"]) == site / "folio" / "core" / "executor" / "kernels" / "csrc", out
    # NVRTC compiled every instance of the module to a cubin
    assert out["lowered"] == out["names"] and out["names"], out
    assert out["cubin_bytes"] > 0, out
    # and the C compiler built the CPU kernels into the (fresh) cache folder
    assert out["cpu_library"] is not None, proc.stderr[-4000:]
    assert Path(out["cpu_library"]).parent == cache / "cpu-kernels", out


@pytest.mark.slow  # over 8 s: the full suite only
def test_installed_folio_bench_runs_outside_the_checkout(installed, tmp_path):
    _, site = installed
    env = {**os.environ, "PYTHONPATH": str(site), "FOLIO_CACHE_DIR": str(tmp_path / "cache")}
    folio = [sys.executable, str(site / "bin" / "folio"), "bench"]

    def run(*argv: str) -> str:
        proc = subprocess.run([*folio, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    listed = [line.split()[0] for line in run("list").splitlines() if line.strip()]
    assert {"serve", "step", "serving", "eval_quant"} <= set(listed), listed
    assert "usage: folio bench step" in run("step", "--help")
    # one tiny real run: the executor's cost per step on a null model, its figures in the summary
    out = run("step", "--steps", "2", "--repeats", "1", "--save-result", str(tmp_path / "step.json"))
    assert "================ folio bench step ================" in out, out
    saved = json.loads((tmp_path / "step.json").read_text())
    assert saved["exit_status"] == 0 and saved["figures"]["host ms/step at B=256"] > 0, saved
    where = subprocess.run([sys.executable, "-c", "import folio.bench.step as m; print(m.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    assert Path(where).is_relative_to(site), where


def test_checkout_cuda_folder_does_not_hide_nvidias_cuda_package():
    """Run from the checkout root, ``cuda`` resolves to the repository's cuda/ folder; CuPy must
    still find NVIDIA's ``cuda.pathfinder`` beside it (else every CuPy test skips)."""
    if importlib.util.find_spec("cupy") is None:  # found without importing it (importing is what is tested)
        pytest.skip("CuPy is not installed")
    probe = "import cuda, cupy.cuda.compiler; print(*cuda.__path__, sep='\\n')"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(ROOT / "cuda") in proc.stdout.splitlines(), proc.stdout
