# syntax=docker/dockerfile:1
#
# The `elasticpipe` command in a container: coordinator, stage server or admin client.
#
#   CPU (default):  docker build -t elasticpipe .
#   CUDA:           docker build -t elasticpipe-cuda \
#                     --build-arg BASE=nvidia/cuda:12.4.1-runtime-ubuntu22.04 .
#
# Then `docker run --rm elasticpipe coordinator --listen 0.0.0.0:7100 ...`; see docs/deploy.md.

# Any Debian/Ubuntu image: a Python image is used as it is, any other (such as NVIDIA's
# CUDA runtime images) gets Python from its distribution below. torch's CUDA wheels bring
# their own CUDA libraries; the CUDA base adds the settings (NVIDIA_VISIBLE_DEVICES, ...)
# that the NVIDIA container runtime reads to hand the GPUs to the container.
ARG BASE=python:3.11-slim

FROM ${BASE}

# Re-declared: an ARG given before FROM is not visible inside the stage otherwise.
ARG BASE
# Where torch comes from. Empty (the default) chooses by BASE: the CPU-only wheels for a
# CPU image (a few hundred MB instead of several GB of CUDA libraries), PyPI's default
# wheels (built with CUDA) for an image whose BASE names CUDA. Give a URL to override, e.g.
# https://download.pytorch.org/whl/cu124 for wheels built against that CUDA exactly.
ARG TORCH_INDEX_URL=""
# Keep in step with the torch requirement in pyproject.toml (tests/unit/test_deploy.py checks).
ARG TORCH_REQUIREMENT="torch>=2.4,<3"

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/elasticpipe \
    PATH=/opt/elasticpipe/bin:$PATH

# Python for bases that lack it (the CUDA images). A virtual environment keeps the project
# apart from the distribution's own Python packages (and from PEP 668's refusal to mix them).
# Unpinned on purpose: the distribution's versions differ from base to base, and pip only
# has to be recent enough for today's wheels.
# hadolint ignore=DL3008,DL3013
RUN set -eux; \
    if ! command -v python3 >/dev/null 2>&1 || ! python3 -c 'import venv, ensurepip' 2>/dev/null; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv python3-pip ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -c 'import sys; assert sys.version_info >= (3, 10), sys.version'; \
    python3 -m venv "$VIRTUAL_ENV"; \
    pip install --upgrade pip

# torch first, in a layer of its own: it is by far the largest and changes least often.
# hadolint ignore=DL3013
RUN set -eux; \
    index="$TORCH_INDEX_URL"; \
    if [ -z "$index" ]; then \
        case "$BASE" in \
            *cuda*) index="" ;; \
            *) index="https://download.pytorch.org/whl/cpu" ;; \
        esac; \
    fi; \
    if [ -n "$index" ]; then \
        pip install --index-url "$index" "$TORCH_REQUIREMENT"; \
    else \
        pip install "$TORCH_REQUIREMENT"; \
    fi

# The project itself (.dockerignore lets in only what the wheel needs). Its torch
# requirement is already met, so only the small dependencies come from PyPI here.
COPY . /tmp/src
RUN set -eux; \
    pip install /tmp/src; \
    rm -rf /tmp/src; \
    elasticpipe --help >/dev/null

# A fixed numeric user: Kubernetes' runAsNonRoot can only verify a numeric USER. The state
# folder exists and belongs to that user in the image, so a Docker named volume mounted
# there starts out writable by it (Docker copies the folder's owner into a new volume).
RUN set -eux; \
    groupadd --system --gid 10001 elasticpipe; \
    useradd --system --uid 10001 --gid 10001 --home-dir /home/elasticpipe --create-home \
        --shell /usr/sbin/nologin elasticpipe; \
    install -d -o 10001 -g 10001 -m 0750 /var/lib/elasticpipe
WORKDIR /var/lib/elasticpipe
USER 10001:10001

# 7100: coordinator, 7200: stage server (gRPC); 9090: Prometheus metrics (--metrics-port).
EXPOSE 7100 7200 9090

ENTRYPOINT ["elasticpipe"]
CMD ["--help"]
