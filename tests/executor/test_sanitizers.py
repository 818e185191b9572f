"""The sanitizer job: the C kernels' tests again, with the kernels built under AddressSanitizer and
UndefinedBehaviorSanitizer (``FOLIO_SANITIZE``), in a child process that loads the ASan runtime
first. Any report (a read or write outside a buffer, a use after free, undefined behaviour) ends
the child and fails this test, as a failing kernel test does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from folio.core.executor.kernels.toolchain import c_compiler

# the tests that run the C kernels (``cpu_kernels``: the sampler, the layer operations, the
# quantized GEMMs and the decode stack; the malformed step plans on the runner over them; tree
# drafts' rows; image rows whose windows end before their keys)
KERNEL_TESTS = ("tests/executor/test_cpu_kernels.py", "tests/executor/test_cpu_qgemm.py",
                "tests/executor/test_cpu_backend.py", "tests/executor/test_attention_features.py",
                "tests/executor/test_sampler_batched.py", "tests/executor/test_sampler_seeded.py",
                "tests/executor/test_plan_check.py", "tests/executor/test_gguf_native.py",
                "tests/executor/test_c_interface.py", "tests/executor/test_spec_tree.py",
                "tests/executor/test_attention_images.py")
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer", "SUMMARY: UndefinedBehaviorSanitizer")
ROOT = Path(__file__).resolve().parents[2]


def sanitized_env(reports: Path) -> dict[str, str]:
    """The environment of a process whose C kernels run under the sanitizers: their runtime
    preloaded (Python itself is not built with it), leaks not reported (the interpreter keeps
    memory to the end by design), the first report fatal and written to a file under ``reports``
    (pytest's capture of the child would lose it when the child aborts)."""
    compiler = c_compiler()
    if compiler is None:
        pytest.fail("the sanitizer job needs a C compiler (gcc with libasan and libubsan)")
    runtime = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(runtime) or not os.path.exists(runtime):
        pytest.fail(f"{compiler} has no AddressSanitizer runtime (libasan.so): install libasan for it")
    return {**os.environ, "FOLIO_SANITIZE": "address,undefined", "LD_PRELOAD": runtime,
            "ASAN_OPTIONS": f"detect_leaks=0:abort_on_error=1:halt_on_error=1:log_path={reports / 'asan'}",
            "UBSAN_OPTIONS": f"halt_on_error=1:print_stacktrace=1:log_path={reports / 'ubsan'}", "CI": "true"}


def run_sanitized(args: list[str], reports: Path, timeout_s: float) -> str:
    """The child's output; fails with the sanitizers' reports, if any, or its own failure."""
    run = subprocess.run([sys.executable, *args], cwd=ROOT, env=sanitized_env(reports), capture_output=True,
                         text=True, timeout=timeout_s)
    output = run.stdout + run.stderr
    written = "\n".join(f.read_text(errors="replace") for f in sorted(reports.iterdir()))
    found = [line for line in (written + output).splitlines() if any(r in line for r in REPORTS)]
    assert not found, "\n".join(found[:10]) + "\n\n" + written[:8000] + "\n" + output[-3000:]
    assert run.returncode == 0, output[-6000:]
    return run.stdout


@pytest.mark.slow
def test_the_kernel_tests_pass_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    probe = run_sanitized(["-c", "from folio.core.executor.kernels import cpu_kernels; print(cpu_kernels.library()._name)"],
                          tmp_path, timeout_s=600)
    library = Path(probe.strip().splitlines()[-1])
    assert b"__asan_init" in library.read_bytes() and b"__ubsan_handle" in library.read_bytes(), \
        f"{library} was not built with the sanitizers"
    # --capture=sys: the sanitizers' runtime writes to file descriptor 2 (libubsan does not honour
    # log_path when loaded beside the ASan runtime), which pytest's default capture would swallow
    out = run_sanitized(["-m", "pytest", "-q", "-x", "--capture=sys", "-p", "no:cacheprovider", "-m", "not slow and not gpu",
                         *KERNEL_TESTS], tmp_path, timeout_s=1500)
    assert " passed" in out and " failed" not in out, out[-3000:]
