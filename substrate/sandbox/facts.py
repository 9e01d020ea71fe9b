"""Confinement facts: what a profile requires, and the comparison with what was observed.
Pure: no I/O, no clock (`substrate.sandbox.observe` does the reading, with the parsers of
`substrate.sandbox.parsers`).

Theory of operation. Every confinement setting of a profile becomes a *required fact*, a
name and a JSON value (`required_facts`). Before the first command runs in a container,
`substrate.sandbox.observe` reads the same names from outside the container — procfs, cgroups,
the network namespace, the engine's inspect — as `Fact`s carrying their source and time.
`compare` lists every required fact whose observation is missing or different; any
`Mismatch` is `confinement_unmet` and nothing runs.

Under runc the container's processes are host processes, so the kernel shows the
command's own credentials, capabilities, seccomp mode and mounts. Under runsc (gVisor) the
host pid is the sandbox (the Sentry), which runs under its own seccomp filter, as nobody,
in its own user namespace; the command's credentials and mounts live inside the Sentry and
the host kernel cannot show them. There those facts come from the engine ("what runsc was
told"), and `sandbox_*` facts describe the sandbox process itself. docs/confinement.md
lists each fact, its source per runtime, and what is not observable.

Comparison: capabilities, links and tmpfs mounts compare as sets; `readonly_dirs` is met
when every required directory is read-only (more is fine); `memory_limit` allows the
kernel's rounding down to its page size; `cpu_quota` allows 0.001 core; everything else is
exact, and a bool never equals an int.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from substrate.egress.allow import AllowList
from substrate.sandbox import profiles
from substrate.sandbox.profiles import Profile
from substrate.sandbox.spec import PROXY_HOST, PROXY_PORT
from substrate.schema.facts import Fact as Fact  # the wire shape; re-exported
from substrate.schema.facts import FactValue as FactValue

#: Seccomp modes of /proc/<pid>/status: 0 disabled, 1 strict, 2 filter.
SECCOMP_FILTER = 2
#: The kernel rounds a memory limit down to its page size (64 KiB on the largest pages).
MEMORY_SLACK = 64 << 10
#: tmpfs sizes are whole pages; required sizes are rounded up to this before comparing.
TMPFS_PAGE = 4096

# Facts whose values are lists compared as sets.
_SET_FACTS = frozenset(
    {
        "cap_eff",
        "cap_prm",
        "cap_bnd",
        "cap_amb",
        "net_links",
        "tmpfs",
        "net_routes",
        "egress_listeners",
        "egress_inject",
    }
)
#: An egress sandbox's one listening socket: the proxy's, held by the daemon.
EGRESS_LISTENER = f"{PROXY_HOST}:{PROXY_PORT}=substrate"


class Mismatch(msgspec.Struct, frozen=True):
    """A required fact that was not observed (`observed` None, `source` "") or differs."""

    name: str
    required: FactValue
    observed: FactValue
    source: str = ""


# -- required -----------------------------------------------------------------------------


def required_facts(
    profile: Profile,
    *,
    run_uid: int,
    run_gid: int,
    workspace_mode: str,
    readonly_dirs: Sequence[str],
    seccomp_expected: bool,
    image_id: str | None = None,
    security_opt: Sequence[str] | None = None,
) -> dict[str, FactValue]:
    """Every confinement setting of `profile` as required facts (name → value).

    `run_uid`/`run_gid`: who the command runs as (docs/protocol.md §5 "Who runs"). `workspace_mode`:
    "rw" | "ro" | "none" | "layer". `readonly_dirs`: workspace-relative directories mounted
    read-only over an "rw" or "layer" workspace (for "layer", read-only superblocks). `seccomp_expected`: the command itself must be under
    the profile's seccomp filter *inside a runsc sandbox* (`sandbox_oci_seccomp`: runsc
    applies OCI filters only with `--oci-seccomp`); under runc the filter is always
    required (`seccomp_mode` 2, strict and engine-default alike), and the Sentry's own
    filter is always required under runsc. `image_id`: the engine-resolved image id the
    container must run, when the caller has it. `security_opt`: the engine options the
    container is created with (`profiles.security_opts`); given, the engine must hold
    exactly that seccomp policy (`seccomp_policy`, a digest: the kernel shows only that
    *a* filter is on, so the engine is the witness of *which*). Raises ValueError for a
    profile whose sizes do not parse (load_profile refuses those). Cost: microseconds.
    """
    kept = sorted({c.upper().removeprefix("CAP_") for c in profile.capabilities})
    req: dict[str, FactValue] = {
        "runtime": profile.runtime,
        "privileged": False,
        # The engine's network is "none" for an egress profile too: its way out is the
        # daemon's listener inside the namespace (`egress_required`).
        "network_mode": "none",
        "docker_socket_absent": True,
        "docker_host_unset": True,
        "memory_limit": profiles.memory_bytes(profile),
        "pids_limit": profile.pids,
        "cpu_quota": float(profile.cpus),
        "net_links": ["lo"],
        "net_routes": [],
        "no_new_privs": profile.no_new_privileges,
        "cap_bnd": kept,
        "uid": run_uid,
        "gid": run_gid,
        "rootfs_readonly": profile.read_only_rootfs,
        "workspace_mount": "absent" if workspace_mode == "none" else workspace_mode,
        "readonly_dirs": sorted(_norm_rel(d) for d in readonly_dirs)
        if workspace_mode in ("rw", "layer")
        else [],
        "tmpfs": sorted(
            f"{path}={tmpfs_pages(size)}" for path, size in profiles.tmpfs_bytes(profile).items()
        ),
    }
    if image_id is not None:
        req["image_id"] = image_id
    if security_opt is not None:
        req["seccomp_policy"] = seccomp_policy_of(security_opt)
    elif profile.seccomp == profiles.ENGINE_DEFAULT:
        req["seccomp_policy"] = profiles.ENGINE_DEFAULT
    if profile.runtime == "runsc":
        # The Sentry is what the host kernel sees: it must itself be locked down.
        req["sandbox_no_new_privs"] = True
        req["sandbox_seccomp_mode"] = SECCOMP_FILTER
        req["sandbox_userns"] = True
        req["sandbox_network"] = profile.network
        if seccomp_expected:
            req["sandbox_oci_seccomp"] = True
    else:
        # A non-root command keeps no effective or permitted capability (execve clears
        # them); the bounding set is what it could ever regain, so it is the kept set.
        effective = kept if run_uid == 0 else []
        req["cap_eff"] = effective
        req["cap_prm"] = effective
        req["cap_amb"] = []
        req["seccomp_mode"] = SECCOMP_FILTER
    return req


def egress_required(
    profile: Profile, *, ca_bundle: str | None, egress_ca: str | None = None
) -> dict[str, FactValue]:
    """What an egress sandbox must show besides `required_facts` ({} for "none"): its
    proxy enforces exactly the profile's allow-list (`egress_allow_digest`), the only
    listening socket in its namespace is the daemon's (`egress_listeners`), with a
    CA bundle (`ca_bundle`: its digest) the file it sees is that bundle, and with
    `egress_inject` the proxy injects for exactly those hosts (names only) with the
    sandbox's own CA (`egress_ca`: its fingerprint). Pure; raises ValueError for an
    entry `load_profile` would have refused."""
    if profile.network != "egress":
        return {}
    req: dict[str, FactValue] = {
        "egress_allow_digest": AllowList.of(profile.egress_allow).digest,
        "egress_listeners": [EGRESS_LISTENER],
    }
    if ca_bundle is not None:
        req["ca_bundle"] = ca_bundle
    if profile.egress_inject:
        req["egress_inject"] = sorted(profile.egress_inject)
        req["egress_ca"] = egress_ca
    return req


def _norm_rel(rel: str) -> str:
    return "/".join(p for p in rel.split("/") if p and p != ".")


def tmpfs_pages(n: int) -> int:
    """`n` bytes rounded up to whole tmpfs pages (what the kernel will report)."""
    return -(-n // TMPFS_PAGE) * TMPFS_PAGE


# -- comparison ---------------------------------------------------------------------------


def make_fact(name: str, value: FactValue, *, source: str, observed_at: float = 0.0) -> Fact:
    """A `Fact`; `observed_at` 0.0 when the caller has no clock reading (pure callers)."""
    return Fact(name=name, value=value, source=source, observed_at=observed_at)


def compare(
    required: Mapping[str, FactValue] | Iterable[Fact], observed: Sequence[Fact]
) -> list[Mismatch]:
    """Required facts that the observations do not meet, in the order required.

    `required` is `required_facts`' mapping, or Facts (their values are what is required).
    A required name with no observation is a mismatch with `observed` None. When a name is
    observed twice, the last observation counts. Cost: linear in the facts.
    """
    wanted = (
        dict(required.items())
        if isinstance(required, Mapping)
        else {f.name: f.value for f in required}
    )
    seen = {f.name: f for f in observed}
    out: list[Mismatch] = []
    for name, want in wanted.items():
        fact = seen.get(name)
        if fact is None:
            out.append(Mismatch(name, want, None, ""))
        elif not _meets(name, want, fact.value):
            out.append(Mismatch(name, want, fact.value, fact.source))
    return out


def _meets(name: str, want: FactValue, got: FactValue) -> bool:
    if got is None:
        return want is None
    if name == "readonly_dirs" and isinstance(want, list) and isinstance(got, list):
        return set(want) <= set(got)
    if name in _SET_FACTS and isinstance(want, list) and isinstance(got, list):
        return set(want) == set(got)
    if isinstance(want, bool) or isinstance(got, bool):
        return isinstance(want, bool) and isinstance(got, bool) and want == got
    if name == "memory_limit" and isinstance(want, int) and isinstance(got, int):
        return want - MEMORY_SLACK < got <= want
    if isinstance(want, float) and isinstance(got, int | float):
        return math.isclose(want, float(got), abs_tol=1e-3)
    return type(want) is type(got) and want == got


def mismatch_name(m: Mismatch) -> str:
    """The label of a mismatch in a message (the fact's name; values go in the data)."""
    return m.name


def mismatch_report(mismatches: Sequence[Mismatch]) -> dict[str, Any]:
    """`{required: {name: value}, observed: {name: value}}` for `ConfinementUnmet` data."""
    return {
        "required": {m.name: m.required for m in mismatches},
        "observed": {m.name: m.observed for m in mismatches},
    }


def seccomp_policy_of(security_opt: Iterable[str]) -> str:
    """Which seccomp policy engine options ask for: "engine-default", "unconfined",
    "sha256:<digest of the canonical JSON>" or "invalid" (unparsable JSON). Pure."""
    found = profiles.ENGINE_DEFAULT
    for opt in security_opt:
        key, sep, value = opt.partition("=")
        if not sep:
            key, sep, value = opt.partition(":")
        if key != "seccomp" or not sep:
            continue
        if value == "unconfined":
            found = "unconfined"
            continue
        try:
            doc = json.loads(value)
        except ValueError:
            found = "invalid"
            continue
        canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        found = "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
    return found
