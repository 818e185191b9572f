"""The sampler's uniforms on the GPU (cuda/sampler.cu, ``folio::philox_uniforms``): compiled for
sm_80/sm_90 without spills, and run in the CPU emulation bit for bit against the torch reference
(folio/core/executor/sampling/philox.py) and the CPU sampler kernel's own Philox, marshalled by the
loader's ``philox_launch`` as a GPU launch is. The ``gpu`` test runs the same on a GPU."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from folio.core.executor.kernels import cpu_kernels
from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.sampling.philox import uniforms
from tests.cuda.emu_runtime import EmulatedLauncher, build_unit_library, compile_problems


@pytest.fixture(scope="module")
def launcher() -> EmulatedLauncher:
    return EmulatedLauncher(build_unit_library("sampler", [ck.PHILOX_UNIFORMS_NAME], ("common.cuh",)))


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
    problems = compile_problems(ck.source_of(ck.SAMPLER_FILE), "sampler.cu", [ck.PHILOX_UNIFORMS_NAME], arch)
    assert not problems, f"sm_{arch}:\n" + "\n".join(problems)


@pytest.mark.gpu
def test_gpu_kernel_equals_torch_bit_for_bit():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    pytest.importorskip("cupy")
    seeds, positions = keys(1000, 3)
    got = ck.philox_uniforms(seeds.cuda(), positions.cuda(), 2, 4)
    assert got is not None and torch.equal(got.cpu(), uniforms(seeds, positions, 2, 4))
