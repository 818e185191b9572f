"""How long torch's OpenMP threads spin after each parallel region, chosen per model before torch loads.

libgomp reads ``GOMP_SPINCOUNT`` once, when it loads with torch. Its default (about 300,000 checks)
suits a model whose step is torch's own GEMMs (the fp32 path: a worker that sleeps between two ops
costs a wake-up each time). A quantized model on the CPU runs its step in folio's C kernels, on a
pool of their own; torch's workers spinning after its few ops there take the cores those kernels
need, so such a model gets a short spin. Where ``GOMP_SPINCOUNT`` is set, or torch is already loaded,
nothing changes. docs/executor.md has the measurements.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from folio.core.model_files import MARKER

SHORT_SPIN = "10000"  # checks; libgomp's default is about 300,000


def runs_on_c_kernels(model_path: str, quantization: str, device: str) -> bool:
    """Whether a model will step on the CPU kernels: a CPU device and quantized weights (asked for,
    or the checkpoint's own: a GGUF, a folder prepared from one, an AWQ or int8 folder)."""
    if device not in ("cpu", "auto") or quantization in ("none", "fp8"):
        return False
    if quantization in ("int4", "int8", "awq"):
        return True
    path = Path(model_path)
    if path.suffix == ".gguf":
        return True
    if (path / MARKER).exists():  # prepared from a GGUF: served in its types
        return True
    config = path / "config.json"
    return config.exists() and "quantization_config" in json.loads(config.read_text())


def choose_spin_count(model_path: str, quantization: str, device: str) -> str | None:
    """Set ``GOMP_SPINCOUNT`` for this model unless it is set or torch is loaded; the value set, or None."""
    if "GOMP_SPINCOUNT" in os.environ or "torch" in sys.modules:
        return None
    if runs_on_c_kernels(model_path, quantization, device):
        os.environ["GOMP_SPINCOUNT"] = SHORT_SPIN
        return SHORT_SPIN
    return None
