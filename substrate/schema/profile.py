"""Wire schema of profiles and confinement facts (docs/protocol.md §5)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from substrate.schema.common import Empty, Params, Result, WorkspaceId, method
from substrate.schema.facts import Fact


class EgressInject(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One host's secret header, set by the egress proxy on every HTTPS request to it."""

    header: str  # the header's name, e.g. "x-api-key" (any the client sent is replaced)
    secret: str  # the operator secret (`substrate secret set NAME`) whose value it gets


#: Which symlinks made in a "layer" sandbox are applied (the profile key `symlinks`).
SymlinkMode = Literal["any", "inside", "none"]


class GitIdentity(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Who the agent's commits are by (author and committer), set by the operator; both
    empty: git's own configuration decides."""

    name: str = ""  # e.g. "substrate agent"
    email: str = ""  # e.g. "agent@substrate.invalid"


class Profile(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One operator-declared process profile. `name` is the file stem, not a TOML key."""

    name: str = ""  # filled from the file stem at load
    description: str = ""  # one line for `profile.list`
    image: str = "substrate-sandbox:bookworm"  # local image reference; never pulled
    runtime: Literal["runc", "runsc"] = "runc"  # OCI runtime registered in the engine
    user: str = "owner"  # "owner" (uid:gid of the workspace root) or "UID:GID"
    allow_root: bool = False  # may a root-owned workspace run as root
    workspace: Literal["rw", "ro", "none", "layer"] = "layer"  # /workspace: overlay, or bind mode
    #: Checkout dirs bound read-write over a "layer" workspace (caches, build output).
    passthrough: list[str] = msgspec.field(default_factory=list)
    #: "layer" only: which symlinks a command made are applied: "any", "inside" (those
    #: whose target, resolved lexically from the link's directory, stays in the
    #: checkout) or "none" (docs/working-layer.md, "Symlinks").
    symlinks: SymlinkMode = "any"
    #: "none": lo only, no routes; "egress": the same, plus the daemon's allow-listing
    #: proxy on 127.0.0.1:3128 inside the sandbox (docs/egress.md; runc only).
    network: Literal["none", "egress"] = "none"
    #: "egress" only: host names the proxy lets through (ports 80 and 443): "host",
    #: "*.example" (any name beneath), "@pip-index" (this host's pip index, resolved at load).
    egress_allow: list[str] = msgspec.field(default_factory=list)
    #: "egress" only: a CA bundle mounted read-only in the sandbox (and named by
    #: SSL_CERT_FILE etc.): "" none, "host" the host's system bundle, or an absolute path.
    ca_bundle: str = ""
    #: "egress" only: host (from `egress_allow`, no wildcard) → header and secret the
    #: proxy sets on its HTTPS requests; the key never enters the sandbox. Needs
    #: `ca_bundle` (the sandbox's own CA is added to it). docs/egress.md.
    egress_inject: dict[str, EgressInject] = msgspec.field(default_factory=dict)
    read_only_rootfs: bool = True  # container root filesystem mounted read-only
    tmpfs: dict[str, str] = msgspec.field(default_factory=lambda: {"/tmp": "256m"})  # path → size
    memory: str = "1g"  # memory limit, docker size syntax (k/m/g)
    cpus: float = 2.0  # CPU quota in cores
    pids: int = 256  # max tasks in the container's cgroup
    timeout_s: float = 600.0  # wall-clock limit per command, seconds
    max_output_bytes: int = 1 << 30  # per stream; past it the rest is discarded
    seccomp: str = "strict"  # seccomp/<name>.json, or "engine-default"
    capabilities: list[str] = msgspec.field(default_factory=list)  # kept caps, e.g. "CHOWN"
    no_new_privileges: bool = True  # PR_SET_NO_NEW_PRIVS for every process
    env: dict[str, str] = msgspec.field(
        default_factory=lambda: {
            "LANG": "C.UTF-8",
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": "/home/agent",
        }
    )  # the whole environment of a command (HOME: the workspace's persistent home)
    #: Variable → operator secret name (`substrate secret set NAME`), added to `env` per exec.
    secrets: dict[str, str] = msgspec.field(default_factory=dict)
    argv_allow: list[str] = msgspec.field(default_factory=list)  # allowed argv[0]; empty = any
    interactive: bool = False  # may back a PTY session (with a grant)
    #: "layer" only: the git refs (globs as in the policy, over ref names) whose moves
    #: in the sandbox's git layer apply to the checkout when a command ends; any other
    #: waits, blocked `ref_denied`, for the operator's `changes.apply`.
    git_refs_allow: list[str] = msgspec.field(default_factory=lambda: ["refs/heads/agent/**"])
    #: The author and committer of the agent's commits (GIT_AUTHOR_NAME/EMAIL and
    #: GIT_COMMITTER_NAME/EMAIL of every command, over `env`); empty: git's own config.
    git_identity: GitIdentity = msgspec.field(default_factory=GitIdentity)


ProfileName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class ProfileSummary(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str
    interactive: bool


class ProfileListResult(Result, omit_defaults=False):
    profiles: list[ProfileSummary]


class ProfileGetParams(Params):
    name: ProfileName


class ProbeParams(Params):
    workspace: WorkspaceId
    profile: ProfileName


class ProbeResult(Result, omit_defaults=False):
    workspace: str
    profile: str
    container: str  # short engine id of the verified sandbox
    facts: list[Fact]


class ProfileDigest(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    # SHA-256 of the profile's canonical JSON and its seccomp policy file's bytes.
    digest: str


class ProfileReloadResult(Result, omit_defaults=False):
    """The profiles now in force, and what the reload changed (names, sorted)."""

    profiles: list[ProfileDigest]
    added: list[str]
    removed: list[str]
    changed: list[str]
    # Sandboxes of a changed or removed profile: idle ones were removed, busy ones run
    # their commands to the end and are removed once idle.
    retired_sandboxes: int


method("profile.list", Empty, ProfileListResult, doc="Names and descriptions of the profiles.")
method(
    "profile.reload",
    Empty,
    ProfileReloadResult,
    operator_only=True,
    doc="Load the profiles again; running commands keep theirs, new ones get the new set.",
)
method("profile.get", ProfileGetParams, Profile, doc="One whole profile, every field.")
method(
    "facts.probe",
    ProbeParams,
    ProbeResult,
    doc="Create or reuse the sandbox of (workspace, profile) and return its observed facts.",
)
