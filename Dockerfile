# syntax=docker/dockerfile:1
# One image for the operator (`rollout-operator`) and the reference rollout servers
# (`rollout-server <role>`, `rollout-coordinate`, `rollout-collect`): the chart runs the operator
# from it, RolloutSet templates run the servers from it (examples/rolloutset.yaml).
#
#   docker build -t rollout-checkpoint-operator:0.1.0 .
#
# The base is pinned to a patch release. For a reproducible production build pin its digest as
# well: `docker buildx imagetools inspect python:3.11.14-slim-trixie` prints it; then build with
#   --build-arg PYTHON_IMAGE=python:3.11.14-slim-trixie@sha256:<digest>
ARG PYTHON_IMAGE=python:3.11.14-slim-trixie

# --- builder: a virtual environment with the project and its dependencies -----------------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Only what the distribution is built from (.dockerignore keeps everything else out).
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY servers ./servers
COPY protocol ./protocol
# pip compiles the bytecode here, so the runtime never needs to write any.
RUN python -m venv /opt/rollout \
 && /opt/rollout/bin/pip install --no-cache-dir '.[device-plugin]' \
 && /opt/rollout/bin/pip uninstall --yes pip

# --- runtime: the environment alone, run as an unprivileged user --------------------------------
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="rollout-checkpoint-operator" \
      org.opencontainers.image.description="Rollout Checkpoint Operator and reference rollout servers" \
      org.opencontainers.image.licenses="Apache-2.0"
# The same numeric user as the chart's podSecurityContext (runAsNonRoot needs a numeric UID).
RUN groupadd --system --gid 10001 rollout \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
      --shell /usr/sbin/nologin rollout
COPY --from=builder /opt/rollout /opt/rollout
# Read-only root filesystem: nothing writes outside /tmp (an emptyDir in the chart). HOME points
# there for libraries that look for a home; bytecode is precompiled and never written.
ENV PATH=/opt/rollout/bin:$PATH \
    HOME=/tmp \
    TMPDIR=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /tmp
USER 10001:10001
# 8080: the operator's liveness endpoint, 9090: its metrics, 8000: a rollout server's port.
EXPOSE 8080 9090 8000
CMD ["rollout-operator", "--help"]
