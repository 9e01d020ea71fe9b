"""A started container observed from the host and held to its required facts; every
verdict journalled (`proc.facts`). Steps 5-7 of `Containers.ensure` (docs/execution.md,
docs/confinement.md).

`Verifier.observe` reads a container's confinement facts through a `SandboxHost`
(`HostKernel`: `substrate.sandbox.observe`; tests: `fake_engine.FakeHost`), with the
identities of its workspace mounts and, when one is required, of its persistent home;
`observe_started` is that for a container this daemon just started, with the engine's
inspect and an egress sandbox's link to the proxy (`substrate.sandbox.proxy_link`).
`Verifier.check` compares them with the required facts (`facts.compare`, pure): any
mismatch is journalled (`proc.facts`, `ok: false`, the mismatches) and refused
`confinement_unmet` with what was required and what was seen; `Verifier.passed`
journals a sandbox that met them all (`ok: true`, every fact). `recheck_mounts` observes
and checks again what a working layer's swap can change (`Containers.reverify_layer`).

Used by `substrate.sandbox.containers` (a new sandbox, a swapped layer) and
`substrate.sandbox.labelled` (a labelled container this run did not create is checked
before it is removed), so neither calls back into the other.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from substrate.errors import ConfinementUnmet
from substrate.sandbox import facts as factlib
from substrate.sandbox import proxy_link
from substrate.sandbox.engine import ContainerGone, Engine
from substrate.sandbox.facts import Fact, FactValue, Mismatch
from substrate.sandbox.host import SandboxHost
from substrate.sandbox.profiles import Profile
from substrate.sandbox.proxy_link import ProxyLink, ProxyLinks
from substrate.sandbox.sandboxes import Sandbox
from substrate.store.journal import Journal

__all__ = ["Observed", "Verifier", "unmet"]


def unmet(profile: Profile, mismatches: Sequence[Mismatch]) -> ConfinementUnmet:
    """The refusal of a sandbox of `profile` that does not meet `mismatches` (pure): the
    message names at most eight facts; the data carries every value."""
    return ConfinementUnmet(
        f"the sandbox for profile {profile.name!r} does not meet "
        f"{len(mismatches)} required fact(s): "
        + ", ".join(factlib.mismatch_name(m) for m in mismatches[:8]),
        **factlib.mismatch_report(mismatches),
    )


@dataclass(frozen=True)
class Observed:
    """A started container as the engine and the host kernel show it."""

    inspect: dict[str, Any]
    init_pid: int
    facts: list[Fact]


class Verifier:
    """Observes containers through `engine` and `host` (and an egress sandbox's link,
    made through `egress`) and journals each verdict in `journal`."""

    def __init__(
        self,
        engine: Engine,
        host: SandboxHost,
        journal: Journal,
        egress: ProxyLinks | None,
        *,
        fs_limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self._engine = engine
        self.host = host
        self._journal = journal
        self._egress = egress
        self._fs_limiter = fs_limiter

    async def observe_started(
        self,
        container: str,
        workspace: str,
        profile: Profile,
        readonly: Sequence[str],
        required: Mapping[str, FactValue],
        links: list[ProxyLink],  # gets an egress sandbox's link (the caller closes it)
    ) -> Observed:
        """A container this daemon just started: the engine's inspect, `observe`, and an
        egress sandbox's link to the proxy (`proxy_link.link`) with its facts. Raises
        `ContainerGone` (not running) and ProcessLookupError (gone meanwhile); refuses
        as `ProxyLinks.open`."""
        inspect = await self._engine.inspect(container)
        init_pid = int(inspect["State"]["Pid"] or 0)
        if not inspect["State"].get("Running") or init_pid <= 0:
            raise ContainerGone(container)
        found = await self.observe(init_pid, inspect, profile, readonly, required)
        found += await proxy_link.link(
            self._egress, links, container, workspace, profile, init_pid, required
        )
        return Observed(inspect=inspect, init_pid=init_pid, facts=found)

    async def observe(
        self,
        init_pid: int,
        inspect: dict[str, Any],
        profile: Profile,
        readonly: Sequence[str],
        required: Mapping[str, FactValue],
    ) -> list[Fact]:
        """Every confinement fact of the container whose init is `init_pid`, with the
        identities of `/workspace` and of each read-only path in `readonly` (and of the
        home when `required` names one). Raises ProcessLookupError when it is gone.
        Cost: about 2 ms of CPU, in a worker thread."""
        observe = self.host.observe
        if "home_identity" in required:  # every sandbox of a daemon keeping homes has one
            observe = functools.partial(observe, home=True)
        return await trio.to_thread.run_sync(
            observe, init_pid, inspect, profile, readonly, limiter=self._fs_limiter
        )

    async def recheck_mounts(
        self, sandbox: Sandbox, workspace: str, required: Mapping[str, FactValue]
    ) -> list[Fact]:
        """After a working layer's swap: `sandbox`'s facts with what a swap can change
        observed again (`SandboxHost.observe_mounts`: the mount facts and the workspace
        identities), checked against `required` (as `check`: `confinement_unmet`,
        journalled). Cost: one mountinfo read and an lstat per identity."""
        facts = sandbox.facts
        engine_ok = any(f.name == "docker_socket_absent" and f.value is True for f in facts)
        fresh = await trio.to_thread.run_sync(
            functools.partial(
                self.host.observe_mounts,
                sandbox.init_pid,
                list(sandbox.readonly),
                engine_ok=engine_ok,
            ),
            limiter=self._fs_limiter,
        )
        names = {f.name for f in fresh}
        observed = [f for f in facts if f.name not in names] + fresh
        await self.check(sandbox.id, workspace, sandbox.profile, required, observed)
        return observed

    async def check(
        self,
        container: str,
        workspace: str,
        profile: Profile,
        required: Mapping[str, FactValue],
        observed: Sequence[Fact],
    ) -> None:
        """Refuse `confinement_unmet` (journalled) when an observed fact is not the
        required one (`facts.compare`: microseconds)."""
        mismatches = factlib.compare(required, observed)
        if not mismatches:
            return
        data = {
            "container": container[:12],
            "profile": profile.name,
            "ok": False,
            "mismatches": [msgspec.to_builtins(m) for m in mismatches],
        }
        await self._append("proc.facts", data, workspace)
        raise unmet(profile, mismatches)

    async def passed(
        self,
        container: str,
        workspace: str,
        profile: Profile,
        inspect: Mapping[str, Any],
        observed: Sequence[Fact],
    ) -> None:
        """Journal a sandbox that met every required fact (`proc.facts`, `ok: true`)."""
        data = {
            "container": container[:12],
            "profile": profile.name,
            "image": str(inspect.get("Image", "")),
            "ok": True,
            "facts": [msgspec.to_builtins(f) for f in observed],
        }
        await self._append("proc.facts", data, workspace)

    async def _append(self, kind: str, data: dict[str, Any], workspace: str) -> None:
        await trio.to_thread.run_sync(lambda: self._journal.append(kind, data, workspace=workspace))
