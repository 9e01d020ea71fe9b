"""`SnapshotGate`: the write gate plugged around each sandboxed command.

Commands that overlap in one workspace share one baseline: it is taken when the first
starts and kept until the last ends (tickets are weakly held, so a command that dies
between `before` and `after` does not pin it forever), so a command never "restores"
another's offending write. Every step holds the workspace's root fd (`Workspace.use`),
so a release racing a command waits for the gate instead of closing the fd under it.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import trio

from substrate.errors import Refusal
from substrate.schema.proc import PolicyBlocked
from substrate.store.journal import Journal
from substrate.workspace.gate.diff import diff, display_rel
from substrate.workspace.gate.keep import Keep
from substrate.workspace.gate.revert import revert, why
from substrate.workspace.gate.snapshot import (
    Snapshot,
    mounts_cover_policy,
    readonly_identities,
    scan_after,
    take_snapshot,
)
from substrate.workspace.registry import Workspace
from substrate.workspace.temp_files import TempFiles

log = logging.getLogger("substrate.workspace.gate")

Rule = Literal["write_deny", "require_approval"]

#: `before`'s answer when read-only mounts already enforce every deny glob.
_NOTHING_TO_GATE = object()


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


class SnapshotGate:
    """`process.runner.WriteGate`: snapshot before a command, revert offending changes
    after.

    `before` refuses nothing of its own (`unknown_workspace` once the workspace is
    released); an OSError while snapshotting fails the command before it runs (the gate
    fails closed). The temp files of restores are recorded in `temp_files` (default: in
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
    ) -> None:
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
        self, ws: Workspace, readonly: Mapping[str, tuple[int, int]] | None = None
    ) -> object:
        """Snapshot (or join the running baseline of) `ws`. `readonly`: the paths the
        command's sandbox has mounted read-only, with the identities it mounted (default:
        the policy's read-only dirs as they are now); the gate does not walk them."""

        def mounted() -> dict[str, tuple[int, int]] | None:
            with ws.use():
                ro = dict(readonly_identities(ws) if readonly is None else readonly)
                return None if mounts_cover_policy(ws, ro) else ro

        ro = await trio.to_thread.run_sync(mounted, limiter=self._limiter)
        if ro is None:
            return _NOTHING_TO_GATE
        state = self._state(ws)
        ticket = _Ticket(ws.id)

        def snapshot(keep: Keep, previous: Snapshot | None) -> Snapshot:
            with ws.use():
                return take_snapshot(ws, keep, previous, ro)

        async with state.lock:
            if state.baseline is None or not state.holders:
                # Nobody else is running here: the workspace as it is now is the baseline.
                keep = await trio.to_thread.run_sync(self._keep, ws, state, limiter=self._limiter)
                state.baseline = await trio.to_thread.run_sync(
                    snapshot, keep, state.baseline, limiter=self._limiter
                )
            state.holders.add(ticket)
        return ticket

    async def after(self, ws: Workspace, snapshot: object) -> list[PolicyBlocked]:
        """Compare `ws` with the baseline and revert each offending change; one
        `policy_blocked` entry per change. Never raises for a failed check: it is logged
        and journalled (`policy.gate_failed`) so the command's record is still finished."""
        if snapshot is _NOTHING_TO_GATE:
            return []
        state = self._state(ws)
        try:
            async with state.lock:
                baseline = state.baseline
                if baseline is None or state.keep is None:
                    return []
                keep = state.keep
                with trio.CancelScope(shield=True):  # a revert is never abandoned halfway
                    try:
                        return await trio.to_thread.run_sync(
                            self._check, ws, baseline, keep, limiter=self._limiter
                        )
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
        finally:
            if isinstance(snapshot, _Ticket):
                state.holders.discard(snapshot)
        return []  # unreachable: the lock's exit never swallows an exception

    def _check(self, ws: Workspace, baseline: Snapshot, keep: Keep) -> list[PolicyBlocked]:
        with ws.use():
            now = scan_after(ws, baseline)
            changes = diff(baseline.nodes, now)
            if not changes:
                return []
            with ws.commit_lock:
                outcomes = revert(ws, changes, baseline.nodes, now, keep, self._temps)
        blocked: list[PolicyBlocked] = []
        for (rel, change), (reverted, reason) in zip(changes, outcomes, strict=True):
            where = ws.provenance(display_rel(rel))
            rule: Rule = "write_deny" if ws.policy.write_deny.matches(rel) else "require_approval"
            blocked.append(PolicyBlocked(path=where, change=change, reverted=reverted, rule=rule))
            data: dict[str, Any] = {
                "path": where,
                "change": change,
                "reverted": reverted,
                "rule": rule,
            }
            if reason:
                data["reason"] = reason
            old, new = baseline.nodes.get(rel), now.get(rel)
            data["before"] = old.summary() if old else None
            data["after"] = new.summary() if new else None
            self._journal.append("policy.blocked", data, workspace=ws.id)
        return blocked
