"""Commands and terminals sharing a `workspace = "layer"` sandbox's generation, and the
conclusion that applies it once (docs/working-layer.md, "Per command").

Theory of operation. `join` counts a command (`Processes.run`, before its exec is made)
or a terminal session (`pty.docker`, before its TTY exec) as a user of the generation
mounted now (`sandbox.generation.Users`), waiting only while a conclusion runs. `end`
(its process ended, called shielded) answers, for a user others still share the
generation with, `ProcChanges {generation, deferred: true}` at once; for the last user
it concludes the generation (`layering.conclude`: swap, re-verify, scan, apply) in the
most conservative mode its users asked, as the actor of the last user that ran, and
returns the set's summary. `abandon` is for a user whose process never ran (it wrote
nothing): it concludes only when others' changes wait. A generation shared by more than
one user is journaled `changes.shared {generation, changeset, mode, procs, sessions}`
(ids only) with the set, under the concluding actor.

A conclusion that finds the generation busy (`layer_busy`) keeps its users: their
changes go with the generation's next conclusion (`Users.concluded(kept=True)`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from substrate.process import layering
from substrate.sandbox import working_layer
from substrate.sandbox.containers import Containers, Sandbox
from substrate.sandbox.engine import ContainerGone
from substrate.sandbox.generation import Conclusion, Deferred, User
from substrate.schema.proc import ProcChanges
from substrate.store.journal import Journal
from substrate.workspace.layer import Changesets
from substrate.workspace.writes import Writer

if TYPE_CHECKING:
    from substrate.process.runner import RunRequest

log = logging.getLogger("substrate.process.layer_users")

#: Terminal session ids start so (`pty.terminals`); every other user is a process.
SESSION_PREFIX = "t-"


@dataclass
class Use:
    """One user's hold on a sandbox's generation, from `join` to `end`/`abandon`."""

    sandbox: Sandbox
    user: User
    req: RunRequest  # what it asked: its workspace, actor and mode
    left: bool = False


class LayerUsers:
    """Joins and conclusions of every layer sandbox of this daemon."""

    def __init__(
        self,
        containers: Containers,
        writer: Writer | None,
        changesets: Changesets | None,
        journal: Journal,
        limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self._containers = containers
        self._writer = writer
        self._changesets = changesets
        self._journal = journal
        self._limiter = limiter

    async def join(self, sandbox: Sandbox, user_id: str, req: RunRequest) -> Use:
        """Count `user_id` (a process id, or a terminal session id), asking `req`, on the
        sandbox's current generation (waiting while one concludes: at most its apply).
        Raises `ContainerGone` when the layer was torn down meanwhile (the caller retries
        with a fresh sandbox)."""
        user = User(id=user_id, actor=req.actor, mode=req.changes)
        layer = sandbox.layer
        if layer is None:
            raise ValueError("joining a sandbox without a working layer")
        await layer.users.wait_joinable()
        if layer.closed:
            raise ContainerGone(sandbox.id)
        # No await from the wait to here: nothing concludes in between.
        layer.users.join(user, layer.plan.generation)
        working_layer.begin(layer)
        return Use(sandbox, user, req)

    async def end(self, use: Use) -> ProcChanges | None:
        """`use`'s process ran and ended: deferred while others share its generation, else
        the generation's conclusion (see the module doc). Never raises a refusal (a
        failure is the summary's `error`); None when this daemon applies nothing
        (no writer). Call it shielded; costs what `layering.conclude` costs when it
        concludes, nothing otherwise."""
        return await self._leave(use, ran=True)

    async def abandon(self, use: Use) -> None:
        """`use` is over without `end` (its process never ran, or its conclusion failed
        before): leave, concluding only if others' changes wait. Idempotent; shielded."""
        if use.left:
            return
        with trio.CancelScope(shield=True):
            changes = await self._leave(use, ran=False)
        if changes is not None and changes.error is not None:
            log.warning("a layer concluded without its last user: %s", changes.error)

    async def _leave(self, use: Use, *, ran: bool) -> ProcChanges | None:
        if use.left:
            return None
        use.left = True
        layer = use.sandbox.layer
        assert layer is not None
        step = layer.users.leave(use.user.id, ran=ran)
        if step is None:
            return None
        if isinstance(step, Deferred):
            return ProcChanges(generation=step.generation, deferred=True, mode=use.user.mode)
        busy = False
        try:
            changes = await self._conclude(use, step)
            busy = changes is not None and changes.error == "layer_busy"
            return changes
        finally:
            layer.users.concluded(kept=busy)

    async def _conclude(self, use: Use, step: Conclusion) -> ProcChanges | None:
        if self._writer is None:
            return None
        req = msgspec.structs.replace(use.req, actor=step.actor, changes=step.mode)
        changes = await layering.conclude(
            self._containers, self._writer, use.sandbox, req, self._changesets, self._limiter
        )
        if changes is not None and len(step.users) > 1 and changes.error != "layer_busy":
            data = {
                "generation": changes.generation,
                "changeset": changes.changeset,
                "mode": step.mode,
                "procs": [u for u in step.users if not u.startswith(SESSION_PREFIX)],
                "sessions": [u for u in step.users if u.startswith(SESSION_PREFIX)],
            }
            try:
                await trio.to_thread.run_sync(
                    functools.partial(
                        self._journal.append,
                        "changes.shared",
                        data,
                        workspace=req.ws.id,
                        actor=step.actor,
                    ),
                    limiter=self._limiter,
                )
            except Exception:  # the set is applied and journaled per file already
                log.exception("journaling a shared generation failed")
        return changes


def journal_summary(changes: ProcChanges) -> dict[str, Any]:
    """`changes` for a journal entry: generation, mode, counts, and the changeset,
    `deferred` and `error` when set; no per-file lists."""
    summary: dict[str, Any] = {
        "generation": changes.generation,
        "mode": changes.mode,
        "counts": msgspec.to_builtins(changes.counts),
    }
    if changes.changeset is not None:
        summary["changeset"] = changes.changeset
    if changes.deferred:
        summary["deferred"] = True
    if changes.error is not None:
        summary["error"] = changes.error
    return summary
