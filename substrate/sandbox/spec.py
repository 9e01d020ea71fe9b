"""The create request of a sandbox container, from a profile alone (pure).

Everything a sandbox gets comes from its profile (docs/protocol.md §5: a request never weakens a
profile): `container_spec` turns a profile, who runs, the workspace's bind source and its
read-only paths into the engine's create arguments; `run_as` decides who runs and refuses
root; `create_request` names the container and labels it: the daemon, its run (epoch),
the workspace, the profile and the digest of the request (`substrate.sandbox.labelled`
acts on them). No I/O here: `substrate.sandbox.containers` creates, starts and verifies.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from substrate.egress.cabundle import CA_BUNDLE_TARGET
from substrate.errors import ConfinementUnmet
from substrate.sandbox import profiles
from substrate.sandbox.profiles import Profile

LABEL_DAEMON = "substrate.daemon"
LABEL_EPOCH = "substrate.epoch"
LABEL_WORKSPACE = "substrate.workspace"
LABEL_PROFILE = "substrate.profile"
LABEL_CONFIG = "substrate.config"
#: Where the workspace is mounted inside every sandbox.
WORKSPACE_TARGET = "/workspace"
#: Where the workspace's persistent home is bound read-write: the images' user's home
#: (`agent`, uid 1000, in both images' passwd) and the shipped profiles' `HOME`.
HOME_TARGET = "/home/agent"
#: The keep-alive command under the engine's init; both images' `sleep` take `infinity`.
KEEPALIVE = ("sleep", "infinity")
#: Runtimes whose sandboxed processes are host processes (so `reaper` may signal them).
HOST_VISIBLE_RUNTIMES = frozenset({"runc"})
#: The engine copies the host's resolver file here (even with no network); substrate
#: binds an empty read-only file over it, so a sandbox learns no name server address.
RESOLV_CONF_TARGET = "/etc/resolv.conf"
#: Where an egress sandbox finds its proxy: a listener the daemon holds inside the
#: sandbox's own network namespace (`substrate.sandbox.proxy_link`).
PROXY_HOST = "127.0.0.1"
PROXY_PORT = 3128
PROXY_URL = f"http://{PROXY_HOST}:{PROXY_PORT}"
#: Names an egress sandbox reaches without the proxy (its own loopback).
NO_PROXY = "localhost,127.0.0.1,::1"


@dataclass(frozen=True)
class RunAs:
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"{self.uid}:{self.gid}"


def run_as(profile: Profile, owner_uid: int, owner_gid: int) -> RunAs:
    """Who commands run as under `profile` in a workspace owned by owner_uid:owner_gid.

    Refuses `confinement_unmet` when that is root and the profile lacks `allow_root`.
    """
    if profile.user == "owner":
        who = RunAs(owner_uid, owner_gid)
    else:
        uid_text, _, gid_text = profile.user.partition(":")
        who = RunAs(int(uid_text), int(gid_text or uid_text))
    if who.uid == 0 and not profile.allow_root:
        if profile.user == "owner":
            raise ConfinementUnmet(
                "the workspace root is owned by root and profile "
                f"{profile.name!r} does not allow running as root: chown the checkout to "
                "its (non-root) user, e.g. `chown -R 1000:1000 <checkout>`",
                required={"uid": "non-root"},
                observed={"uid": 0},
            )
        raise ConfinementUnmet(
            f"profile {profile.name!r} runs as root without allow_root",
            required={"uid": "non-root"},
            observed={"uid": 0},
        )
    return who


def tmpfs_options(size: str) -> str:
    # Executable on purpose: the workspace is writable and executable anyway, so
    # `noexec` here would only break compilers and test runners that run from /tmp.
    return f"rw,nosuid,nodev,exec,mode=1777,size={size}"


def egress_env(profile: Profile, *, ca_bundle: bool) -> dict[str, str]:
    """The environment an egress sandbox gets besides its profile's: the proxy for every
    tool's spelling of it and, with a CA bundle, every tool's name for that (pure; {} for
    a `network = "none"` profile). `profiles.EGRESS_ENV` lists the names."""
    if profile.network != "egress":
        return {}
    env = {name: PROXY_URL for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")}
    env |= {name.lower(): value for name, value in env.items()}
    env |= {"NO_PROXY": NO_PROXY, "no_proxy": NO_PROXY}
    if ca_bundle:
        names = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE")
        env |= {name: CA_BUNDLE_TARGET for name in (*names, "GIT_SSL_CAINFO")}
        env["NODE_EXTRA_CA_CERTS"] = CA_BUNDLE_TARGET
    return env


def container_spec(
    profile: Profile,
    *,
    who: RunAs,
    workspace_source: str | None,
    readonly_dirs: Sequence[str],
    security_opt: Sequence[str],
    resolv_conf: str | None = None,
    ca_bundle: str | None = None,
    home_source: str | None = None,
) -> dict[str, Any]:
    """The engine's create request for `profile` (pure): everything comes from the profile.

    `workspace_source` is the host path to bind at /workspace (None for `workspace =
    "none"`; for "layer", the layer's base, bound `rslave` so the overlays the daemon
    mounts on it later reach the container, with nothing bound under it: the read-only
    parts are the layer's own mounts); `readonly_dirs` are workspace-relative directories (or `.git` files) bound
    read-only over it; `security_opt` is `profiles.security_opts(profile, ...)`
    (no-new-privileges, seccomp); `resolv_conf` is the host path of an empty file bound
    read-only at /etc/resolv.conf (the engine then leaves the host's resolver out);
    `ca_bundle` is the host path of the daemon's copy of an egress profile's CA bundle,
    bound read-only at `CA_BUNDLE_TARGET`. The network is the engine's "none" whatever
    the profile says: an egress sandbox's way out is a listener the daemon adds.
    `home_source` is the workspace's persistent home, bound read-write at `HOME_TARGET`.
    The environment here is the profile's `env` (and an egress profile's proxy
    variables) only: secrets are given per exec
    (`process.argv.exec_env`), so the container's configuration never holds one.
    """
    mounts: list[dict[str, Any]] = []
    if workspace_source is not None and profile.workspace == "layer":
        mounts.append(_bind(workspace_source, WORKSPACE_TARGET, False, propagation="rslave"))
    elif workspace_source is not None and profile.workspace != "none":
        mounts.append(_bind(workspace_source, WORKSPACE_TARGET, profile.workspace == "ro"))
        for rel in readonly_dirs:
            mounts.append(_bind(f"{workspace_source}/{rel}", f"{WORKSPACE_TARGET}/{rel}", True))
    if resolv_conf is not None:
        mounts.append(_bind(resolv_conf, RESOLV_CONF_TARGET, True))
    if ca_bundle is not None:
        mounts.append(_bind(ca_bundle, CA_BUNDLE_TARGET, True))
    if home_source is not None:
        mounts.append(_bind(home_source, HOME_TARGET, False))
    host_config: dict[str, Any] = {
        "mounts": mounts,
        "tmpfs": {path: tmpfs_options(size) for path, size in profile.tmpfs.items()},
        "read_only": profile.read_only_rootfs,
        "network_mode": "none",
        "mem_limit": profile.memory,
        "memswap_limit": profile.memory,  # no swap beyond the memory limit
        "nano_cpus": profiles.nano_cpus(profile),
        "pids_limit": profile.pids,
        "cap_drop": ["ALL"],
        "cap_add": list(profile.capabilities),
        "security_opt": list(security_opt),
        "init": True,  # the engine's init reaps orphans, so zombies never pile up
        "privileged": False,
        "ipc_mode": "private",
        "log_config": {"type": "none"},  # the keep-alive prints nothing; no log files
        "restart_policy": {"Name": "no"},
        # The engine reads the runtime from HostConfig only (docker-py's top-level
        # `runtime` argument is silently ignored by it).
        "runtime": profile.runtime,
    }
    return {
        "image": profile.image,
        "command": list(KEEPALIVE),
        "user": str(who),
        "environment": {**profile.env, **egress_env(profile, ca_bundle=ca_bundle is not None)},
        "working_dir": WORKSPACE_TARGET if profile.workspace != "none" else "/",
        "host_config": host_config,
    }


def _bind(
    source: str, target: str, read_only: bool, *, propagation: str = "rprivate"
) -> dict[str, Any]:
    return {
        "Type": "bind",
        "Source": source,
        "Target": target,
        "ReadOnly": read_only,
        "BindOptions": {"Propagation": propagation},
    }


def spec_digest(spec: Mapping[str, Any]) -> str:
    """SHA-256 of a create request, canonical JSON (the `substrate.config` label)."""
    return hashlib.sha256(
        json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def pair_labels(daemon_id: str, workspace: str, profile: str) -> dict[str, str]:
    """The labels that mark a container as daemon `daemon_id`'s, for one (workspace,
    profile)."""
    return {LABEL_DAEMON: daemon_id, LABEL_WORKSPACE: workspace, LABEL_PROFILE: profile}


@dataclass(frozen=True)
class CreateRequest:
    """The engine's create call of one sandbox container (`create_request`)."""

    name: str
    labels: dict[str, str]  # their `substrate.config` is the digest of `spec` as made
    spec: dict[str, Any]  # `container_spec`'s


def create_request(
    workspace: str, profile: str, spec: dict[str, Any], *, daemon_id: str, epoch: int, token: str
) -> CreateRequest:
    """`spec` named (`substrate-<workspace>-<profile>-<token>`) and labelled as daemon
    `daemon_id`'s, of run `epoch`, with the digest of `spec` (pure)."""
    labels = {
        **pair_labels(daemon_id, workspace, profile),
        LABEL_EPOCH: str(epoch),
        LABEL_CONFIG: spec_digest(spec),
    }
    return CreateRequest(name=f"substrate-{workspace}-{profile}-{token}", labels=labels, spec=spec)


def daemon_id_for(state_dir: os.PathLike[str] | str) -> str:
    """A stable id for the daemon owning `state_dir` (device, inode and path): the
    `substrate.daemon` label. Cost: one stat."""
    st = os.stat(state_dir)
    raw = f"{st.st_dev}:{st.st_ino}:{os.fspath(state_dir)}".encode()
    return hashlib.sha256(raw).hexdigest()[:16]
