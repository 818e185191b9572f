"""The sampler's uniforms on the GPU (cuda/sampler.cu, ``folio::philox_uniforms``): compiled for
sm_80/sm_90 without spills, and run in the CPU emulation bit for bit against the torch reference
(folio/core/executor/sampling/philox.py) and the CPU sampler kernel's own Philox, marshalled by the
loader's ``philox_launch`` as a GPU launch is. The ``gpu`` test runs the same on a GPU."""

from __future__ import annotations

import hashlib
import io
import re
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from folio.core.executor.kernels import cpu_kernels
from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.sampling.philox import uniforms
from tests.cuda.emu_runtime import CXX_FLAGS, EMU_DIR, EmulatedLauncher

ENTRY = """#include "sampler.cu"
FOLIO_EMU_REGISTER(folio::philox_uniforms)
extern "C" int folio_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                unsigned by, unsigned bz, void** params, unsigned long long first_block,
                                unsigned long long num_blocks) {
  auto it = emu::registry().find(name);
  if (it == emu::registry().end()) return 1;
  it->second(dim3{gx, gy, gz}, dim3{bx, by, bz}, params, first_block, num_blocks);
  return 0;
}
"""


def build_sampler_library() -> Path:
    digest = hashlib.sha256(ENTRY.encode() + " ".join(CXX_FLAGS).encode())
    for path in (ck.KERNEL_DIR / "sampler.cu", ck.KERNEL_DIR / "common.cuh", EMU_DIR / "cuda_emu.h"):
        digest.update(path.read_bytes())
    out_dir = Path(tempfile.gettempdir()) / "folio-cuda-emu" / f"sampler-{digest.hexdigest()[:16]}"
    lib = out_dir / "libfolio_sampler_emu.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    source = out_dir / "emu_sampler.cpp"
    source.write_text(ENTRY)
    tmp = out_dir / f"lib.{id(source)}.so"
    cmd = ["g++", *CXX_FLAGS, "-include", str(EMU_DIR / "cuda_emu.h"), f"-I{ck.KERNEL_DIR}", str(source), "-o", str(tmp)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"emulation build failed:\n{' '.join(cmd)}\n{result.stderr[-6000:]}")
    tmp.rename(lib)
    return lib


@pytest.fixture(scope="module")
def launcher() -> EmulatedLauncher:
    return EmulatedLauncher(build_sampler_library())


def keys(n: int, seed: int):
    rng = np.random.default_rng(seed)
    seeds = rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64)
    seeds[:4] = [0, 1, -1, 2**63 - 1][:n]  # the key words' extremes
    positions = rng.integers(0, 2**40, n, dtype=np.int64)
    positions[:4] = [0, 2**32 - 1, 2**32, 7][:n]  # across the counter's word boundary
    return torch.from_numpy(seeds), torch.from_numpy(positions)


@pytest.mark.parametrize("n,first,count", [(1, 0, 1), (37, 0, 2), (300, 5, 3)])
def test_emulated_kernel_equals_torch_and_the_cpu_kernel_bit_for_bit(launcher, n, first, count):
    seeds, positions = keys(n, n)
    out = torch.full((n, count), -1.0, dtype=torch.float64)
    grid, block, args = ck.philox_launch(seeds, positions, out, first, count)
    launcher.launch(SimpleNamespace(philox=ck.PHILOX_UNIFORMS_NAME), "philox", grid, block, args)
    want = uniforms(seeds, positions, first, count)
    assert torch.equal(out, want)  # every element written (none left at -1), bit for bit
    assert torch.equal(torch.from_numpy(cpu_kernels.philox_uniforms(seeds.numpy(), positions.numpy(), first, count)),
                       want)
    assert ((want > 0) & (want <= 1)).all()


def test_python_constants_match_the_kernel_source():
    source = ck.source_of(ck.SAMPLER_FILE)
    assert '#include "' not in source
    assert re.search(rf"constexpr int PHILOX_THREADS = {ck.PHILOX_THREADS};", source)
    assert "philox_uniforms(" in source


ARCHS = ("80", "90")


@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_without_spills(arch):
    compiler = pytest.importorskip("cupy.cuda.compiler", reason="CuPy (with its NVRTC bindings) is not installed")
    from tests.cuda.test_compile import MAX_REGISTERS, MAX_STATIC_SMEM, ptxas_report

    names = [ck.PHILOX_UNIFORMS_NAME]
    program = compiler._NVRTCProgram(ck.source_of(ck.SAMPLER_FILE), "sampler.cu", name_expressions=names,
                                     method="cubin")
    log = io.StringIO()
    _, mapping = program.compile(ck.cupy_nvrtc_options(arch) + ("-Xptxas=-v",), log)
    assert sorted(mapping) == names
    report = ptxas_report(log.getvalue())
    r = report[mapping[ck.PHILOX_UNIFORMS_NAME]]
    assert not (r["spill_stores"] or r["spill_loads"] or r["registers"] > MAX_REGISTERS
                or r["smem"] > MAX_STATIC_SMEM), r
    assert not [line for line in log.getvalue().splitlines() if "warning" in line.lower()]


@pytest.mark.gpu
def test_gpu_kernel_equals_torch_bit_for_bit():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    pytest.importorskip("cupy")
    seeds, positions = keys(1000, 3)
    got = ck.philox_uniforms(seeds.cuda(), positions.cuda(), 2, 4)
    assert got is not None and torch.equal(got.cpu(), uniforms(seeds, positions, 2, 4))
