"""What did not land, named in the journal: a change set's `changes.blocked` entries
(docs/working-layer.md, "Journal"; docs/protocol.md §8).

Theory of operation. A change set's summary entry (`changes.applied`, `changes.kept`,
`changes.recovered`) counts what became of its changes; an operator also needs to see
*which* paths did not land and why. `drafts` makes one `changes.blocked` entry per path
that did not land — blocked by the policy, the scan or the passthrough walk, pending
approval, or in conflict (the host's edit kept) — naming the path (`root_id:relative/path`), its `op` and `kind`,
its `outcome`, the `reason` (a refusal name or the scan's reason), the policy `rule` and,
for a pending change, the `plan_digest` an operator grants. Never bytes, and never a
digest of the command's bytes: a denied path (a `.env`) may hold a secret, and a digest
of a short secret confirms a guess of it. The caller appends them in the transaction of
the set's summary entry, so the journal never holds one without the other.

Bounded: at most `MAX_NAMED` paths per act; past that one more entry carries how many of
each outcome were left unnamed (`more`), whatever the set's size. `without_denied_previews`
keeps the preview of a denied path's bytes out of the kept set (the state database) for
the same reason. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any, Literal

import msgspec

from substrate.layer.changes.apply import ApplyResult, Outcomes
from substrate.layer.changes.changeset import Blocked, ChangeSet
from substrate.store.journal import Draft
from substrate.workspace.policy import CompiledPolicy

KIND = "changes.blocked"
#: At most this many paths named per set and act (an apply, a review, a recovery); the
#: rest are counted in one more entry. The results' lists have the same bound.
MAX_NAMED = 1000
#: A scan's reason that the result lists as a conflict: the host changed the file.
HOST_CHANGED = "host_changed"
#: The rule of what the passthrough walk found (`layer.mounts.passthrough_scan`).
PASSTHROUGH = "passthrough"

Outcome = Literal["blocked", "pending", "conflict"]


def _display(rel: str) -> str:
    """A name read from the disk carries bytes that are not UTF-8 as surrogates: they are
    journaled `\\xNN` (docs/protocol.md §8)."""
    return rel.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


#: One path that did not land, as its list holds it: an apply's outcome, a scan's block,
#: or a passthrough finding `(path, reason)`.
_Source = Outcomes | Blocked | tuple[str, str]


def _named(
    result: ApplyResult, scanned: Iterable[Blocked], found: Iterable[tuple[str, str]]
) -> Iterator[tuple[Outcome, _Source]]:
    """Each path that did not land, in the result's order: the policy's blocks, the
    scan's, the passthrough walk's, the pending changes, then the conflicts (the host's
    edits last). Nothing is built here: past the cap a path is only counted."""
    held: list[Blocked] = []
    yield from (("blocked", o) for o in result.blocked)
    for b in scanned:
        if b.reason == HOST_CHANGED:
            held.append(b)
        else:
            yield "blocked", b
    yield from (("blocked", f) for f in found)
    yield from (("pending", o) for o in result.pending)
    yield from (("conflict", o) for o in result.conflicts)
    yield from (("conflict", b) for b in held)


def _fields(source: _Source) -> dict[str, Any]:
    """`path`, `op`, `kind`, `reason`, `rule`, `plan_digest` of one path."""
    match source:
        case Outcomes():
            return {
                "path": source.path,
                "op": source.op,
                "kind": source.kind,
                "reason": source.reason,
                "rule": source.rule,
                "plan_digest": source.plan_digest if source.outcome == "pending" else None,
            }
        case Blocked():
            kind: str | None = source.kind
            path, reason, rule = source.path, source.reason, None
        case (path, reason):
            kind, rule = None, PASSTHROUGH
    return {
        "path": path,
        "op": None,
        "kind": kind,
        "reason": reason,
        "rule": rule,
        "plan_digest": None,
    }


def drafts(
    root_id: str,
    workspace: str,
    actor: str,
    changeset: str | None,
    generation: int,
    result: ApplyResult,
    scanned: Iterable[Blocked] = (),
    found: Iterable[tuple[str, str]] = (),
) -> list[Draft]:
    """The `changes.blocked` entries of set `changeset` (of `generation`; None: the
    generation kept no set): one per path of `result` (an apply's outcomes), `scanned`
    (the set's own blocked list: the scan's refusals and the host's edits) and `found`
    (`(path, reason)` of the passthrough walk: rule `passthrough`) that did not land, at
    most `MAX_NAMED`, then one with the counts of the rest (`more`, and per outcome).
    Each holds `changeset`, `generation`, `path` (`root_id:relative/path`), `op` (null
    for what the scan or the walk blocked), `kind`, `outcome` (`blocked`, `pending`,
    `conflict`), `reason`, `rule` (null when no policy rule) and `plan_digest` (a
    pending change's, else null). Costs a dict per path named; past them, a look at
    each scanned block's reason."""
    scanned, found = tuple(scanned), tuple(found)
    held = sum(1 for b in scanned if b.reason == HOST_CHANGED)
    rest = {  # what is left unnamed, counted down as paths are named
        "blocked": len(result.blocked) + len(scanned) - held + len(found),
        "pending": len(result.pending),
        "conflict": len(result.conflicts) + held,
    }
    out: list[Draft] = []
    for outcome, source in islice(_named(result, scanned, found), MAX_NAMED):
        rest[outcome] -= 1
        fields = _fields(source)
        data = {
            "changeset": changeset,
            "generation": generation,
            "path": f"{root_id}:{_display(fields['path'])}",
            "op": fields["op"],
            "kind": fields["kind"],
            "outcome": outcome,
            "reason": fields["reason"],
            "rule": fields["rule"],
            "plan_digest": fields["plan_digest"],
        }
        out.append(Draft(KIND, data, workspace, actor))
    more = sum(rest.values())
    if more:
        counted = {"changeset": changeset, "generation": generation, "more": more, **rest}
        out.append(Draft(KIND, counted, workspace, actor))
    return out


def without_denied_previews(changeset: ChangeSet, policy: CompiledPolicy) -> ChangeSet:
    """`changeset` with no diff preview (`diff` empty, `diff_truncated`) for a path
    `policy` does not let be written: it never lands, and its bytes (a secret in a
    `.env`) stay in the layer only, never in the state database where the kept set is
    recorded. Pure; the set itself when no change is denied."""
    changes = tuple(
        c
        if not c.diff or policy.may_write(c.path)
        else msgspec.structs.replace(c, diff="", diff_truncated=True)
        for c in changeset.changes
    )
    if all(a is b for a, b in zip(changes, changeset.changes, strict=True)):
        return changeset
    return msgspec.structs.replace(changeset, changes=changes)
