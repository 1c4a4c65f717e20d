# A local stand-in for the official flwr/superlink and flwr/supernode images, for machines
# that cannot reach Docker Hub (the tests here): the same layout, so docker/Dockerfile builds
# on either. Flower's images keep Python in a virtualenv at /python/venv on PATH, run as the
# user `app` (uid 49999, home and working directory /app) and start `flower-<role>`.
#   podman build -f docker/standin.Dockerfile --build-arg ROLE=superlink \
#       --build-arg BASE=<a Debian bookworm image> -t <prefix>/superlink:1.41.0 <empty dir>
# then build docker/Dockerfile with --build-arg FLOWER_IMAGES=<prefix>
ARG BASE=debian:bookworm-slim
FROM ${BASE}
ARG FLWR_VERSION=1.41.0
ARG ROLE=supernode
RUN python3 -m venv /python/venv \
    && /python/venv/bin/pip install --no-cache-dir "flwr==${FLWR_VERSION}" \
    && useradd --home-dir /app --no-create-home --uid 49999 app \
    && mkdir -p /app && chown -R app:app /app /python/venv
ENV PATH=/python/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LANG=C.UTF-8 \
    HOME=/app \
    FLOWER_ROLE=${ROLE}
WORKDIR /app
USER app
ENTRYPOINT ["/bin/sh", "-c", "exec flower-${FLOWER_ROLE} \"$@\"", "flower"]
