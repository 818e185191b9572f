"""torch's OpenMP spin count is chosen per model before torch loads (``folio/core/executor/threads.py``):
short for a model that steps on the C kernels, libgomp's own for the fp32 path."""

from __future__ import annotations

import os
import subprocess
import sys

from folio.core.executor.threads import SHORT_SPIN, runs_on_c_kernels
from folio.testing.gguf_blocks import all_of, write_llama_gguf
from folio.testing.models import write_tiny_model


def test_which_models_step_on_the_c_kernels(tmp_path):
    gguf = write_llama_gguf(tmp_path / "m.gguf", all_of("Q4_0"))
    folder = write_tiny_model(tmp_path / "tiny")
    assert runs_on_c_kernels(str(gguf), "auto", "auto")
    assert not runs_on_c_kernels(str(gguf), "none", "auto")  # dense: torch's GEMMs
    assert not runs_on_c_kernels(str(gguf), "auto", "cuda")
    assert not runs_on_c_kernels(str(folder), "auto", "cpu")  # an fp32 folder stays dense
    assert runs_on_c_kernels(str(folder), "int4", "cpu")


def _spin_in_child(model: str, quantization: str, env: dict) -> str:
    code = ("import os; from folio.core.executor.threads import choose_spin_count; "
            f"choose_spin_count({model!r}, {quantization!r}, 'cpu'); print(os.environ.get('GOMP_SPINCOUNT', '-'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return out.stdout.strip()


def test_the_spin_is_set_before_torch_loads_and_never_over_the_users(tmp_path):
    gguf = str(write_llama_gguf(tmp_path / "m.gguf", all_of("Q4_0")))
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    assert _spin_in_child(gguf, "auto", env) == SHORT_SPIN
    assert _spin_in_child(gguf, "none", env) == "-"  # libgomp's default
    assert _spin_in_child(gguf, "auto", {**env, "GOMP_SPINCOUNT": "123"}) == "123"
