"""Every kernel instance the loader can ask for compiles for sm_80 and sm_90, as CuPy compiles it.

NVRTC comes from pip (``nvidia-cuda-nvrtc``), driven through CuPy's own NVRTC program wrapper with
the option list CuPy's RawModule uses (``cuda_kernels.cupy_nvrtc_options``), plus ``-Xptxas=-v``
so that ptxas reports each function's registers, spills and shared memory. A compile error, any
spill, more than 255 registers or more static shared memory than a block may have fails.
No GPU is needed: only ``cupy.RawModule``'s *load* needs one, and that is not done here.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

from folio.core.executor.kernels import cuda_kernels as ck

pytestmark = pytest.mark.slow  # 22 NVRTC compiles: about a minute on two cores

compiler = pytest.importorskip("cupy.cuda.compiler", reason="CuPy (with its NVRTC bindings) is not installed")

ARCHS = ("80", "90")
MAX_STATIC_SMEM = 48 * 1024  # the static __shared__ limit of every architecture we target
MAX_REGISTERS = 255

_FUNCTION = re.compile(r"Compiling entry function '(\w+)' for 'sm_(\d+)'")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_module(module: str, arch: str) -> tuple[dict[str, str], str]:
    names = ck.all_name_expressions()[module]
    program = compiler._NVRTCProgram(ck.module_source(module), f"{module}.cu", name_expressions=names, method="cubin")
    log = io.StringIO()
    _, mapping = program.compile(ck.cupy_nvrtc_options(arch) + ("-Xptxas=-v",), log)
    return mapping, log.getvalue()


def ptxas_report(log: str) -> dict[str, dict[str, int]]:
    """{mangled function: {registers, smem, spill_stores, spill_loads}} from ptxas -v output."""
    report: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if m := _FUNCTION.search(line):
            current = report.setdefault(m.group(1), {"registers": 0, "smem": 0, "spill_stores": 0, "spill_loads": 0})
        elif current is not None and (m := _SPILL.search(line)):
            current["spill_stores"], current["spill_loads"] = int(m.group(1)), int(m.group(2))
        elif current is not None and "Used" in line:
            current["registers"] = int(re.search(r"Used (\d+) registers", line).group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            current["smem"] = int(smem.group(1)) if smem else 0
    return report


PAIRS = [(m, a) for m in ck.MODULE_FILES for a in ARCHS]


@pytest.fixture(scope="module")
def compiles():
    """Every (module, arch) compile started at once on every core: NVRTC is single-threaded and the
    compiles are independent, so this takes the longest few instead of their sum."""
    workers = min(len(PAIRS), os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pair: pool.submit(compile_module, *pair) for pair in PAIRS}
        yield futures


@pytest.fixture(scope="module", params=PAIRS, ids=lambda p: f"{p[0]}-sm{p[1]}")
def compiled(request, compiles):
    module, arch = request.param
    mapping, log = compiles[(module, arch)].result()
    return module, arch, mapping, log


def test_every_instance_compiles(compiled):
    module, arch, mapping, log = compiled
    assert sorted(mapping) == sorted(ck.all_name_expressions()[module])
    report = ptxas_report(log)
    missing = [name for name, lowered in mapping.items() if lowered not in report]
    assert not missing, f"ptxas reported nothing for {missing}:\n{log[-3000:]}"


def test_no_spills_registers_or_shared_memory_over_limits(compiled):
    module, arch, mapping, log = compiled
    report = ptxas_report(log)
    problems = []
    for name, lowered in mapping.items():
        r = report[lowered]
        if r["spill_stores"] or r["spill_loads"]:
            problems.append(f"{name}: spills {r['spill_stores']} B stores / {r['spill_loads']} B loads")
        if r["registers"] > MAX_REGISTERS:
            problems.append(f"{name}: {r['registers']} registers")
        if r["smem"] > MAX_STATIC_SMEM:
            problems.append(f"{name}: {r['smem']} B of shared memory")
    assert not problems, f"sm_{arch}:\n" + "\n".join(problems)


def test_no_compiler_warnings(compiled):
    *_, log = compiled
    warnings = [line for line in log.splitlines() if "warning" in line.lower()]
    assert not warnings, "\n".join(warnings)


def test_python_constants_match_the_kernel_sources():
    source = ck.module_source("attention")
    for name, value in (("ATTN_WARPS", ck.ATTN_THREADS // 32), ("ATTN_ROWS", ck.ATTN_ROWS)):
        assert re.search(rf"constexpr int {name} = {value};", source), name
    for kernel, threads in (("paged_attention_reduce", ck.REDUCE_THREADS),):
        assert f"__launch_bounds__({threads}) {kernel}(" in source
    decode = ck.module_source("decode")
    for name, value in (("DECODE_THREADS", ck.DECODE_THREADS), ("DECODE_MAX_GROUP", ck.DECODE_MAX_GROUP)):
        assert re.search(rf"constexpr int {name} = {value};", decode), name
    prefill = ck.module_source("prefill")
    for name, value in (("PREFILL_THREADS", ck.PREFILL_THREADS), ("PREFILL_ROWS", ck.PREFILL_ROWS)):
        assert re.search(rf"constexpr int {name} = {value};", prefill), name
    cache = ck.module_source("cache")
    assert f"__launch_bounds__({ck.WRITE_THREADS}) write_kv(" in cache
    assert f"__launch_bounds__({ck.COPY_THREADS}) copy_blocks(" in cache
    fused = ck.module_source("fused")
    for name, value in (("NORM_THREADS", ck.NORM_THREADS), ("ACT_THREADS", ck.ACT_THREADS),
                        ("ROPE_THREADS", ck.ROPE_THREADS)):
        assert re.search(rf"constexpr int {name} = {value};", fused), name
    quant = ck.module_source("quant")
    for name in ("GEMV_THREADS", "GEMV_ROWS", "GEMV_COLS", "GEMV_K", "GEMM_THREADS", "GEMM_BM", "GEMM_BN", "GEMM_BK"):
        assert re.search(rf"constexpr int {name} = {getattr(ck, name)};", quant), name


def test_sources_are_self_contained():
    """Headers are inlined (CuPy's disk cache is keyed by source text) and no CUDA header is
    needed (pip's NVRTC has no include path)."""
    for module in ck.MODULE_FILES:
        source = ck.module_source(module)
        assert '#include "' not in source
        assert "#include <" not in source
