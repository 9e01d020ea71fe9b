"""Confinement facts in results: a digest and a short summary, in full only when asked.

Results that are easy to feed to a model: the confinement facts as a digest and a
short summary, in full only when asked (docs/protocol.md §5 "Facts in results").

A command's result used to carry its sandbox's whole fact list (about 3.4 KB of a 3.8 KB
`true` result). The list is the same for every command of one container, and the
record keeps it, so a reply carries by default only `facts_digest` (the SHA-256 of the
list's compact JSON encoding: the key under which the record stores the set, equal for
every command of one container) and `facts_summary` (`FactsSummary`: runtime, ids,
seccomp, capabilities, network, workspace; about 200 bytes). `facts: "full"` on
`proc.run`, `proc.wait`, `proc.status` or `proc.subscribe` adds the list itself.

Where: results are kept whole (records, `Entry.result`); the handlers shape each reply
with `shaped` as they answer. Pure; the cost is one JSON encoding and one SHA-256 of
the list (microseconds).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TypeVar

import msgspec

from substrate.schema.facts import Fact, FactValue
from substrate.schema.proc import FactsMode, FactsSummary, ProcResult, ProcStatus

__all__ = ["facts_digest", "shaped", "summarize"]

#: /proc/<pid>/status `Seccomp:` modes, as the summary names them.
SECCOMP_MODES = {0: "none", 1: "strict", 2: "filter"}

R = TypeVar("R", ProcResult, ProcStatus)


def facts_digest(facts: Sequence[Fact]) -> str:
    """SHA-256 (hex) of the facts' compact JSON encoding, fields in the order name, value,
    source, observed_at: what `ProcessRecords` keys the set by."""
    return hashlib.sha256(msgspec.json.encode(list(facts))).hexdigest()


def summarize(facts: Sequence[Fact], exec_facts: Sequence[Fact] = ()) -> FactsSummary:
    """The few fields a reader (or a model) needs of a fact list (and whether the
    command's own process was observed: `exec_facts`); see `FactsSummary`."""
    seen: dict[str, FactValue] = {f.name: f.value for f in facts}
    runtime = _str(seen.get("runtime"))
    caps = seen.get("cap_bnd")
    return FactsSummary(
        verified=bool(facts),
        count=len(facts),
        runtime=runtime,
        uid=_int(seen.get("uid")),
        gid=_int(seen.get("gid")),
        seccomp=_seccomp(seen, runtime),
        capabilities=len(caps) if isinstance(caps, list) else None,
        no_new_privs=_bool(seen.get("no_new_privs")),
        rootfs_readonly=_bool(seen.get("rootfs_readonly")),
        network=_network(seen),
        workspace=_str(seen.get("workspace_mount")),
        exec_checked=bool(exec_facts),
    )


def shaped(result: R, mode: FactsMode) -> R:
    """`result` as a reply: `facts_digest` and `facts_summary` set from its `facts`, and
    `facts` and `exec_facts` (the command's own process, fast exec) kept only in "full"
    mode. A result without facts (`{proc, state}`, a running command's status) is
    returned unchanged."""
    facts = result.facts
    if facts is None:
        return result
    own = result.exec_facts or []
    full = mode == "full"
    # A result's `exec_facts` is a list (empty: left out), a status's None when left out.
    kept = own if full else []
    return msgspec.structs.replace(
        result,
        facts=facts if full else None,
        exec_facts=kept if isinstance(result, ProcResult) else kept or None,
        facts_digest=facts_digest(facts),
        facts_summary=summarize(facts, own),
    )


def _seccomp(seen: dict[str, FactValue], runtime: str | None) -> str | None:
    if runtime == "runsc":
        # The command is inside the sandbox kernel; the host sees the Sentry's filter.
        return "filter" if seen.get("sandbox_oci_seccomp") is True else "sentry"
    mode = _int(seen.get("seccomp_mode"))
    return None if mode is None else SECCOMP_MODES.get(mode, str(mode))


def _network(seen: dict[str, FactValue]) -> str | None:
    if "egress_allow_digest" in seen:
        return "egress"
    links, routes = seen.get("net_links"), seen.get("net_routes")
    if links is None:
        return None
    return "none" if links == ["lo"] and not routes else "open"


def _str(value: FactValue) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: FactValue) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _bool(value: FactValue) -> bool | None:
    return value if isinstance(value, bool) else None
