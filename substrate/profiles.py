"""Operator process profiles: `profiles/<name>.toml` → a validated, frozen `Profile`.

A profile is the whole of what a sandboxed command may get; requests never add to it
(SPEC §5). Every field has an explicit default and a one-line comment with its unit.

Loading happens once, at daemon start: `load_profiles` reads every `*.toml` in the
profiles directory, decodes it strictly (TOML → msgspec, no coercion, unknown keys
refused), then checks what a type cannot say (sizes parse, limits are sane, capabilities
exist, the seccomp policy file loads). Any problem is a `ProfileError` naming the file and
the key; it is a configuration error that stops the start, not a wire refusal.

The helpers below (`memory_bytes`, `tmpfs_bytes`, `nano_cpus`, `cpu_quota_us`,
`user_ids`, `capability_mask`, `security_opts`) turn a profile into the numbers the engine
takes and the kernel reports, so containers and confinement facts agree on one reading.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from substrate import seccomp


class Profile(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One operator-declared process profile. `name` is the file stem, not a TOML key."""

    name: str = ""  # filled from the file stem at load
    description: str = ""  # one line for `profile.list`
    image: str = "substrate-sandbox:bookworm"  # local image reference; never pulled
    runtime: Literal["runc", "runsc"] = "runc"  # OCI runtime registered in the engine
    user: str = "owner"  # "owner" (uid:gid of the workspace root) or "UID:GID"
    allow_root: bool = False  # may a root-owned workspace run as root
    workspace: Literal["rw", "ro", "none"] = "rw"  # bind mount mode at /workspace
    network: Literal["none"] = "none"  # only "none" is supported: lo only, no routes
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
            "HOME": "/tmp",
        }
    )  # the whole environment of a command
    argv_allow: list[str] = msgspec.field(default_factory=list)  # allowed argv[0]; empty = any
    interactive: bool = False  # may back a PTY session (with a grant)
