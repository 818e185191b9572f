"""The C toolchain the CPU kernels are built with (``cpu_kernels`` compiles them on first use)."""

from __future__ import annotations

import os
import shutil


def c_compiler() -> str | None:
    """The C compiler for the executor's CPU kernels: ``$CC``, else ``cc`` or ``gcc`` on the PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def c_sanitizers() -> str | None:
    """``$FOLIO_SANITIZE`` (``address,undefined``, as ``-fsanitize=`` takes it): build the CPU
    kernels with these sanitizers, for the sanitizer job (the process must load their runtime
    first: ``LD_PRELOAD``); None: the plain build."""
    return os.environ.get("FOLIO_SANITIZE") or None
