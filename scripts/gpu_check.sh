#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (target: under 5 minutes).
#
#   bash scripts/gpu_check.sh            # from the repository root
#
# 1. finds a Python with a CUDA torch (PYTHON, else .venv/bin/python, else python3);
# 2. makes sure CuPy matching the driver's CUDA major version is importable (installs the
#    project's cuda12/cuda13 extra when it is not, which needs a package index);
# 3. runs the gpu-marked tests of tests/cuda (kernels, every instance, executor cuda vs torch);
# 4. runs scripts/bench_kernels.py (copy vs decode bandwidth, paged vs contiguous SDPA,
#    end-to-end tokens/s cuda vs torch). Figures land in $OUT (or /tmp/folio_gpu_check) as well.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-/tmp/folio_gpu_check}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
status=0

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "FAIL: $PY has no CUDA torch (GPU images install their own torch build first)"; exit 2
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

# CuPy wheels are per CUDA major version; the driver decides which one can load.
cuda_major=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -1)
extra=$([ "${cuda_major:-12}" -ge 13 ] && echo cuda13 || echo cuda12)
if ! "$PY" -c "import cupy; cupy.cuda.runtime.getDeviceCount()" 2>/dev/null; then
  echo "== installing the project's [$extra] extra (CuPy + NVRTC)"
  [ "$extra" = cuda12 ] && "$PY" -m pip uninstall -y -q cupy-cuda13x 2>/dev/null
  pkgs=$("$PY" -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['$extra']))")
  "$PY" -m pip install -q $pkgs 2>&1 | tail -2
fi
"$PY" -c "import cupy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())" || {
  echo "FAIL: CuPy cannot reach the GPU; the cuda backend cannot run"; exit 3; }
"$PY" -c "import pytest" 2>/dev/null || "$PY" -m pip install -q pytest pytest-timeout

echo "== gpu tests (tests/cuda -m gpu)"
timeout 200 "$PY" -m pytest -q -m "gpu and not slow" tests/cuda -p no:cacheprovider -o addopts="" \
  --junitxml="$OUT_DIR/gpu_tests.xml" 2>&1 | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== kernel benchmark"
timeout 150 "$PY" scripts/bench_kernels.py --json "$OUT_DIR/bench.json" 2>&1 | tee "$OUT_DIR/bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== done (status $status); figures in $OUT_DIR"
exit $status
