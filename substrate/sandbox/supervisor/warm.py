"""A warm pool member's supervisor: started while it waits, checked again at bind.

Docs: docs/fast-exec.md "In a warm sandbox"; docs/execution.md "The warm pool".

Theory of operation. A supervisor start is one engine exec and a few round trips (100-
600 ms, docs/fast-exec.md): with a new workspace's first command, it was the largest
part of that command. A pool member's container already runs as the uid:gid it is kept
for (the pool takes a member only for a workspace whose commands run as that uid:gid),
so its supervisor can be started before any workspace is bound:

1. `prestart` (the pool, once the member is started): `Supervisors.launch` as the
   member's uid:gid with the declared profile's environment (no secret: commands are
   given theirs with each `go`), checked at start against what the member's init shows
   then (`checks.unverified_baseline`). Its host pid joins the member's protected pids
   (the bind's "no process left in it" check counts it as the member's own). A start
   that fails leaves the member as it was: its first command starts one as usual.
2. `check` (the pool's bind, once every fact of the member was observed and verified
   for the workspace): nothing observed while it waited is trusted. The supervisor is
   read from the host again and checked as a start is (`startup.warm_problem`: the same
   process, not traced, stopped or dumpable; the status facts, cgroups and namespaces of
   the *verified* sandbox's baseline) and its uid must be the one that workspace's
   commands run as. It then serves with that baseline. One that does not hold is killed
   and refuses the bind (`confinement_unmet`): the pool removes the member, never uses it.
3. `attach` (after the bind's `proc.facts`): the sandbox's slot, its supervisor's pid
   protected, journalled `supervisor.started` (generation 1, `start_ms` of the start
   made while it waited, `warm: true`) for that workspace.
"""

from __future__ import annotations

import logging

import trio

from substrate.errors import ConfinementUnmet
from substrate.sandbox.spec import RunAs
from substrate.sandbox.supervisor import checks
from substrate.sandbox.supervisor.slot import SandboxView, Slot
from substrate.sandbox.supervisor.startup import StartFailed, reason_of, warm_problem
from substrate.sandbox.supervisor.supervisors import START_ERRORS, START_S, Supervisors

log = logging.getLogger("substrate.sandbox.supervisor")


async def prestart(
    supervisors: Supervisors,
    slot: Slot,
    container: str,
    init_pid: int,
    who: RunAs,
    environment: dict[str, str],
) -> int | None:
    """Start the supervisor of a warm pool member (its container `container` runs as
    `who`; nothing of a workspace is in it yet) in `slot`. Returns its host pid, or None
    (no python3 in the image, or the start failed: the first command starts one)."""
    if not supervisors.has_python(slot, container, init_pid):
        return None
    t0 = trio.current_time()
    if slot.accepting is None:
        slot.accepting = trio.socket.from_stdlib_socket(slot.listener)
    try:
        with trio.fail_after(START_S):
            base = await trio.to_thread.run_sync(
                checks.unverified_baseline, init_pid, limiter=supervisors._fs_limiter
            )
            link = await supervisors.launch(slot, container, who, environment, base, 1)
    except (*START_ERRORS, ValueError) as exc:
        reason = exc.reason if isinstance(exc, StartFailed) else reason_of(exc)
        log.info("%s: warm supervisor not started (%s)", container[:12], reason)
        return None
    slot.warm_ms = round((trio.current_time() - t0) * 1000, 3)
    return link.pid


def check(slot: Slot, sandbox: SandboxView) -> None:
    """Step 2 (module doc) for `slot`'s supervisor, if it has one, now that its member was
    verified as `sandbox`. Refuses `confinement_unmet` (the supervisor is killed).
    Blocking but tiny (procfs); raises ProcessLookupError when the sandbox's init is gone."""
    link = slot.link
    if link is None:
        return
    base = checks.baseline(sandbox.init_pid, sandbox.facts)
    problem = warm_problem(link, base, sandbox.who.uid)
    if problem is not None:
        slot.link = None
        link.kill()
        link.close()
        raise ConfinementUnmet(
            f"the warm sandbox's supervisor does not hold for this workspace ({problem})",
            required={"supervisor": f"uid {sandbox.who.uid}, the sandbox's confinement"},
            observed={"supervisor": problem},
        )
    link.base = base


async def attach(supervisors: Supervisors, slot: Slot, sandbox: SandboxView) -> None:
    """Step 3 (module doc): `Supervisors.attach`, journalled when a supervisor started
    while the member waited serves it."""
    supervisors.attach(slot, sandbox)
    if slot.link is not None:
        await supervisors._journal_async(
            "supervisor.started",
            sandbox,
            slot.link.generation,
            None,
            start_ms=slot.warm_ms,
            warm=True,
        )
