"""The GPU benchmarks of folio/bench run on the CPU against the CUDA emulation, for
``scripts/gpu_check.sh --dry-run``: the benchmark's own code (arguments, shapes, timing, its JSON)
with the emulated kernels in place of CuPy's. Small shapes: a check that each runs, not a figure.

    python -m tests.cuda.emulated_bench kernels|quant [the benchmark's flags]
"""

from __future__ import annotations

import sys

from tests.cuda.emu_runtime import EmulatedLauncher, build_library


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("kernels", "quant"):
        sys.exit("usage: python -m tests.cuda.emulated_bench kernels|quant [flags]")
    which, flags = argv[0], ["--device", "cpu", *argv[1:]]
    launcher = EmulatedLauncher(build_library())
    if which == "kernels":
        from folio.bench import kernels
        from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend

        kernels.main(flags, backend=KernelAttentionBackend(launcher, kernels.DTYPE))
    else:
        from folio.bench import quant_gpu

        quant_gpu.main(flags, launcher=launcher)


if __name__ == "__main__":
    main(sys.argv[1:])
