"""Confinement facts on the wire: one observation of one setting (docs/protocol.md §5).

The comparison of required and observed facts is the sandbox's (`substrate.sandbox.facts`);
this is only the shape results and the journal carry.
"""

from __future__ import annotations

import msgspec

#: A fact's value: what msgspec encodes and the journal stores.
FactValue = str | int | float | bool | list[str] | None


class Fact(msgspec.Struct, frozen=True, kw_only=True):
    """One observation: `value` of `name`, read from `source` at `observed_at` (unix time).

    `source` names the kind of source and a stable id, never a host path or pid:
    "kernel:proc-status", "kernel:mountinfo", "kernel:proc-cgroup",
    "kernel:proc-ns-user", "kernel:proc-cmdline", "kernel:gofer-mountinfo",
    "kernel:lstat" (the workspace identities), "cgroup:<file>" ("cgroup:memory.max",
    "cgroup:pids.max", ...), "netns:rtnetlink", "engine:inspect",
    "engine:inspect+kernel:mountinfo", and for egress sandboxes "kernel:proc-net-tcp",
    "kernel:proc-root", "egress:proxy"; a failed read appends its reason ("(ENOENT)").
    """

    name: str
    value: FactValue
    source: str
    observed_at: float
