"""The containers labelled as this daemon's: an earlier run's removed, others never reused.

The labels a sandbox is created with, an earlier run's containers (removed at start) and
the ones this run did not create (never reused). docs/execution.md "A container with our
labels we did not create".

Labels (`spec.create_request`): `substrate.daemon` (this state dir's daemon id,
`spec.daemon_id_for`), `substrate.epoch` (the daemon run), `substrate.workspace`,
`substrate.profile`, `substrate.config` (SHA-256 of the create request, labels aside).

`Labelled.reap_previous`, at start: every container with our daemon id and an earlier
epoch is removed (`container.reaped`). `Labelled.remove_foreign`, before a sandbox of a
(workspace, profile) is created: every container labelled for that pair that is not one
of this run's is removed (`container.removed`, reason `foreign`); a running one is first
observed and checked (`verification.Verifier`), and one with weaker settings is refused
`confinement_unmet` (reason `weaker`) once it is gone, so the next call starts clean.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import trio

from substrate.errors import ConfinementUnmet, Refusal
from substrate.sandbox.engine import ContainerGone, Engine
from substrate.sandbox.facts import FactValue
from substrate.sandbox.profiles import Profile
from substrate.sandbox.spec import LABEL_DAEMON, LABEL_EPOCH, pair_labels
from substrate.sandbox.verification import Verifier
from substrate.store.journal import Journal

__all__ = ["Labelled"]


class Labelled:
    """This daemon's labels, and the labelled containers it did not create."""

    def __init__(
        self, engine: Engine, journal: Journal, verifier: Verifier, *, daemon_id: str, epoch: int
    ) -> None:
        self._engine = engine
        self._journal = journal
        self._verifier = verifier
        self.daemon_id = daemon_id
        self._epoch = epoch

    def of_pair(self, workspace: str, profile: str) -> dict[str, str]:
        """The labels that mark a container as this daemon's, for one (workspace, profile)."""
        return pair_labels(self.daemon_id, workspace, profile)

    async def reap_previous(self) -> int:
        """At start: remove every container of an earlier run of this daemon (its epoch)."""
        gone = 0
        for entry in await self._engine.list_labelled({LABEL_DAEMON: self.daemon_id}):
            # Only earlier epochs: one of ours may be being created right now.
            if (entry.get("Labels") or {}).get(LABEL_EPOCH) == str(self._epoch):
                continue
            await self._engine.remove(str(entry["Id"]))
            gone += 1
        if gone:
            await self._append("container.reaped", {"containers": gone}, None)
        return gone

    async def remove_foreign(
        self,
        workspace: str,
        profile: Profile,
        required: Mapping[str, FactValue],
        readonly: Sequence[str],
        mine: Collection[str],
    ) -> None:
        """Remove the containers labelled as ours for (workspace, profile) that are not in
        `mine` (this run's): never reused. Refuses `confinement_unmet` (journalled) when
        a running one does not meet `required`; it is removed first."""
        for entry in await self._engine.list_labelled(self.of_pair(workspace, profile.name)):
            container = str(entry["Id"])
            if container in mine:
                continue
            refusal: Refusal | None = None
            if entry.get("State") == "running":
                try:
                    inspect = await self._engine.inspect(container)
                    pid = int(inspect["State"]["Pid"] or 0)
                    observed = await self._verifier.observe(
                        pid, inspect, profile, readonly, required
                    )
                    await self._verifier.check(container, workspace, profile, required, observed)
                except ConfinementUnmet as exc:
                    refusal = exc
                except (ContainerGone, OSError):
                    pass
            await self._engine.remove(container)
            await self._append(
                "container.removed",
                {
                    "container": container[:12],
                    "profile": profile.name,
                    "reason": "weaker" if refusal is not None else "foreign",
                },
                workspace,
            )
            if refusal is not None:
                raise refusal

    async def _append(self, kind: str, data: dict[str, Any], workspace: str | None) -> None:
        await trio.to_thread.run_sync(lambda: self._journal.append(kind, data, workspace=workspace))
