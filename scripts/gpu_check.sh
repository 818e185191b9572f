#!/usr/bin/env bash
# The one prepared check for a lent GPU machine: stages in order of value, each under its own time
# limit, the limits adding up to under 5 minutes (STAGE_LIMITS below; --budget prints them).
#   prepare     a Python with a CUDA torch, the carried wheels (.whl/), the modules the stages import, CuPy
#   compile     every kernel module compiled at once, one process per core, into CuPy's disk cache
#   served      folio serve --device cuda on a tiny random model written here answers greedy completions,
#               and greedy tokens with CUDA graphs, without them and on the CPU torch backend are the same
#   gpu_tests   the gpu-marked kernel and executor tests
#   gpu_models  the gpu-marked MoE, multi-LoRA and batch-invariance tests
#   kernels     folio bench kernels --quick: copy bandwidth; decode GB/s, prefill TFLOP/s against SDPA
#   step        folio bench step: decode steps at the 1B shape, batch 1 and 256, CUDA graphs and eager
#   quant       folio bench quant_gpu: AWQ W4A16 and FP8 projections of a 1B-shape layer against bf16
#
#   bash scripts/gpu_check.sh --fetch-wheels   # beforehand, where a package index is reachable
#   bash scripts/gpu_check.sh [--only STAGE,...] [--limit STAGE=SECONDS]   # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run        # anywhere: every stage with its CPU stand-in
#   bash scripts/gpu_check.sh --budget         # the stages' limits and their total
#
# Each stage writes STAGE.log, STAGE.json (its figures or test outcomes) and STAGE.result.json to $OUT
# (default /tmp/folio_gpu_check) when it ends, and summary.json / summary.txt after every stage; a
# failed stage does not stop the next. Exit 0 when every stage passed, 1 when one did not, 2 for bad
# arguments. What each stage runs, and its dry-run stand-in: docs/executor.md ("The GPU check").
set -uo pipefail
cd "$(dirname "$0")/.."

# The stages (set-up, then in order of value) and each one's time limit in seconds: the one place the
# budget is set.
STAGE_LIMITS=(prepare=15 compile=25 served=55 gpu_tests=70 gpu_models=40 kernels=25 step=45 quant=10)
BUDGET_S=300  # the selected stages' limits must add up to less
DRY_RUN_SCALE=4  # --dry-run's limits: its CPU stand-ins (the CUDA emulation above all) are slower than the GPU
# what --fetch-wheels downloads: modules GPU images lack (the prepare stage lists what is missing)
WHEELS=(msgspec pyzmq structlog gguf pytest pluggy iniconfig packaging pygments hypothesis sortedcontainers)
WHEEL_TARGET=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64
              --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
NEEDED_MODULES="torch transformers safetensors tokenizers msgspec zmq structlog gguf aiohttp prometheus_client psutil
                pytest hypothesis"
GPU_TEST_FILES=(tests/cuda/test_gpu.py tests/cuda/test_gpu_fused_graphs.py tests/cuda/test_gpu_quant.py
                tests/cuda/test_gpu_window_softcap.py tests/cuda/test_sampler_kernel.py tests/executor/test_kv_swap.py)
GPU_MODEL_FILES=(tests/cuda/test_moe_kernels.py tests/cuda/test_lora_kernels.py tests/cuda/test_gpu_batch_invariant.py)
# --dry-run's stand-ins: a few quick emulated tests of the same kernels
DRY_TESTS=(tests/cuda/test_fused_emulated.py::test_add_rms_norm
           tests/cuda/test_sampler_kernel.py::test_emulated_kernel_equals_torch_and_the_cpu_kernel_bit_for_bit
           tests/cuda/test_graphs_emulated.py::test_static_buffers_hold_the_step_and_padding)
DRY_MODEL_TESTS=(tests/cuda/test_moe_kernels.py::test_single_token tests/cuda/test_lora_kernels.py::test_bgmv_one_row
                 tests/cuda/test_batch_invariant_emulated.py::test_invariant_partitions_are_fixed)

die() { echo "gpu_check.sh: $*" >&2; exit 2; }

STAGES=()
declare -A LIMIT
for entry in "${STAGE_LIMITS[@]}"; do STAGES+=("${entry%%=*}"); LIMIT[${entry%%=*}]=${entry#*=}; done
DRY_RUN=0 SHOW_BUDGET=0 ONLY="" FETCH=0
while [ $# -gt 0 ]; do
  case $1 in
    --fetch-wheels) FETCH=1 ;;
    --dry-run) DRY_RUN=1 ;;
    --budget) SHOW_BUDGET=1 ;;
    --only) [ $# -ge 2 ] || die "--only needs STAGE[,STAGE...]"; ONLY=$2; shift ;;
    --limit)
      [[ ${2:-} =~ ^([a-z_]+)=([0-9]+)$ ]] || die "--limit needs STAGE=SECONDS, not '${2:-}'"
      [ -n "${LIMIT[${BASH_REMATCH[1]}]+x}" ] || die "no stage '${BASH_REMATCH[1]}' (stages: ${STAGES[*]})"
      [ "${BASH_REMATCH[2]}" -gt 0 ] || die "a stage's limit must be positive"
      LIMIT[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done

WHEEL_DIR=${FOLIO_WHEEL_DIR:-.whl}
if [ "$FETCH" = 1 ]; then
  mkdir -p "$WHEEL_DIR"
  exec "${PYTHON:-python3}" -m pip download --no-deps "${WHEEL_TARGET[@]}" -d "$WHEEL_DIR" "${WHEELS[@]}"
fi

SELECTED=()
for stage in "${STAGES[@]}"; do
  [ -z "$ONLY" ] || [[ ",$ONLY," == *",$stage,"* ]] && SELECTED+=("$stage")
done
for name in ${ONLY//,/ }; do [ -n "${LIMIT[$name]+x}" ] || die "no stage '$name' (stages: ${STAGES[*]})"; done
[ "${#SELECTED[@]}" -gt 0 ] || die "--only selects no stage (stages: ${STAGES[*]})"
TOTAL_S=0
for stage in "${SELECTED[@]}"; do TOTAL_S=$((TOTAL_S + LIMIT[$stage])); done
if [ "$SHOW_BUDGET" = 1 ]; then
  for stage in "${SELECTED[@]}"; do echo "$stage ${LIMIT[$stage]}"; done
  echo "total $TOTAL_S"
fi
[ "$TOTAL_S" -lt "$BUDGET_S" ] ||
  die "the selected stages' limits add up to $TOTAL_S s; they must stay under $BUDGET_S s"
[ "$SHOW_BUDGET" = 1 ] && exit 0
if [ "$DRY_RUN" = 1 ]; then
  for stage in "${STAGES[@]}"; do LIMIT[$stage]=$((LIMIT[$stage] * DRY_RUN_SCALE)); done
fi

OUT_DIR=${OUT:-/tmp/folio_gpu_check}
mkdir -p "$OUT_DIR" || die "cannot make $OUT_DIR"
PY=${PYTHON:-}
[ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python || PY=python3; }
MODE=$([ "$DRY_RUN" = 1 ] && echo dry-run || echo gpu)
# the carried wheels install here; on the GPU machine the stages import from it first
SITE=$([ "$DRY_RUN" = 1 ] && echo "$OUT_DIR/site" || echo /tmp/folio-site)
[ "$DRY_RUN" = 1 ] || export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
COMMIT=${FOLIO_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  # a copied tree has no .git
STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
for stage in "${SELECTED[@]}"; do rm -f "$OUT_DIR/$stage".{log,json,result.json}; done

# within CMD...: CMD under what is left of the running stage's limit (TERM, then KILL 2 s later;
# timeout signals CMD's whole process group, so a server a test started goes too)
within() {
  local left=$((STAGE_DEADLINE - SECONDS - 2))
  if [ "$left" -le 0 ]; then echo "(the stage's time is up; not run: $*)"; return 124; fi
  timeout -k 2 "$left" "$@"
}

# pytest_stage NAME FILE...: the gpu-marked tests of FILEs (--dry-run: the others), outcomes in NAME.json;
# no plugin but ours: whatever else the image installed neither slows nor breaks the run
pytest_stage() {
  local name=$1 marker="gpu and not slow"
  shift
  [ "$DRY_RUN" = 1 ] && marker="not gpu"
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 within "$PY" -m pytest -v -p no:cacheprovider -o addopts="" -p tests.cuda.check_report \
    --check-json "$OUT_DIR/$name.json" -m "$marker" "$@"
}

stage_prepare() {
  local rc=0
  if [ "$DRY_RUN" = 1 ]; then
    echo "dry run: no device; each stage runs its CPU stand-in"
  else
    within nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || rc=1
  fi
  if ls "$WHEEL_DIR"/*.whl >/dev/null 2>&1; then
    # a dry run installs them as the GPU image's Python would take them, into $OUT/site
    local target=()
    [ "$DRY_RUN" = 1 ] && target=("${WHEEL_TARGET[@]}")
    echo "installing the carried wheels into $SITE: $(cd "$WHEEL_DIR" && ls -- *.whl | tr '\n' ' ')"
    within "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$SITE" "${target[@]}" "$WHEEL_DIR"/*.whl ||
      { echo "FAIL: the carried wheels do not install"; rc=1; }
  else
    echo "no carried wheels in $WHEEL_DIR (bash scripts/gpu_check.sh --fetch-wheels makes them)"
  fi
  within "$PY" - "$DRY_RUN" "$OUT_DIR/prepare.json" $NEEDED_MODULES <<'EOF' || rc=1
import importlib.util, json, sys
dry, out, modules = sys.argv[1] == "1", sys.argv[2], sys.argv[3:]
missing = [m for m in modules if importlib.util.find_spec(m) is None]
import torch
figures = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "missing": missing}
open(out, "w").write(json.dumps(figures, indent=1))
print(figures)
if missing:
    print(f"FAIL: missing {' '.join(missing)} (carry their wheels: --fetch-wheels)")
if not dry and figures["device"] is None:
    print("FAIL: this Python's torch sees no CUDA device (GPU images install their own torch build first)")
sys.exit(1 if missing or (not dry and figures["device"] is None) else 0)
EOF
  [ "$DRY_RUN" = 1 ] || ensure_cupy || rc=1
  return $rc
}

# CuPy wheels are per CUDA major version; the driver decides which one can load
ensure_cupy() {
  local probe="import cupy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"
  within "$PY" -c "$probe" 2>/dev/null && return 0
  local major extra pkgs
  major=$(within nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -1)
  extra=$([ "${major:-12}" -ge 13 ] && echo cuda13 || echo cuda12)
  echo "installing the project's [$extra] extra (CuPy + NVRTC; needs a package index)"
  pkgs=$(within "$PY" -c "import tomllib
print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['$extra']))")
  within "$PY" -m pip install -q --retries 0 --timeout 5 $pkgs 2>&1 | tail -2
  within "$PY" -c "$probe" || { echo "FAIL: CuPy cannot reach the GPU; the cuda backend cannot run"; return 1; }
}

# the later stages then load each kernel module from CuPy's disk cache (--dry-run: NVRTC alone, two modules);
# it stops 5 s before the limit, and what it did not reach compiles when first used
stage_compile() {
  local only=()
  [ "$DRY_RUN" = 1 ] && only=(--arch 90 --files sampler.cu cache_ops.cu --units 2)
  within "$PY" -m tests.cuda.warm_kernel_cache "${only[@]}" --seconds $((STAGE_DEADLINE - SECONDS - 5)) \
    --json "$OUT_DIR/compile.json"
}

stage_served() { pytest_stage served tests/cuda/test_served_greedy.py; }

stage_gpu_tests() {
  if [ "$DRY_RUN" = 1 ]; then pytest_stage gpu_tests "${DRY_TESTS[@]}"
  else pytest_stage gpu_tests "${GPU_TEST_FILES[@]}"; fi
}

stage_gpu_models() {
  if [ "$DRY_RUN" = 1 ]; then pytest_stage gpu_models "${DRY_MODEL_TESTS[@]}"
  else pytest_stage gpu_models "${GPU_MODEL_FILES[@]}"; fi
}

# the benchmarks as modules (python -m finds folio in the checkout, installed or not); --dry-run runs the
# kernel benchmarks against the CUDA emulation (tests/cuda/emulated_bench.py), the step on a tiny model
stage_kernels() {
  if [ "$DRY_RUN" = 1 ]; then within "$PY" -m tests.cuda.emulated_bench kernels --json "$OUT_DIR/kernels.json"
  else within "$PY" -m folio.bench.kernels --quick --json "$OUT_DIR/kernels.json"; fi
}

stage_step() {
  local shape=(--device cuda --batches 1 256 --prompt-len 128 --decode-steps 32)
  [ "$DRY_RUN" = 1 ] && shape=(--device cpu --model-shape tiny --batches 1 2 --prompt-len 8 --decode-steps 2)
  within "$PY" -m folio.bench.step --skip-null --modes graphs eager --kinds greedy "${shape[@]}" \
    --json "$OUT_DIR/step.json"
}

stage_quant() {
  if [ "$DRY_RUN" = 1 ]; then within "$PY" -m tests.cuda.emulated_bench quant --json "$OUT_DIR/quant.json"
  else within "$PY" -m folio.bench.quant_gpu --json "$OUT_DIR/quant.json"; fi
}

# write_result NAME STATUS RC SECONDS: the stage's result file
write_result() {
  local figures=null
  [ -s "$OUT_DIR/$1.json" ] && figures="\"$1.json\""
  printf '{"name": "%s", "status": "%s", "rc": %d, "seconds": %d, "limit_s": %d, "log": "%s.log", "figures": %s}\n' \
    "$1" "$2" "$3" "$4" "${LIMIT[$1]}" "$1" "$figures" > "$OUT_DIR/$1.result.json"
}

# write_summary STATUS: summary.json (every selected stage's result, or pending) and summary.txt
write_summary() {
  local entries=() lines=() stage
  for stage in "${SELECTED[@]}"; do
    if [ -f "$OUT_DIR/$stage.result.json" ]; then
      entries+=("$(cat "$OUT_DIR/$stage.result.json")")
      lines+=("$(sed 's/.*"status": "\([a-z]*\)", "rc": \([0-9]*\), "seconds": \([0-9]*\).*/\1 \3/' \
        "$OUT_DIR/$stage.result.json")")
    else
      entries+=("{\"name\": \"$stage\", \"status\": \"pending\", \"limit_s\": ${LIMIT[$stage]}}")
      lines+=("pending -")
    fi
  done
  local joined
  joined=$(IFS=,; echo "${entries[*]}")
  printf '{"mode": "%s", "commit": "%s", "started": "%s", "python": "%s", "budget_s": %d, "status": "%s",\n' \
    "$MODE" "$COMMIT" "$STARTED" "$PY" "$TOTAL_S" "$1" > "$OUT_DIR/summary.json.tmp"
  printf ' "stages": [%s]}\n' "$joined" >> "$OUT_DIR/summary.json.tmp"
  mv "$OUT_DIR/summary.json.tmp" "$OUT_DIR/summary.json"
  {
    echo "gpu_check ($MODE) at $COMMIT, started $STARTED: $1"
    local i=0
    for stage in "${SELECTED[@]}"; do
      read -r status seconds <<< "${lines[$i]}"
      printf '%-11s %-8s %4s s of %3d s\n' "$stage" "$status" "$seconds" "${LIMIT[$stage]}"
      i=$((i + 1))
    done
  } > "$OUT_DIR/summary.txt"
}

scaled=$([ "$DRY_RUN" = 1 ] && echo " (x$DRY_RUN_SCALE in a dry run)")
echo "== gpu_check ($MODE): ${SELECTED[*]}; limits add up to $TOTAL_S s$scaled; results in $OUT_DIR"
write_summary running
overall=pass
for stage in "${SELECTED[@]}"; do
  echo "== $stage (limit ${LIMIT[$stage]} s)"
  STAGE_DEADLINE=$((SECONDS + LIMIT[$stage]))
  began=$SECONDS
  ( "stage_$stage" ) 2>&1 | tee "$OUT_DIR/$stage.log"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status=pass ;;
    124|137) status=timeout
             echo "== $stage: stopped at its limit of ${LIMIT[$stage]} s" | tee -a "$OUT_DIR/$stage.log" ;;
    *) status=fail ;;
  esac
  [ "$status" = pass ] || overall=fail
  write_result "$stage" "$status" "$rc" $((SECONDS - began))
  write_summary running
done
write_summary "$overall"
echo "== done: $overall"
cat "$OUT_DIR/summary.txt"
[ "$overall" = pass ]
