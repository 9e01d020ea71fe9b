"""The execution layer over `substrate.sandbox.fake_engine`, for unit tests without Docker.

`fake_layer(...)` builds what `substrate.process.service.Execution` wires, with a
`FakeEngine` and `FakeHost` in place of the engine and the kernel, on a real store,
journal and adopted workspace (owned by uid 1000, under the test's adopt root).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import trio

from substrate.artifacts.store import ArtifactStore
from substrate.process.driver import ExecDriver
from substrate.process.processes import Processes, RunRequest
from substrate.process.records import ProcessRecords
from substrate.process.subscriptions import Subscriptions
from substrate.sandbox.containers import Containers
from substrate.sandbox.fake_engine import FakeEngine, FakeExec, FakeHost
from substrate.sandbox.profiles import Profile
from substrate.sandbox.reaper import MARKER
from substrate.secrets import SecretStore
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace.homes import Homes
from substrate.workspace.policy import Policy
from substrate.workspace.registry import Workspace
from tests.harness.state import open_state

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "fake:img"
IMAGE_ID = "sha256:" + "1" * 64
#: Profiles as the fake engine can run them: the shipped confinement, a fake image.
PROFILES = {
    # The fake engine keeps no working layers: these are the plain-bind ("rw") profiles.
    "box": Profile(name="box", image=IMAGE, workspace="rw"),
    "other": Profile(name="other", image=IMAGE, memory="512m", workspace="rw"),
    "gv": Profile(
        name="gv", image=IMAGE, runtime="runsc", seccomp="engine-default", workspace="rw"
    ),
    "bare": Profile(name="bare", image=IMAGE, workspace="none"),
}


@dataclass
class Layer:
    root: Path
    state: Path
    store: Store
    journal: Journal
    ws: Workspace
    engine: FakeEngine
    containers: Containers
    processes: Processes
    records: ProcessRecords

    def request(self, argv: list[str], profile: str = "box", **kw: object) -> RunRequest:
        return RunRequest(ws=self.ws, profile=profile, argv=tuple(argv), **kw)  # type: ignore[arg-type]

    def exec_of(self, proc: str) -> FakeExec:
        """The fake exec of command `proc` (found by the reaper's marker)."""
        (found,) = [e for e in self.engine.execs.values() if e.environment.get(MARKER) == proc]
        return found

    def kinds(self, kind: str) -> list[dict[str, object]]:
        return [e.data for e in self.journal.read(limit=10_000) if e.kind == kind]


@contextlib.contextmanager
def fake_layer(
    root: Path,
    state: Path,
    adopt_root: Path,
    *,
    policy: Policy | None = None,
    profiles: dict[str, Profile] | None = None,
    environment: bool = False,
) -> Iterator[Layer]:
    """The layer for workspace `root` (a dir under `adopt_root`), state under `state`;
    `profiles` instead of `PROFILES`; with `environment`, secrets (`state/secrets`) and
    persistent homes (`state/homes`) as the daemon wires them."""
    with open_state(state, adopt_root, max_processes=4) as made:
        store, journal, config = made.store, made.journal, made.config
        ws = made.registry.adopt(str(root), None, policy, "test")
        engine = FakeEngine(images={IMAGE: IMAGE_ID})
        containers = Containers(
            engine,
            journal,
            daemon_id="d" * 16,
            epoch=journal.epoch,
            seccomp_dir=ROOT / "seccomp",
            idle_s=60.0,
            files_dir=state / "sandbox-files",
            host=FakeHost(engine),
            homes=Homes(state) if environment else None,
            secrets=SecretStore(state) if environment else None,
        )
        records = ProcessRecords(store, journal)
        artifacts = ArtifactStore(store, state / "artifacts", quota_bytes=1 << 30, max_age_s=3600)
        processes = Processes(
            engine=engine,
            containers=containers,
            driver=ExecDriver(
                engine, containers, pump_limiter=trio.CapacityLimiter(8), fs_limiter=None
            ),
            records=records,
            artifacts=artifacts,
            subscriptions=Subscriptions(),
            write_gate=None,
            journal=journal,
            config=config,
            profiles=PROFILES if profiles is None else profiles,
        )
        yield Layer(root, state, store, journal, ws, engine, containers, processes, records)
