"""`SnapshotGate`: the write gate plugged around each sandboxed command.

A denied change is reverted only when the attribution source saw the sandbox make it and
nothing else touch it (`gate.attribution`); any other is kept and reported
`reverted: false` with `reason` `unattributed` or `mixed`: a person's edit on the host
is never undone (docs/protocol.md §11). A change made for a git directory by content's
sake (`gate.gitdirs`) is reported `rule: "write_deny"`, `reason: "git_dir"` when
reverted, and journalled with the directory (`git_dir`). The watch starts before the
baseline is taken, so nothing between the two goes unseen, and the attribution is asked
after the tree was scanned, so no change the scan saw is missing from it.

Commands that overlap in one workspace share one baseline: it is taken when the first
starts and kept until the last ends (tickets are weakly held, so a command that dies
between `before` and `after` does not pin it forever), so a command never "restores"
another's offending write. Every step holds the workspace's root fd (`Workspace.use`),
so a release racing a command waits for the gate instead of closing the fd under it.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import trio

from substrate.errors import Refusal
from substrate.fs import paths
from substrate.schema.proc import PolicyBlocked
from substrate.store.hop import run_to_end
from substrate.store.journal import Journal
from substrate.workspace import discoverable
from substrate.workspace.gate.attribution import (
    Attribution,
    Failed,
    Handle,
    Key,
    Touches,
    Unavailable,
    Watch,
    handle_at,
    key,
)
from substrate.workspace.gate.diff import Node, diff, display_rel
from substrate.workspace.gate.fanotify import FanotifyAttribution
from substrate.workspace.gate.gitdirs import GitContent
from substrate.workspace.gate.keep import Keep
from substrate.workspace.gate.revert import revert, why
from substrate.workspace.gate.snapshot import (
    Snapshot,
    readonly_identities,
    scan_after,
    take_snapshot,
)
from substrate.workspace.policy import is_git_path
from substrate.workspace.registry import Workspace
from substrate.workspace.writes.temp_files import TempFiles

log = logging.getLogger("substrate.workspace.gate")

Rule = Literal["write_deny", "require_approval"]
#: The `reason` of a reverted change made for a git directory by content's sake.
GIT_DIR = discoverable.GIT_DIR


class _Ticket:
    """One command's hold on its workspace's baseline (dropped: the hold ends)."""

    __slots__ = ("__weakref__", "ws")

    def __init__(self, ws: str) -> None:
        self.ws = ws


@dataclass
class _WsState:
    lock: trio.Lock = field(default_factory=trio.Lock)
    baseline: Snapshot | None = None
    holders: weakref.WeakSet[_Ticket] = field(default_factory=weakref.WeakSet)
    keep: Keep | None = None
    watch: Watch | None = None  # since the baseline, for the sandbox of its first command


class SnapshotGate:
    """`process.processes.WriteGate`: snapshot before a command, revert offending changes
    after.

    `before` refuses nothing of its own (`unknown_workspace` once the workspace is
    released); an OSError while snapshotting fails the command before it runs (the gate
    fails closed). `attribution` (default: fanotify) tells the sandbox's changes from
    anyone else's; without it nothing is reverted. The temp files of restores are recorded in `temp_files` (default: in
    the journal's database, where the start-up cleaner finds them). Costs: two walks of
    the tree (about 10 ms per 10,000 entries each; see bench/gate.py) plus reading the
    denied files whose stat changed.
    """

    def __init__(
        self,
        state_dir: Path,
        journal: Journal,
        *,
        limiter: trio.CapacityLimiter | None = None,
        temp_files: TempFiles | None = None,
        attribution: Attribution | None = None,
    ) -> None:
        self._attribution = attribution or FanotifyAttribution()
        self._root = state_dir
        self._journal = journal
        self._limiter = limiter
        self._temps = temp_files or TempFiles(journal.store, journal.epoch)
        self._states: dict[str, _WsState] = {}

    def _state(self, ws: Workspace) -> _WsState:
        state = self._states.get(ws.id)
        if state is None:
            state = self._states[ws.id] = _WsState()
        return state

    def _keep(self, ws: Workspace, state: _WsState) -> Keep:
        if state.keep is None:
            state.keep = Keep(self._root / ws.id)
        return state.keep

    async def before(
        self,
        ws: Workspace,
        readonly: Mapping[str, tuple[int, int]] | None = None,
        sandbox_pid: int | None = None,
    ) -> object:
        """Snapshot (or join the running baseline of) `ws`. `readonly`: the paths the
        command's sandbox has mounted read-only, with the identities it mounted (default:
        the policy's read-only dirs as they are now); the gate does not walk them.
        `sandbox_pid`: a process of the command's sandbox (its init), whose processes'
        changes may be reverted; None: no change is attributable (none is reverted).
        A baseline is watched for the sandbox of the command that took it: a command of
        another sandbox joining it has its changes reported unattributed."""

        state = self._state(ws)
        ticket = _Ticket(ws.id)

        def watch() -> Watch:
            if state.watch is not None:
                state.watch.close()
                state.watch = None
            try:
                return self._attribution.watch(ws.root_fd, sandbox_pid)
            except Unavailable as exc:
                log.warning("write gate of %s: no attribution: %s", ws.root_id, exc)
                return Failed(str(exc))

        def start() -> Snapshot:
            # One worker-thread hop for the whole start (the caller holds `state.lock`).
            # Always a snapshot, even when read-only mounts enforce every deny glob: a
            # directory may become a git directory by content (docs/write-gate.md).
            with ws.use():
                ro = dict(readonly_identities(ws) if readonly is None else readonly)
                # Watched from before the walk: a change made meanwhile is seen.
                state.watch = watch()
                keep = self._keep(ws, state)
                return take_snapshot(ws, keep, state.baseline, ro)

        async with state.lock:
            if state.baseline is None or not state.holders:
                # Nobody else is running here: the workspace as it is now is the baseline.
                try:
                    state.baseline = await run_to_end(start, self._limiter)
                except BaseException:
                    with trio.CancelScope(shield=True):  # no relay outlives a failed start
                        await self._unwatch(state)
                    raise
            state.holders.add(ticket)
        return ticket

    async def after(self, ws: Workspace, snapshot: object) -> list[PolicyBlocked]:
        """Compare `ws` with the baseline and revert each offending change; one
        `policy_blocked` entry per change. Never raises for a failed check: it is logged
        and journalled (`policy.gate_failed`) so the command's record is still finished.
        The last command of a baseline also ends its watch, in the check's own hop."""
        state = self._state(ws)
        async with state.lock:
            if isinstance(snapshot, _Ticket):
                state.holders.discard(snapshot)
            last = not state.holders
            baseline = state.baseline
            with trio.CancelScope(shield=True):  # a revert is never abandoned halfway
                if baseline is None or state.keep is None or state.watch is None:
                    if last:
                        await self._unwatch(state)
                    return []
                keep, watching = state.keep, state.watch

                def check() -> list[PolicyBlocked]:
                    try:
                        return self._check(ws, baseline, keep, watching)
                    finally:
                        if last:
                            # Nothing to watch until the next command here.
                            state.watch = None
                            watching.close()

                try:
                    return await run_to_end(check, self._limiter)
                except (OSError, Refusal) as exc:
                    # The command's record must still be finished: say so loudly instead.
                    log.error("write gate check of %s failed: %s", ws.root_id, why(exc))
                    await trio.to_thread.run_sync(
                        functools.partial(
                            self._journal.append,
                            "policy.gate_failed",
                            {"reason": why(exc)},
                            workspace=ws.id,
                        )
                    )
                    return []
        return []  # unreachable: the lock's exit never swallows an exception

    async def _unwatch(self, state: _WsState) -> None:
        """Stop the baseline's watch (the relay ends); the caller holds `state.lock`."""
        if state.watch is not None:
            ended, state.watch = state.watch, None
            await trio.to_thread.run_sync(ended.close)

    def _check(
        self, ws: Workspace, baseline: Snapshot, keep: Keep, watching: Watch
    ) -> list[PolicyBlocked]:
        with ws.use():
            now, git_now = scan_after(ws, baseline)
            changes = diff(baseline.nodes, now)
            if not changes:
                return []
            # Asked after the scan: every change it saw was made before this flush.
            touches = watching.touches()
            verdicts = [_attribute(ws, rel, baseline, now, touches) for rel, _ in changes]
            ours = [c for c, (v, _) in zip(changes, verdicts, strict=True) if v == "sandbox"]
            with ws.commit_lock:
                reverted_ours = iter(revert(ws, ours, baseline.nodes, now, keep, self._temps))
        outcomes: list[tuple[bool, str | None, str | None]] = []
        for verdict, why_not in verdicts:
            if verdict == "sandbox":
                outcomes.append((*next(reverted_ours), None))
            else:
                outcomes.append((False, verdict, why_not))
        blocked: list[PolicyBlocked] = []
        for (rel, change), (reverted, reason, seen) in zip(changes, outcomes, strict=True):
            where = ws.provenance(display_rel(rel))
            git_dir = _git_dir(rel, git_now, baseline.git)
            rule: Rule = (
                "write_deny"
                if git_dir is not None or is_git_path(rel) or ws.policy.write_deny.matches(rel)
                else "require_approval"
            )
            if reverted and git_dir is not None:
                reason = GIT_DIR
            blocked.append(
                PolicyBlocked(
                    path=where, change=change, reverted=reverted, rule=rule, reason=reason
                )
            )
            data: dict[str, Any] = {
                "path": where,
                "change": change,
                "reverted": reverted,
                "rule": rule,
            }
            if reason:
                data["reason"] = reason
            if seen:
                data["attribution"] = seen
            if git_dir is not None:
                data["git_dir"] = ws.provenance(display_rel(git_dir or "."))
            old, new = baseline.nodes.get(rel), now.get(rel)
            data["before"] = old.summary() if old else None
            data["after"] = new.summary() if new else None
            self._journal.append("policy.blocked", data, workspace=ws.id)
        return blocked


def _git_dir(rel: str, now: GitContent, baseline: GitContent) -> str | None:
    """The git directory by content `rel` was denied for (now, or at the baseline for
    what is gone), or None: a glob or a `.git` denies it."""
    found = now.git_dir_of(rel)
    return found if found is not None else baseline.git_dir_of(rel)


def _attribute(
    ws: Workspace, rel: str, baseline: Snapshot, now: Mapping[str, Node], touches: Touches
) -> tuple[str, str | None]:
    """Whose change at `rel` is (`Touches.verdict`), looked up under every key it may
    have been reported by: its directory's handle then and now, a directory's own, and
    the same for everything beneath it (a created or deleted tree is one change)."""
    before = baseline.nodes
    current: dict[str, Handle | None] = {}

    def handle_now(dir_rel: str) -> Handle | None:
        if dir_rel not in current:
            try:
                fd = paths.open_dir(ws.root_fd, tuple(dir_rel.split("/")) if dir_rel else ())
            except (OSError, Refusal):
                current[dir_rel] = None
            else:
                try:
                    current[dir_rel] = handle_at(fd)
                finally:
                    os.close(fd)
        return current[dir_rel]

    keys: set[Key] = set()
    under = [p for p in {*before, *now} if p.startswith(rel + "/")]
    for path in [rel, *under]:
        parent, _, name = path.rpartition("/")
        for found in (baseline.handles.get(parent), handle_now(parent)):
            if found is not None:
                keys.add(key(found, name))
        if any(n is not None and n.kind == "dir" for n in (before.get(path), now.get(path))):
            for found in (baseline.handles.get(path), handle_now(path)):
                if found is not None:
                    keys.add(key(found, "."))
    return touches.verdict(keys)
