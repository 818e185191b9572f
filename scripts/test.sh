#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. GPU tests skip themselves without a GPU.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not slow"`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
