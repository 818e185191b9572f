"""Builds the CPU emulation of folio's kernels and launches it like the CuPy launcher does.

The shared library is g++'s build of the very sources NVRTC compiles (cuda/*.cu) with
cuda/emulation/cuda_emu.h forced in first. It is built once and cached under the system temp dir,
keyed by a hash of the sources, the instance list and the flags. ``EmulatedLauncher`` plugs into
``KernelAttentionBackend`` in place of the CuPy launcher, so tests run the real backend code on
CPU tensors.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from folio.core.executor.kernels import cuda_kernels as ck

EMU_DIR = ck.KERNEL_DIR / "emulation"
CXX_FLAGS = ["-std=c++20", "-O2", "-shared", "-fPIC", "-pthread", "-DFOLIO_EMULATION=1"]

_CTYPES = {np.uint64: ctypes.c_uint64, np.int64: ctypes.c_int64, np.int32: ctypes.c_int32, np.float32: ctypes.c_float}


def emulated_instances() -> list[str]:
    """Every instance the loader can ask for: the emulation covers exactly what NVRTC builds."""
    return [name for names in ck.all_name_expressions().values() for name in names]


def _sources() -> list[Path]:
    return sorted(ck.KERNEL_DIR.glob("*.cu")) + sorted(ck.KERNEL_DIR.glob("*.cuh")) + sorted(EMU_DIR.glob("*"))


def build_library(instances: list[str] | None = None) -> Path:
    instances = instances or emulated_instances()
    digest = hashlib.sha256()
    for path in _sources():
        digest.update(path.name.encode() + path.read_bytes())
    digest.update("\n".join(instances + CXX_FLAGS).encode())

    def inputs(out_dir: Path) -> Path:
        (out_dir / "emu_instances.inc").write_text("".join(f"FOLIO_EMU_REGISTER({name})\n" for name in instances))
        return EMU_DIR / "emu_entry.cpp"

    return _build_cached(digest.hexdigest()[:16], "libfolio_emu.so", inputs)


_UNIT_ENTRY = """#include "{unit}.cu"
{registrations}
extern "C" int folio_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                unsigned by, unsigned bz, void** params, unsigned long long first_block,
                                unsigned long long num_blocks) {{
  auto it = emu::registry().find(name);
  if (it == emu::registry().end()) return 1;
  it->second(dim3{{gx, gy, gz}}, dim3{{bx, by, bz}}, params, first_block, num_blocks);
  return 0;
}}
"""


def build_unit_library(unit: str, names: list[str], headers: tuple[str, ...] = ()) -> Path:
    """g++'s build of one kernel file, cuda/<unit>.cu, after cuda_emu.h, each of ``names`` registered
    under its name expression; cached like ``build_library``, by a hash of the file, ``headers``
    (the cuda/ headers it includes), the names and the flags."""
    entry = _UNIT_ENTRY.format(unit=unit, registrations="".join(f"FOLIO_EMU_REGISTER({n})\n" for n in names))
    digest = hashlib.sha256(entry.encode() + " ".join(CXX_FLAGS).encode())
    for path in [ck.KERNEL_DIR / f"{unit}.cu", *(ck.KERNEL_DIR / h for h in headers), EMU_DIR / "cuda_emu.h"]:
        digest.update(path.read_bytes())

    def inputs(out_dir: Path) -> Path:
        source = out_dir / f"emu_{unit}.cpp"
        source.write_text(entry)
        return source

    return _build_cached(f"{unit}-{digest.hexdigest()[:16]}", f"libfolio_{unit}_emu.so", inputs)


def _build_cached(key: str, lib_name: str, inputs) -> Path:
    """The library ``lib_name`` under the temp dir's ``folio-cuda-emu/<key>``, built once: ``inputs(out_dir)``
    writes what the build needs there and returns the file g++ compiles (after cuda_emu.h, with
    cuda/ and ``out_dir`` on the include path)."""
    out_dir = Path(tempfile.gettempdir()) / "folio-cuda-emu" / key
    lib = out_dir / lib_name
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    entry = inputs(out_dir)
    tmp = out_dir / f"{lib.stem}.{os.getpid()}.so"
    cmd = ["g++", *CXX_FLAGS, "-include", str(EMU_DIR / "cuda_emu.h"), f"-I{ck.KERNEL_DIR}", f"-I{out_dir}",
           str(entry), "-o", str(tmp)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"emulation build failed:\n{' '.join(cmd)}\n{result.stderr[-6000:]}")
    tmp.rename(lib)  # atomic: a concurrent test run sees either nothing or a whole library
    return lib


def compile_problems(source: str, filename: str, names: list[str], arch: str) -> list[str]:
    """NVRTC's build of ``source`` for sm_``arch`` with ``names`` instantiated: each instance that
    spills or passes the register or static shared memory limits, and every warning (empty: clean).
    Skips the test when CuPy's NVRTC bindings are missing."""
    import pytest

    compiler = pytest.importorskip("cupy.cuda.compiler", reason="CuPy (with its NVRTC bindings) is not installed")
    from tests.cuda.test_compile import MAX_REGISTERS, MAX_STATIC_SMEM, ptxas_report

    program = compiler._NVRTCProgram(source, filename, name_expressions=names, method="cubin")
    log = io.StringIO()
    _, mapping = program.compile(ck.cupy_nvrtc_options(arch) + ("-Xptxas=-v",), log)
    problems = [] if sorted(mapping) == sorted(names) else [f"instances {sorted(mapping)} != {sorted(names)}"]
    report = ptxas_report(log.getvalue())
    for name, lowered in mapping.items():
        r = report[lowered]
        if r["spill_stores"] or r["spill_loads"] or r["registers"] > MAX_REGISTERS or r["smem"] > MAX_STATIC_SMEM:
            problems.append(f"{name}: {r}")
    return problems + [line for line in log.getvalue().splitlines() if "warning" in line.lower()]


class EmulatedLauncher:
    """The launcher interface of ``KernelAttentionBackend``, backed by the emulation library."""

    num_sms = 4  # small, so that the automatic split choice is exercised on small shapes

    def __init__(self, lib_path: Path):
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.folio_emu_launch.restype = ctypes.c_int
        self.launches: list[tuple[str, tuple, tuple]] = []  # (name, grid, block), for assertions
        # run only the last N blocks of each launch (None: all); for grids too large to emulate whole
        self.last_blocks: int | None = None

    def launch(self, names, kernel: str, grid, block, args, device=None) -> None:
        name = getattr(names, kernel)
        check_launch_limits(name, grid, block)
        values = [_CTYPES[type(a)](a) for a in args]
        params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        self.launches.append((name, tuple(grid), tuple(block)))
        total = int(np.prod(grid))
        first = 0 if self.last_blocks is None else max(0, total - self.last_blocks)
        rc = self.lib.folio_emu_launch(name.encode(), *map(ctypes.c_uint, (*grid, *block)), params,
                                       ctypes.c_ulonglong(first), ctypes.c_ulonglong(total - first))
        if rc != 0:
            raise ck.UnsupportedKernelError(f"the emulation library has no instance {name}")



# What a real launch would refuse (cudaErrorInvalidConfiguration), checked before emulating it.
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK = (1024, 1024, 64)
MAX_THREADS = 1024


def check_launch_limits(name: str, grid, block) -> None:
    if any(not 1 <= g <= m for g, m in zip(grid, MAX_GRID)) or any(not 1 <= b <= m for b, m in zip(block, MAX_BLOCK)) \
            or int(np.prod(block)) > MAX_THREADS:
        raise ValueError(f"launch of {name} with grid {tuple(grid)} and block {tuple(block)} exceeds CUDA's limits")


def run_probe(lib_path: Path, name: str, arrays: list[np.ndarray], threads: int) -> None:
    """Launches one block of an emulation-only probe kernel (cuda/emulation/emu_probes.cuh) whose
    parameters are the given arrays' addresses."""
    lib = ctypes.CDLL(str(lib_path))
    args = [ctypes.c_uint64(a.ctypes.data) for a in arrays]
    params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
    rc = lib.folio_emu_launch(name.encode(), 1, 1, 1, threads, 1, 1, params, ctypes.c_ulonglong(0),
                              ctypes.c_ulonglong(1))
    if rc != 0:
        raise ck.UnsupportedKernelError(f"the emulation library has no probe {name}")
