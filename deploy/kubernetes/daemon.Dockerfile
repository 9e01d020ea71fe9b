# The daemon's own image for deploy/kubernetes (not a sandbox image: those are built on
# each node by the DaemonSet's `images` init container, without a registry).
#   docker build -f deploy/kubernetes/daemon.Dockerfile -t substrate:0.1.0 .
# The tag is the package version (pyproject.toml); tests/test_kubernetes.py keeps the
# DaemonSet's image equal to it.
ARG PYTHON=python:3.11-slim-bookworm
FROM ${PYTHON}
# debootstrap and busybox-static: `substrate image build` makes the sandbox images'
# root filesystems on the node. No docker CLI: the daemon uses the engine's API.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        debootstrap busybox-static ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY . /opt/substrate
RUN pip install --no-cache-dir /opt/substrate
WORKDIR /opt/substrate
CMD ["substrate", "--help"]
