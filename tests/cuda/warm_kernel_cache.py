"""Compiles every kernel module the GPU code can ask for, one process per core, into CuPy's on-disk
cache (scripts/gpu_check.sh's compile stage): the tests and benchmarks after it load each module from
disk instead of compiling them one after another (test_gpu.py alone asks for about a hundred).

A module is one NVRTC compile of a file with a set of name expressions, and CuPy's cache is keyed by
the source, the options and that set; ``compile_units`` forms the sets as the loaders do
(``cuda_kernels.compiled_kernel`` per configuration, the MoE, LoRA and sampler launchers). A unit
that fails to compile is a finding; one this list misses only costs its compile later.

    python -m tests.cuda.warm_kernel_cache [--seconds S] [--json FILE]      # on the GPU
    python -m tests.cuda.warm_kernel_cache --arch 90 --files sampler.cu [--json FILE]  # no device: NVRTC only
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from types import SimpleNamespace

from folio.core.executor.kernels import cuda_kernels as ck  # light: the workers import no torch


def _module_sets(names) -> set[tuple[str, tuple[str, ...]]]:
    """The (file, names) compiles ``compiled_kernel`` makes for one configuration's ``names``."""
    wanted = [n for n in vars(names).values() if n]
    return {(ck.MODULE_FILES[module], tuple(sorted({n for n in wanted if ck.module_of(n) == module})))
            for module in {ck.module_of(n) for n in wanted}}


def compile_units() -> list[tuple[str, tuple[str, ...]]]:
    from folio.core.executor.kernels import lora_kernels, moe_kernels

    units: set[tuple[str, tuple[str, ...]]] = set()
    for dtype in ck.DTYPES:
        for head in ck.HEAD_SIZES:
            for block in ck.BLOCK_SIZES:
                units |= _module_sets(ck.kernel_names(dtype, head, block))
                if dtype in ck.FP8_ACTIVATION_DTYPES:
                    units |= _module_sets(ck.kernel_names(dtype, head, block, fp8=True))
        units |= _module_sets(ck.fused_names(dtype)) | _module_sets(ck.quant_names(dtype))
        if dtype in ck.FP8_ACTIVATION_DTYPES:
            units |= _module_sets(SimpleNamespace(rope_write_kv=ck.rope_write_kv_fp8_name(dtype)))
        if dtype in ck.DGEMM_DTYPES:
            units |= _module_sets(ck.gemm_names(dtype))
        if dtype in moe_kernels.MOE_DTYPES:
            units.add((moe_kernels.SOURCE, tuple(sorted(vars(moe_kernels.moe_names(dtype)).values()))))
    units.add((lora_kernels.SOURCE, tuple(sorted(lora_kernels.all_name_expressions()))))
    units.add((ck.SAMPLER_FILE, (ck.PHILOX_UNIFORMS_NAME,)))
    # the fp8-pool instances last (few tests use them); the prefill (tensor-core) modules first: the
    # longest compiles, started while the pool is empty
    return sorted(units, key=lambda u: (any("fp8" in n for n in u[1]), u[0] != ck.MODULE_FILES["prefill"], u))


def _compile(job: tuple[tuple[str, tuple[str, ...]], str | None]) -> tuple[tuple[str, tuple[str, ...]], str | None]:
    """(the unit, None or its compile error), in a worker process."""
    unit, arch = job
    filename, names = unit
    try:
        if arch is None:  # on the device: CuPy compiles for it and writes its disk cache
            ck.raw_module(filename, names, 0)
        else:  # no device: NVRTC alone, for sm_<arch>, with the options CuPy would pass
            from cupy.cuda import compiler

            program = compiler._NVRTCProgram(ck.source_of(filename), filename, name_expressions=list(names),
                                             method="cubin")
            program.compile(ck.cupy_nvrtc_options(arch))
    except Exception as exc:  # noqa: BLE001  (a compile error is what this reports)
        return unit, str(exc)[-2000:]
    return unit, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--arch", default=None, help="compile for sm_ARCH with NVRTC alone (no device, no cache)")
    parser.add_argument("--files", nargs="+", default=None, help="only the units of these kernel files")
    parser.add_argument("--units", type=int, default=None, help="only the first N units")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--seconds", type=float, default=None,
                        help="stop after this long: the units not compiled yet compile when first used")
    args = parser.parse_args(argv)
    units = [u for u in compile_units() if args.files is None or u[0] in args.files][: args.units]
    figures = {"units": len(units), "compiled": 0, "failed": [], "left": len(units), "seconds": 0.0,
               "arch": args.arch or "device"}

    def save() -> None:  # after every unit: a stage cut short keeps the count
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=1)

    print(f"compiling {len(units)} kernel modules on {args.workers} processes", flush=True)
    start = time.perf_counter()
    deadline = start + args.seconds if args.seconds else float("inf")
    # spawn: no CUDA state shared with a forked child; leaving the block terminates what still runs
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        results = pool.imap_unordered(_compile, [(unit, args.arch) for unit in units])
        while figures["left"]:
            try:
                (filename, names), error = results.next(timeout=max(0.1, deadline - time.perf_counter()))
            except multiprocessing.TimeoutError:
                print(f"stopped after {args.seconds:g} s; the {figures['left']} modules left compile when first used",
                      flush=True)
                break
            figures["left"] -= 1
            if error is None:
                figures["compiled"] += 1
            else:
                figures["failed"].append({"file": filename, "names": names, "error": error})
                print(f"FAIL: {filename} {names}: {error}", flush=True)
            figures["seconds"] = round(time.perf_counter() - start, 1)
            save()
    figures["seconds"] = round(time.perf_counter() - start, 1)
    save()
    print(f"{figures['compiled']} of {len(units)} compiled in {figures['seconds']} s", flush=True)
    return 1 if figures["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
