# substrate-sandbox:bookworm — the default sandbox image (docs/protocol.md §10).
#
# Offline (the default): BASE is substrate-base:bookworm, a Debian bookworm root
# filesystem made by debootstrap with every package below already included, then imported
# into the engine. `substrate image build` (substrate.imagebuild) makes it; the build
# steps here need no network and are run with none.
#
# With a registry: `docker build --build-arg BASE=debian:bookworm-slim -t
# substrate-sandbox:bookworm .` starts from the registry image instead; the RUN below then
# installs what is missing with apt-get (this needs network).
#
# substrate/images/sandbox.Dockerfile is a byte-for-byte copy shipped as package data
# (a test keeps them equal): edit both.
ARG BASE=substrate-base:bookworm
FROM ${BASE}

ENV LANG=C.UTF-8 \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# Install only what the base lacks (nothing, for the debootstrap base), then drop apt's
# lists and caches and the docs so the registry-base variant stays small too. User 1000
# ("agent") owns /home/agent; sandboxed commands normally run as the checkout's owner,
# which the profile sets at run time. /workspace is marked safe for git because the
# bind-mounted checkout may belong to a uid other than the one a profile runs as.
RUN set -eu; \
    if ! command -v python3 >/dev/null 2>&1 \
        || ! python3 -m pytest --version >/dev/null 2>&1 \
        || ! python3 -m pip --version >/dev/null 2>&1 \
        || ! python3 -c 'import ensurepip, venv, setuptools, wheel' >/dev/null 2>&1 \
        || ! command -v git >/dev/null 2>&1 \
        || ! command -v ps >/dev/null 2>&1 \
        || ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1 \
        || ! command -v gcc >/dev/null 2>&1 || ! command -v g++ >/dev/null 2>&1 \
        || ! command -v make >/dev/null 2>&1 || ! command -v curl >/dev/null 2>&1 \
        || ! command -v rg >/dev/null 2>&1 || ! command -v jq >/dev/null 2>&1 \
        || ! command -v unzip >/dev/null 2>&1; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-pytest python3-pip python3-venv python3-setuptools \
            python3-wheel git bash coreutils procps ca-certificates \
            nodejs npm gcc g++ make curl ripgrep jq unzip; \
    fi; \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb \
        /usr/share/man/* /usr/share/info/*; \
    find /usr/share/doc -mindepth 1 -not -type d -not -name copyright -delete; \
    groupadd --gid 1000 agent; \
    useradd --uid 1000 --gid 1000 --create-home --home-dir /home/agent \
        --shell /bin/bash agent; \
    git config --system --add safe.directory /workspace

LABEL substrate.image=sandbox
USER 1000:1000
WORKDIR /home/agent
CMD ["bash"]
