"""Operator process profiles: `profiles/<name>.toml` → a validated, frozen `Profile`.

A profile is the whole of what a sandboxed command may get; requests never add to it
(docs/protocol.md §5). Every field has an explicit default and a one-line comment with its unit.

Loading happens at daemon start and again on a reload (SIGHUP or `profile.reload`,
which keeps the profiles in force when any file fails): `load_profiles` reads every
`*.toml` in the profiles directory, decodes it strictly (TOML → msgspec, no coercion,
unknown keys refused), then checks what a type cannot say (sizes parse, limits are sane,
capabilities exist, the seccomp policy file loads). Any problem is a `ProfileError`
naming the file and the key; it is a configuration error that stops the start (a reload
answers it as `profile_invalid`).

The helpers below (`memory_bytes`, `tmpfs_bytes`, `nano_cpus`, `cpu_quota_us`,
`user_ids`, `capability_mask`, `security_opts`) turn a profile into the numbers the engine
takes and the kernel reports, so containers and confinement facts agree on one reading.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import msgspec

from substrate.egress import allow as egress_allow
from substrate.egress import cabundle, inject_rules
from substrate.egress.npmregistry import NPM_REGISTRY, TOKENS, npm_registry_hosts
from substrate.egress.pipindex import PIP_INDEX, pip_index_hosts
from substrate.errors import ConfinementUnmet, ProfileUnknown, Refusal
from substrate.layer.mounts import passthrough
from substrate.sandbox import seccomp
from substrate.schema.profile import Profile as Profile  # the declared shape; re-exported
from substrate.secrets import NAME_RE as SECRET_NAME_RE
from substrate.workspace.policy import GlobSet


class ProfileError(Exception):
    """A profile file cannot be used as written.

    Raised by `load_profile`/`load_profiles` at daemon start, never on the wire (an unknown
    profile *name* in a request is a refusal, not this). The message names the file and the
    key: `profiles/x.toml: unknown key 'netwrok'`, `profiles/x.toml: $.memory: invalid
    size '1q' ...`.
    """


#: Profile names (file stems): what `profile.get {name}` and `proc.run {profile}` take.
NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
#: The `seccomp` value that means "the engine's own default policy, no file".
ENGINE_DEFAULT = "engine-default"

#: Linux capabilities (linux/capability.h), without the CAP_ prefix → bit in CapEff etc.
CAPABILITIES: dict[str, int] = {
    name: bit
    for bit, name in enumerate(
        [
            "CHOWN",
            "DAC_OVERRIDE",
            "DAC_READ_SEARCH",
            "FOWNER",
            "FSETID",
            "KILL",
            "SETGID",
            "SETUID",
            "SETPCAP",
            "LINUX_IMMUTABLE",
            "NET_BIND_SERVICE",
            "NET_BROADCAST",
            "NET_ADMIN",
            "NET_RAW",
            "IPC_LOCK",
            "IPC_OWNER",
            "SYS_MODULE",
            "SYS_RAWIO",
            "SYS_CHROOT",
            "SYS_PTRACE",
            "SYS_PACCT",
            "SYS_ADMIN",
            "SYS_BOOT",
            "SYS_NICE",
            "SYS_RESOURCE",
            "SYS_TIME",
            "SYS_TTY_CONFIG",
            "MKNOD",
            "LEASE",
            "AUDIT_WRITE",
            "AUDIT_CONTROL",
            "SETFCAP",
            "MAC_OVERRIDE",
            "MAC_ADMIN",
            "SYSLOG",
            "WAKE_ALARM",
            "BLOCK_SUSPEND",
            "AUDIT_READ",
            "PERFMON",
            "BPF",
            "CHECKPOINT_RESTORE",
        ]
    )
}

#: Smallest memory limit the engine accepts (dockerd refuses less than 6 MiB).
MIN_MEMORY_BYTES = 6 << 20
#: Upper bounds that catch typos rather than express policy.
MAX_CPUS = 64.0
MAX_PIDS = 4_194_304  # the kernel's PID_MAX_LIMIT
MAX_ID = 4_294_967_294  # (uid_t)-1 is "no id"
#: Largest profile file read.
MAX_PROFILE_BYTES = 64 << 10

#: How check_profile's helpers report: `fail(key, why)` raises ProfileError.
_Fail = Callable[[str, str], NoReturn]
#: What resolves `@pip-index`: (hosts, why there are none).
PipIndex = Callable[[], tuple[list[str], str | None]]
#: Environment variables substrate sets in an egress sandbox (a profile may not).
EGRESS_ENV = frozenset(
    {
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "no_proxy",
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "PIP_CERT",
        "CURL_CA_BUNDLE",
        "GIT_SSL_CAINFO",
        "NODE_EXTRA_CA_CERTS",
    }
)

log = logging.getLogger("substrate.sandbox.profiles")

_SIZE_RE = re.compile(r"(?P<n>[0-9]{1,19})(?P<unit>[bkmgBKMG]?)")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_USER_RE = re.compile(r"(?P<uid>[0-9]{1,10}):(?P<gid>[0-9]{1,10})")
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_TMPFS_PATH_RE = re.compile(r"(/[A-Za-z0-9._-]{1,255}){1,32}")
_IMAGE_RE = re.compile(r"[a-z0-9][A-Za-z0-9._:/@+-]{0,254}")
#: Mount points a tmpfs may not cover: the workspace and the persistent home
#: (`spec.WORKSPACE_TARGET`, `spec.HOME_TARGET`), kernel interfaces.
_TMPFS_FORBIDDEN = ("/workspace", "/home/agent", "/proc", "/sys", "/dev")
#: At most this many secrets in one profile.
MAX_PROFILE_SECRETS = 64
#: The variable the reaper marks each exec with (`reaper.MARKER`): no profile sets it.
_RESERVED_ENV = frozenset({"SUBSTRATE_PROC"})


def parse_size(s: str) -> int:
    """Bytes in a docker-style size: digits and an optional b, k, m or g (binary units).

    "256m" → 268435456, "1g" → 1073741824, "4096" → 4096. Raises ValueError otherwise
    (fractions, "mb", "1 g", negative numbers, more than 2**63-1 bytes).
    """
    m = _SIZE_RE.fullmatch(s)
    if m is None:
        raise ValueError(f"invalid size {s!r} (digits with an optional b, k, m or g suffix)")
    n = int(m.group("n")) * _UNITS[m.group("unit").lower()]
    if n >= 1 << 63:
        raise ValueError(f"invalid size {s!r} (too large)")
    return n


def memory_bytes(p: Profile) -> int:
    """The memory limit in bytes (the engine's `mem_limit`, the cgroup's limit)."""
    return parse_size(p.memory)


def tmpfs_bytes(p: Profile) -> dict[str, int]:
    """Each tmpfs mount point → its size limit in bytes."""
    return {path: parse_size(size) for path, size in p.tmpfs.items()}


def nano_cpus(p: Profile) -> int:
    """The CPU limit as the engine takes it (`nano_cpus`: billionths of a core)."""
    return round(p.cpus * 1e9)


def cpu_quota_us(p: Profile, period_us: int = 100_000) -> int:
    """The CFS quota the engine derives from `cpus` for a `period_us` period (cgroup v1/v2)."""
    return nano_cpus(p) * period_us // 1_000_000_000


def user_ids(p: Profile) -> tuple[int, int] | None:
    """(uid, gid) for a fixed `user = "UID:GID"`; None for "owner" (decided per workspace)."""
    if p.user == "owner":
        return None
    m = _USER_RE.fullmatch(p.user)
    if m is None:  # load_profile refuses this; a hand-built Profile may still carry it
        raise ValueError(f"invalid user {p.user!r}")
    return int(m.group("uid")), int(m.group("gid"))


def capability_mask(names: list[str] | tuple[str, ...]) -> int:
    """The CapEff/CapBnd bit mask (as in /proc/<pid>/status, hex) of capability names."""
    return sum(1 << CAPABILITIES[n] for n in set(names))


def security_opts(p: Profile, seccomp_dir: Path) -> list[str]:
    """The engine's `security_opt` list for `p`: no-new-privileges and the seccomp policy.

    Reads and validates `seccomp/<p.seccomp>.json` (SeccompError if it went bad since the
    profile was loaded); nothing for "engine-default". Cost: one small file read.
    """
    opts = ["no-new-privileges"] if p.no_new_privileges else []
    if p.seccomp != ENGINE_DEFAULT:
        opts.append(seccomp.security_opt(seccomp.load_seccomp(seccomp_dir / f"{p.seccomp}.json")))
    return opts


def with_secrets(p: Profile, values: Mapping[str, str]) -> Profile:
    """`p` as its commands get it: `env` plus each secret's value under its variable
    (`values`: secret name → value, `SecretStore.load`). Only a sandbox holds the result
    (`Sandbox.profile`), for `process.argv.exec_env`; never serialize it: `profile.get`
    answers from the loaded profiles, which name secrets only."""
    if not p.secrets:
        return p
    added = {var: values[name] for var, name in p.secrets.items()}
    return msgspec.structs.replace(p, env={**p.env, **added})


def checked_security_opts(p: Profile, seccomp_dir: Path) -> list[str]:
    """`security_opts`, for a sandbox about to be made: a policy file that went bad since
    the profile was loaded refuses `confinement_unmet` (nothing may run under it; the
    reason names a host path, so it goes to the log, not to the client)."""
    try:
        return security_opts(p, seccomp_dir)
    except seccomp.SeccompError as exc:
        log.error("profile %s: seccomp policy no longer loads: %s", p.name, exc)
        raise ConfinementUnmet(
            f"the seccomp policy of profile {p.name!r} no longer loads (see the log)",
            required={"seccomp": p.seccomp},
            observed={"seccomp": "invalid"},
        ) from None


def profile_public(p: Profile) -> dict[str, Any]:
    """`p` as `profile.get` returns it: every field, JSON-safe."""
    out: dict[str, Any] = msgspec.to_builtins(p)
    return out


def find_profile(profiles: Mapping[str, Profile], name: str) -> Profile:
    """The profile called `name` among the loaded `profiles`: the one lookup of a profile
    named by a request. Refuses `profile_unknown` (naming the profiles there are)."""
    found = profiles.get(name)
    if found is None:
        raise ProfileUnknown(f"no profile {name!r}", profiles=sorted(profiles))
    return found


_canonical = msgspec.json.Encoder(order="sorted")


def profile_digest(p: Profile, seccomp_dir: Path) -> str:
    """SHA-256 of all a sandbox of `p` is made from: the profile's canonical JSON and,
    unless "engine-default", the bytes of its seccomp policy file (a policy edited in
    place changes the digest). Raises ProfileError when that file cannot be read. Cost:
    one encode and one read of at most 1 MiB."""
    digest = hashlib.sha256(_canonical.encode(p))
    if p.seccomp != ENGINE_DEFAULT:
        policy = seccomp_dir / f"{p.seccomp}.json"
        digest.update(b"\0" + seccomp.read_bounded(policy, seccomp.MAX_POLICY_BYTES, ProfileError))
    return digest.hexdigest()


@dataclass(frozen=True)
class ProfileSet:
    """Profiles as loaded together, with each one's `profile_digest`."""

    profiles: dict[str, Profile]
    digests: dict[str, str]

    def changes(self, before: Mapping[str, str]) -> tuple[list[str], list[str], list[str]]:
        """(added, removed, changed) names against the digests `before`, each sorted."""
        added = sorted(set(self.digests) - set(before))
        removed = sorted(set(before) - set(self.digests))
        changed = sorted(n for n in self.digests if n in before and before[n] != self.digests[n])
        return added, removed, changed


def load_profile_set(profiles_dir: Path, seccomp_dir: Path) -> ProfileSet:
    """`load_profiles` and the digest of each (a reload compares them). Raises
    ProfileError as `load_profiles` does; nothing is kept from a failed load."""
    loaded = load_profiles(profiles_dir, seccomp_dir)
    return ProfileSet(loaded, {n: profile_digest(p, seccomp_dir) for n, p in loaded.items()})


def replace_in_place(current: dict[str, Profile], new: Mapping[str, Profile]) -> None:
    """Make `current` hold exactly `new`. In place, because the execution layer's runner
    and the handlers look profiles up in that very dict; on the event loop, between two
    look-ups, so no reader sees a mix."""
    current.clear()
    current.update(new)


def load_profiles(
    profiles_dir: Path,
    seccomp_dir: Path,
    *,
    pip_index: PipIndex = pip_index_hosts,
    npm_registry: PipIndex = npm_registry_hosts,
) -> dict[str, Profile]:
    """Load every `*.toml` in `profiles_dir` (not recursive), keyed by name.

    Raises ProfileError for a missing directory or any bad file (the first, in name
    order). Other files are ignored. Cost: one read and parse per profile and one per
    distinct seccomp policy they name (and `load_profile`'s `@pip-index` resolution).
    """
    try:
        paths = sorted(e for e in profiles_dir.iterdir() if e.suffix == ".toml")
    except OSError as exc:
        raise ProfileError(f"{profiles_dir}: cannot list: {exc.strerror or exc}") from None
    loaded = (
        load_profile(path, seccomp_dir, pip_index=pip_index, npm_registry=npm_registry)
        for path in paths
    )
    return {p.name: p for p in loaded}


def load_profile(
    path: Path,
    seccomp_dir: Path,
    *,
    pip_index: PipIndex = pip_index_hosts,
    npm_registry: PipIndex = npm_registry_hosts,
) -> Profile:
    """Read, decode and validate one profile file; its name is the file stem.

    Raises ProfileError naming the file and the key for: a stem that is not a valid name,
    unreadable or non-TOML content, unknown keys (and `name`, which is the stem), wrong
    types, and every semantic check in `check_profile`, including a seccomp policy that is
    missing or invalid. The `egress_allow` it returns is normalised and sorted, with
    `@pip-index` replaced by the hosts `pip_index` names and `@npm-registry` by those
    `npm_registry` names (none, and a warning in the log, when the tool's configuration
    cannot be read). Cost: one read of at most 64 KiB, plus the
    seccomp file's, plus `pip_index` (about 0.3 s, cached) when the token is used.
    """
    source = str(path)
    name = path.name.removesuffix(".toml")
    if not NAME_RE.fullmatch(name):
        raise ProfileError(f"{source}: profile name {name!r} must match {NAME_RE.pattern}")
    raw = seccomp.read_bounded(path, MAX_PROFILE_BYTES, ProfileError)
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ProfileError(f"{source}: not valid TOML: {exc}") from None
    if "name" in data:
        raise ProfileError(f"{source}: unknown key 'name' (a profile's name is its file stem)")
    try:
        profile = msgspec.convert({**data, "name": name}, Profile, strict=True)
    except msgspec.ValidationError as exc:
        raise ProfileError(_describe(source, exc)) from None
    check_profile(profile, seccomp_dir, source=source)
    if profile.network == "egress":
        profile = msgspec.structs.replace(
            profile, egress_allow=resolved_allow(profile, pip_index, source, npm_registry)
        )
    return profile


def resolved_allow(
    p: Profile, pip_index: PipIndex, source: str, npm_registry: PipIndex = npm_registry_hosts
) -> list[str]:
    """`p.egress_allow` normalised and sorted, each token replaced by its hosts."""
    entries = [e for e in p.egress_allow if e not in TOKENS]
    for token, resolve in ((PIP_INDEX, pip_index), (NPM_REGISTRY, npm_registry)):
        if token not in p.egress_allow:
            continue
        hosts, why = resolve()
        if why is not None:
            log.warning("%s: %s allows nothing: %s", source, token, why)
        entries += hosts
    return list(egress_allow.AllowList.of(entries).entries)


def check_profile(p: Profile, seccomp_dir: Path, *, source: str) -> None:
    """The checks a type cannot express; raises ProfileError(`source: $.key: why`).

    Reads `seccomp_dir/<p.seccomp>.json` unless it is "engine-default".
    """

    def fail(key: str, why: str) -> NoReturn:
        raise ProfileError(f"{source}: $.{key}: {why}")

    if not NAME_RE.fullmatch(p.name):
        fail("name", f"must match {NAME_RE.pattern}")
    if "\n" in p.description or "\x00" in p.description or len(p.description) > 200:
        fail("description", "one line of at most 200 characters")
    if not _IMAGE_RE.fullmatch(p.image):
        fail("image", f"not a local image reference: {p.image!r}")
    _check_user(p, fail)
    try:
        if memory_bytes(p) < MIN_MEMORY_BYTES:
            fail("memory", f"below the engine's minimum of 6m: {p.memory!r}")
    except ValueError as exc:
        fail("memory", str(exc))
    _check_tmpfs(p, fail)
    if not (math.isfinite(p.cpus) and 0 < p.cpus <= MAX_CPUS):
        fail("cpus", f"must be more than 0 and at most {MAX_CPUS:g}")
    if not 1 <= p.pids <= MAX_PIDS:
        fail("pids", f"must be 1..{MAX_PIDS}")
    if not (math.isfinite(p.timeout_s) and p.timeout_s > 0):
        fail("timeout_s", "must be a positive number of seconds")
    if p.max_output_bytes < 0:
        fail("max_output_bytes", "must be 0 or more")
    _check_capabilities(p, fail)
    if p.workspace == "layer" and p.runtime != "runc":
        # The layer is mounted on the host and reaches the container by mount
        # propagation, which gVisor's gofer does not follow.
        fail(
            "workspace",
            '"layer" (the default) needs runtime "runc"; say workspace = "rw", "ro" or "none"',
        )
    if p.passthrough and p.workspace != "layer":
        fail("passthrough", 'only a "layer" workspace has passthrough directories')
    passthrough.check_declared(p.passthrough, fail)
    if p.symlinks != "any" and p.workspace != "layer":
        # A sandbox writing the checkout itself makes its links there: nothing applies
        # them, so a narrower setting would promise what it cannot keep.
        fail(
            "symlinks",
            'only a "layer" workspace applies symlinks: say "any" or workspace = "layer"',
        )
    for key, value in p.env.items():
        if not _ENV_KEY_RE.fullmatch(key):
            fail(f"env.{key}", "not a valid environment variable name")
        if "\x00" in value:
            fail(f"env.{key}", "NUL in value")
    _check_secrets(p, fail)
    for i, arg0 in enumerate(p.argv_allow):
        if not arg0 or "\x00" in arg0:
            fail(f"argv_allow[{i}]", "empty or containing NUL")
    _check_egress(p, fail)
    _check_git(p, fail)
    _check_seccomp(p, seccomp_dir, fail)


#: What `git_identity` sets in every command's environment (over `env`).
GIT_IDENTITY_ENV = (
    "GIT_AUTHOR_NAME",
    "GIT_AUTHOR_EMAIL",
    "GIT_COMMITTER_NAME",
    "GIT_COMMITTER_EMAIL",
)
#: At most this many `git_refs_allow` globs.
MAX_GIT_REFS_ALLOW = 64


def _check_git(p: Profile, fail: _Fail) -> None:
    """`git_refs_allow` (globs that compile, under `refs/`) and `git_identity` (no
    control character, `<` or `>` that would forge a commit header)."""
    if len(p.git_refs_allow) > MAX_GIT_REFS_ALLOW:
        fail("git_refs_allow", f"at most {MAX_GIT_REFS_ALLOW} globs")
    for i, glob in enumerate(p.git_refs_allow):
        if not glob.startswith("refs/"):
            fail(f"git_refs_allow[{i}]", "a glob over ref names, starting with refs/")
    try:
        GlobSet.of(p.git_refs_allow)
    except Refusal as exc:
        fail("git_refs_allow", str(exc))
    ident = p.git_identity
    if bool(ident.name) != bool(ident.email):
        fail("git_identity", "name and email both, or neither")
    for key in ("name", "email"):
        value = getattr(ident, key)
        if len(value) > 256 or any(c in value for c in "<>\n\r\x00"):
            fail(f"git_identity.{key}", "at most 256 characters, no <, >, newline or NUL")


def git_env(p: Profile) -> dict[str, str]:
    """The variables `git_identity` sets in every command's environment (none without)."""
    ident = p.git_identity
    if not ident.name:
        return {}
    name, email = GIT_IDENTITY_ENV[0::2], GIT_IDENTITY_ENV[1::2]
    return {**dict.fromkeys(name, ident.name), **dict.fromkeys(email, ident.email)}


def _check_egress(p: Profile, fail: _Fail) -> None:
    """`network`, `egress_allow`, `ca_bundle` and the environment they own."""
    if p.network != "egress":
        if p.egress_allow:
            fail("egress_allow", 'only a network = "egress" profile has a way out')
        if p.ca_bundle:
            fail("ca_bundle", 'only a network = "egress" profile mounts a CA bundle')
        if p.egress_inject:
            fail("egress_inject", 'only a network = "egress" profile has a proxy to inject')
        return
    if p.runtime != "runc":
        # The proxy listens inside the sandbox's network namespace; gVisor's netstack
        # is its own, where no host socket appears.
        fail("network", '"egress" needs runtime "runc"')
    if len(p.egress_allow) > egress_allow.MAX_ENTRIES:
        fail("egress_allow", f"more than {egress_allow.MAX_ENTRIES} entries")
    for i, entry in enumerate(p.egress_allow):
        if entry in TOKENS:
            continue
        try:
            egress_allow.parse_entry(entry)
        except ValueError as exc:
            fail(f"egress_allow[{i}]", str(exc))
    if p.ca_bundle:
        try:
            cabundle.read_bundle(cabundle.bundle_path(p.ca_bundle))
        except ValueError as exc:
            fail("ca_bundle", str(exc))
    for key in p.env:
        if key in EGRESS_ENV:
            fail(f"env.{key}", "substrate sets it in an egress sandbox (docs/egress.md)")
    problem = inject_rules.problem(p.egress_inject, p.egress_allow, ca_bundle=p.ca_bundle)
    if problem is not None:
        fail(*problem)


def _check_user(p: Profile, fail: _Fail) -> None:
    if p.user == "owner":
        return
    m = _USER_RE.fullmatch(p.user)
    if m is None:
        fail("user", f'must be "owner" or "UID:GID" with numeric ids, not {p.user!r}')
    uid, gid = int(m.group("uid")), int(m.group("gid"))
    if uid > MAX_ID or gid > MAX_ID:
        fail("user", f"ids must be 0..{MAX_ID}")
    if uid == 0 and not p.allow_root:
        fail("user", "runs as root; set allow_root = true to mean it")


def _check_secrets(p: Profile, fail: _Fail) -> None:
    """Variable names as `env`'s, none also in `env` (which value would win?), secret
    names as `substrate secret set` takes them. Whether they are set is checked when the
    profile's sandbox loads them (`secret_unknown`), not here: a secret may be set later."""
    if len(p.secrets) > MAX_PROFILE_SECRETS:
        fail("secrets", f"at most {MAX_PROFILE_SECRETS} secrets")
    for key, name in p.secrets.items():
        if not _ENV_KEY_RE.fullmatch(key) or key in _RESERVED_ENV:
            fail(f"secrets.{key}", "not a valid environment variable name")
        if key in p.env:
            fail(f"secrets.{key}", "also set in env; a variable comes from one place")
        if not SECRET_NAME_RE.fullmatch(name):
            fail(f"secrets.{key}", f"a secret name must match {SECRET_NAME_RE.pattern}")


def _check_tmpfs(p: Profile, fail: _Fail) -> None:
    for path, size in p.tmpfs.items():
        key = f"tmpfs.{path!r}"
        parts = path.split("/")[1:]
        if not _TMPFS_PATH_RE.fullmatch(path) or any(c in (".", "..") for c in parts):
            fail(key, "must be an absolute, normalised path of [A-Za-z0-9._-] components")
        if path != "/dev/shm" and any(
            path == f or path.startswith(f + "/") for f in _TMPFS_FORBIDDEN
        ):
            fail(
                key, "may not cover /workspace, /home/agent, /proc, /sys or /dev (except /dev/shm)"
            )
        try:
            if parse_size(size) == 0:
                fail(key, "size 0 would mean unlimited")
        except ValueError as exc:
            fail(key, str(exc))


def _check_capabilities(p: Profile, fail: _Fail) -> None:
    seen: set[str] = set()
    for i, cap in enumerate(p.capabilities):
        if cap in seen:
            fail(f"capabilities[{i}]", f"{cap!r} listed twice")
        seen.add(cap)
        if cap in CAPABILITIES:
            continue
        hint = cap.upper().removeprefix("CAP_")
        extra = f" (write {hint!r})" if hint in CAPABILITIES else ""
        fail(f"capabilities[{i}]", f"unknown capability {cap!r}{extra}")


def _check_seccomp(p: Profile, seccomp_dir: Path, fail: _Fail) -> None:
    if p.seccomp == ENGINE_DEFAULT:
        return
    if not seccomp.NAME_RE.fullmatch(p.seccomp):
        fail("seccomp", f'"{ENGINE_DEFAULT}" or a policy name in {seccomp_dir}, not {p.seccomp!r}')
    if p.runtime == "runsc":
        # runsc applies no OCI seccomp policy unless started with --oci-seccomp, and the
        # packaged one then ignores errnoRet (clone3 → EPERM breaks glibc's threads).
        fail(
            "seccomp", f'runtime "runsc" does not enforce seccomp policies; use "{ENGINE_DEFAULT}"'
        )
    policy = seccomp_dir / f"{p.seccomp}.json"
    if not policy.is_file():
        fail("seccomp", f"no policy file {policy}")
    try:
        seccomp.load_seccomp(policy)
    except seccomp.SeccompError as exc:
        fail("seccomp", f"policy {p.seccomp!r} is invalid: {exc}")


_UNKNOWN_RE = re.compile(r"Object contains unknown field `(?P<field>[^`]*)`.*")
_AT_RE = re.compile(r"(?P<msg>.*?) - at `(?P<at>[^`]*)`")


def _describe(source: str, exc: msgspec.ValidationError) -> str:
    """msgspec's message, reworded: `source: unknown key 'x'` / `source: $.key: message`."""
    text = str(exc)
    m = _UNKNOWN_RE.fullmatch(text)
    if m:
        return f"{source}: unknown key '{m.group('field')}'"
    m = _AT_RE.fullmatch(text)
    if m:
        return f"{source}: {m.group('at')}: {m.group('msg')}"
    return f"{source}: {text}"
