#!/usr/bin/env bash
# Set up (idempotent) and serve the packaged SmolLM2-135M-Instruct on the CPU, port 8000.
# Extra flags go to `folio serve` (see `folio serve --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/folio serve "$@"
