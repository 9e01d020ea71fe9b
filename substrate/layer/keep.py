"""What a layer command's change set leaves behind: conflicts' versions, the kept-set cap.

What a layer command's change set leaves behind (docs/working-layer.md, "Conflicts"
and "Cleanup"): its conflicts' versions as artifacts, the cap on sets kept per
workspace, and the wire entries that report both.

- `ArtifactKeeper` copies a conflict's version (a file in the set's upper layer) into
  the artifact store as one artifact, `proc` = the change set's id, `stream` =
  "conflict", through an `OutputSink` like command output: spooled, hashed and moved
  to its content address, never held in memory whole. `layer.changes.Changesets`
  calls it; the artifact store (above this package) is reached as `Artifacts`, a
  Protocol `substrate.artifacts.store.ArtifactStore` satisfies.
- `check_room` refuses a command that could keep one more set when its workspace keeps
  `max_kept_changesets` already (`limit_exceeded`, `scope: "kept_changesets"`): before
  anything runs, so nothing of an agent's is lost; "discard" runs keep nothing and
  always pass.
- `entries` are the wire `ChangeEntry`s of outcomes: the command's `size`/`mode` and,
  for a conflict, its version's `artifact` (or `artifact_reason` and `kept`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Protocol

from substrate.errors import LimitExceeded
from substrate.layer.changes import Changesets, Outcomes
from substrate.layer.changes.versions import Versions, needs_version
from substrate.schema.artifact import OutputRef
from substrate.schema.changes import Change, KeptVersion
from substrate.schema.proc import ChangeEntry, ChangesMode

#: The artifact `stream` of a conflict's version.
CONFLICT_STREAM = "conflict"
_CHUNK = 1 << 20


class Sink(Protocol):
    """One artifact being written: spooled, hashed, and stored by `close`."""

    def write(self, data: bytes) -> None: ...

    def close(self) -> OutputRef: ...


class Artifacts(Protocol):
    """Where conflicts' versions are kept (`substrate.artifacts.store.ArtifactStore`)."""

    def open_sink(self, proc: str, stream: str, inline_limit: int, max_bytes: int) -> Sink:
        """A new spool for one stream of `proc`."""
        ...


class ArtifactKeeper:
    """`layer.changes.versions.FileKeeper` over the artifact store."""

    def __init__(self, artifacts: Artifacts) -> None:
        self._artifacts = artifacts

    def keep_file(self, fd: int, size: int, owner: str) -> tuple[str, str] | None:
        """Copy the first `size` bytes of `fd` into a new artifact of `owner`; its (id,
        sha256), or None when fewer bytes were there or the disk refused some (what was
        stored stays an artifact, collected like any other). Costs two file creations,
        a pass over the bytes in 1 MiB reads and one commit."""
        sink = self._artifacts.open_sink(owner, CONFLICT_STREAM, 0, size)
        try:
            offset = 0
            while offset < size:
                block = os.pread(fd, min(_CHUNK, size - offset), offset)
                if not block:
                    break
                sink.write(block)
                offset += len(block)
        finally:
            ref = sink.close()
        if ref.artifact is None or ref.truncated or ref.bytes != size:
            return None
        return ref.artifact, ref.sha256


def check_room(changesets: Changesets, workspace: str, mode: ChangesMode, cap: int) -> None:
    """Refuse `limit_exceeded` (`limit`, `scope: "kept_changesets"`, `kept`) when a
    command in `mode` could keep one more set and `workspace` keeps `cap` already.
    Commands running at once each pass before any ends, so the count may pass `cap` by
    at most the commands running then (`max_processes`). One query."""
    if mode == "discard":
        return
    _refuse_over(changesets.count_kept(workspace), cap)


def room_now(changesets: Changesets, workspace: str, mode: ChangesMode, cap: int) -> bool:
    """`check_room` on the event loop, when the database is free right now (a query of
    microseconds: no worker-thread hop before a command). True: decided (it raised, or
    there is room); False: the database is busy, call `check_room` from a thread."""
    if mode == "discard":
        return True
    kept = changesets.count_kept_now(workspace)
    if kept is None:
        return False
    _refuse_over(kept, cap)
    return True


def _refuse_over(kept: int, cap: int) -> None:
    if kept >= cap:
        raise LimitExceeded(
            f"{kept} change sets of this workspace await review or approval: apply or"
            " discard some (changes.apply, changes.discard)",
            limit=cap,
            scope="kept_changesets",
            kept=kept,
        )


def change_entry(change: Change) -> ChangeEntry:
    """The wire entry of a change not applied yet (kept for review): path, op, size, mode
    (a symlink's: its kind, target and `escapes`)."""
    gone = change.op == "delete"
    link = change.kind == "symlink"
    return ChangeEntry(
        path=change.path,
        op=change.op,
        size=None if gone else change.size,
        mode=None if gone else change.mode,
        kind="symlink" if link else None,
        target=change.target if link else None,
        escapes=change.escapes if link else None,
    )


def entries(
    outcomes: Iterable[Outcomes],
    changes: Mapping[str, Change] | None = None,
    versions: Versions | None = None,
) -> list[ChangeEntry]:
    """The wire entries of `outcomes`. `changes`: the set's changes by path (for `size`
    and `mode`); `versions`: its kept versions (for a conflict's artifact; a conflict
    with none has `artifact_reason` `set_full` when the set recorded its cap, else
    none, as in a dry run)."""
    by_path = versions.by_path() if versions is not None else None
    overflow = versions is not None and versions.overflow
    return [_entry(o, changes, by_path, overflow) for o in outcomes]


def _entry(
    o: Outcomes,
    changes: Mapping[str, Change] | None,
    versions: Mapping[str, KeptVersion] | None,
    overflow: bool,
) -> ChangeEntry:
    change = changes.get(o.path) if changes is not None else None
    shown = change_entry(change) if change is not None else None
    artifact = reason = None
    kept = o.kept
    if needs_version(o) and versions is not None:
        version = versions.get(o.path)
        if version is None:  # past the set's cap of versions, or a dry run's
            reason = "set_full" if overflow else None
        elif version.artifact is not None:
            artifact, kept = version.artifact, None
        else:
            reason = version.reason
            kept = None if reason == "empty" else kept  # nothing to keep: the layer may go
    return ChangeEntry(
        path=o.path,
        op=o.op,
        size=shown.size if shown is not None else None,
        mode=shown.mode if shown is not None else None,
        reason=o.reason,
        rule=o.rule,
        plan_digest=o.plan_digest,
        current_sha256=o.current_sha256,
        artifact=artifact,
        artifact_reason=reason,
        kept=kept,
        kind=shown.kind if shown is not None else ("symlink" if o.kind == "symlink" else None),
        target=shown.target if shown is not None else None,
        escapes=shown.escapes if shown is not None else None,
    )
