#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (target: under 5 minutes).
#
#   bash scripts/gpu_check.sh --fetch-wheels   # beforehand, on a machine with a package index
#   bash scripts/gpu_check.sh                  # on the GPU machine, from the repository root
#
# GPU images may lack some of folio's pure-Python/C dependencies (msgspec, pyzmq, structlog,
# gguf). --fetch-wheels downloads cp312 manylinux wheels of them into .whl/ beside the checkout
# (.gitignore'd; carry it with the checkout); the check installs whatever it finds there
# into a private folder (--no-index, no network needed) and puts it on PYTHONPATH.
#
# 1. finds a Python with a CUDA torch (PYTHON, else .venv/bin/python, else python3);
# 2. installs the carried wheels, if any;
# 3. makes sure CuPy matching the driver's CUDA major version is importable (installs the
#    project's cuda12/cuda13 extra when it is not, which needs a package index);
# 4. runs the gpu-marked tests of tests/cuda (every kernel instance, decode split and unsplit,
#    GQA groups, the largest step, cache write, copy-on-write, swap, executor cuda vs torch;
#    sliding windows, logit soft-caps at fp32 edge values and GeGLU against a dense fp32 oracle);
#    (the fused layer kernels against torch, greedy tokens with CUDA graphs against eager;
#    the W4A16 kernels and FP8 weights against torch);
# 5. runs folio.bench.kernels --quick (copy bandwidth; decode GB/s and prefill TFLOP/s against
#    contiguous SDPA);
# 6. runs folio.bench.fused (the fused layer kernels against the torch ops, GB/s);
# 7. runs folio.bench.step --device cuda --skip-null (the 1B shape, eager and with CUDA
#    graphs: tok/s and ms per step at batch 1, 64, 256);
# 8. runs folio.bench.quant_gpu (one 1B-shape layer's projections: AWQ W4A16 at batch 1, 8,
#    256 and FP8 weights at 1, 256 against bf16). Figures land in $OUT (or /tmp/folio_gpu_check)
#    as well;
# 9. runs the MoE kernels' gpu tests (tests/cuda/test_moe_kernels.py: routing and the grouped GEMM
#    against torch up to 128 experts, top-8, 2048 x 768; MoE.forward on the GPU against the CPU);
# 10. runs the multi-LoRA kernels' gpu tests (tests/cuda/test_lora_kernels.py: BGMV, SGMV on
#    tensor cores and on CUDA cores against torch, f16/bf16/fp32, ranks 8/16/64, 300 rows);
# 11. runs the batch-invariance gpu tests (tests/cuda/test_gpu_batch_invariant.py, the 1B shape
#    in bf16: 8 concurrent greedy streams against their solo outputs, prefill vs decode vs
#    prefix-hit logits bitwise).
#    The timeouts add up to 9 minutes 25 s.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(msgspec pyzmq structlog gguf)
if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p .whl
  exec "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "${WHEELS[@]}"
fi
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

if ls .whl/*.whl >/dev/null 2>&1; then
  echo "== installing the carried wheels: $(cd .whl && ls *.whl | tr '\n' ' ')"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/folio-site .whl/*.whl \
    || { echo "FAIL: the carried wheels do not install"; exit 4; }
  export PYTHONPATH="/tmp/folio-site${PYTHONPATH:+:$PYTHONPATH}"
fi
for module in msgspec zmq structlog gguf; do
  "$PY" -c "import $module" 2>/dev/null || echo "WARNING: $module is missing (carry its wheel: --fetch-wheels)"
done

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
timeout 150 "$PY" -m pytest -q -m "gpu and not slow" tests/cuda -p no:cacheprovider -o addopts="" \
  --ignore=tests/cuda/test_gpu_batch_invariant.py --junitxml="$OUT_DIR/gpu_tests.xml" 2>&1 | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# run TITLE SECONDS NAME ARGS...: "$PY" ARGS under a time limit, its output also in $OUT_DIR/NAME.txt
run() {
  local title=$1 limit=$2 name=$3
  shift 3
  echo "== $title"
  timeout "$limit" "$PY" "$@" 2>&1 | tee "$OUT_DIR/$name.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
# gpu_tests TITLE SECONDS FILE NAME: one file of tests/cuda's gpu tests, the last lines of its report
gpu_tests() {
  echo "== $1"
  timeout "$2" "$PY" -m pytest -q -m gpu "tests/cuda/$3" -p no:cacheprovider -o addopts="" \
    --junitxml="$OUT_DIR/$4.xml" 2>&1 | tail -8
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

# the benchmarks as modules (python -m finds folio in the checkout, installed or not)
run "kernel benchmark" 60 bench -m folio.bench.kernels --quick --json "$OUT_DIR/bench.json"
run "fused layer kernels" 25 fused -m folio.bench.fused --json "$OUT_DIR/fused.json"
run "executor step, 1B shape: eager vs CUDA graphs" 75 step -m folio.bench.step --device cuda --skip-null
run "quantized projections (AWQ W4A16, FP8) against bf16" 30 quant -m folio.bench.quant_gpu --json "$OUT_DIR/quant.json"
gpu_tests "MoE kernels (routing, grouped GEMM) against torch" 60 test_moe_kernels.py moe_tests
gpu_tests "multi-LoRA kernels (BGMV, SGMV) against torch" 45 test_lora_kernels.py lora_tests
gpu_tests "batch invariance, 1B shape bf16 (streams vs solo, prefill vs decode logits bitwise)" 120 \
  test_gpu_batch_invariant.py invariance_tests

echo "== done (status $status); figures in $OUT_DIR"
exit $status
