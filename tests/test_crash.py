"""`kill -9` the daemon during a stream of large guarded writes, many times (docs/protocol.md §4).

After every crash and restart: each file is entirely one version the writers sent (its
last acknowledged one, or the one in flight when the daemon died), never a mix; no
`.substrate-tmp-*` file survives the start-up cleaner, even though the restart follows
the kill at once (each temp file is recorded before it exists, so the cleaner knows it
by its record, not by its age); `journal.verify` is ok.

Rounds default to 50 (`SUBSTRATE_CRASH_ROUNDS` overrides); the seed is printed so a
failing sequence of kill moments can be replayed (`SUBSTRATE_CRASH_SEED`).
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from substrate.protocol.client import Client, ConnectionLost, RpcError
from tests.harness import wait_until

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

MiB = 1 << 20
PATIENCE_S = 30.0
TEMP_PREFIX = ".substrate-tmp-"
FILES_PER_WRITER = 2
WRITERS = 3


def content(name: str, version: int) -> bytes:
    """Distinct, reproducible bytes: 1 to 4 MiB per (file, version)."""
    rng = random.Random(f"{name}:{version}")
    return rng.randbytes(rng.randint(1 * MiB, 4 * MiB))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class FileState:
    version: int = 0
    digest: str = ""
    in_flight: int | None = None  # the version sent and not (yet) acknowledged


@dataclass
class Stream:
    """What the writers have sent and what the daemon acknowledged."""

    files: dict[str, FileState]
    digests: dict[tuple[str, int], str] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    acked: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def digest(self, name: str, version: int) -> str:
        key = (name, version)
        if key not in self.digests:
            self.digests[key] = sha(content(name, version))
        return self.digests[key]


def temp_files(root: Path) -> list[str]:
    return [
        os.path.join(dirpath, n)
        for dirpath, dirnames, filenames in os.walk(root)
        for n in dirnames + filenames
        if n.startswith(TEMP_PREFIX)
    ]


def write_until_killed(d: DaemonProcess, ws: str, names: list[str], stream: Stream) -> None:
    try:
        client = Client(d.agent_path, timeout=PATIENCE_S, max_request_bytes=d.max_request_bytes)
    except OSError:
        return
    try:
        while True:
            for name in names:
                state = stream.files[name]
                version = state.version + 1
                body = content(name, version)
                with stream.lock:
                    stream.digests[(name, version)] = sha(body)
                state.in_flight = version
                try:
                    plan = client.call(
                        "fs.write",
                        workspace=ws,
                        path=name,
                        content_b64=base64.b64encode(body).decode(),
                        base_sha256=state.digest,
                    )
                except RpcError as exc:
                    stream.unexpected.append(f"{name} v{version}: {exc}")
                    return
                assert plan["applied"] and plan["new_sha256"] == stream.digests[(name, version)]
                state.version, state.digest, state.in_flight = version, plan["new_sha256"], None
                stream.acked.add(state.digest)
    except (ConnectionLost, OSError):
        return  # the daemon died under us
    finally:
        client.close()


def settle(root: Path, stream: Stream) -> None:
    """Every file is one whole version: the acknowledged one or the one in flight."""
    for name, state in stream.files.items():
        actual = sha((root / name).read_bytes())
        allowed = {stream.digest(name, state.version): state.version}
        if state.in_flight is not None:
            allowed[stream.digest(name, state.in_flight)] = state.in_flight
        assert actual in allowed, f"{name}: bytes of no version sent (a torn write?)"
        state.version, state.digest, state.in_flight = allowed[actual], actual, None


def wait_temp_cleaned(d: DaemonProcess, epoch: int) -> None:
    wait_until(
        lambda: [e for e in d.journal(kinds={"workspace.temp_cleaned"}) if e["epoch"] == epoch],
        PATIENCE_S,
        message="the start-up cleaner never reported",
    )


@pytest.mark.slow
def test_kill_9_during_large_writes(daemon_factory: Callable[..., DaemonProcess]) -> None:
    rounds = int(os.environ.get("SUBSTRATE_CRASH_ROUNDS", "50"))
    seed = int(os.environ.get("SUBSTRATE_CRASH_SEED", str(random.randrange(1 << 30))))
    print(f"crash test seed {seed}, {rounds} rounds")
    rng = random.Random(seed)

    d = daemon_factory(max_request_bytes=8 * MiB)
    names = [f"f{i}.bin" for i in range(WRITERS * FILES_PER_WRITER)]
    root = d.make_workspace(files={name: content(name, 0) for name in names})
    ws = d.adopt(root)
    stream = Stream(files={name: FileState(0, sha(content(name, 0))) for name in names})

    crashes_with_temp = 0
    for round_no in range(rounds):
        writers = [
            threading.Thread(
                target=write_until_killed,
                args=(d, ws, names[w * FILES_PER_WRITER : (w + 1) * FILES_PER_WRITER], stream),
            )
            for w in range(WRITERS)
        ]
        for t in writers:
            t.start()
        if round_no == 0:
            # However loaded the machine, one round kills only after a write was
            # acknowledged, so "every acknowledged write is journaled" is never vacuous.
            wait_until(lambda: bool(stream.acked), timeout_s=60)
        time.sleep(rng.uniform(0.05, 0.5))  # kept: the crash lands at a random point
        d.kill()
        for t in writers:
            t.join(PATIENCE_S)
            assert not t.is_alive()
        assert stream.unexpected == []

        settle(root, stream)
        left = temp_files(root)
        crashes_with_temp += bool(left)

        d.start()
        with d.client() as c:
            epoch = c.call("daemon.status")["epoch"]
        if left:
            wait_temp_cleaned(d, epoch)
        assert temp_files(root) == []
        with d.client() as c:
            verdict = c.call("journal.verify")
        assert verdict["ok"], verdict

    # Every write the daemon acknowledged is in the journal, through all those crashes.
    written = {e["data"]["new_sha256"] for e in d.journal(kinds={"fs.write"}, workspace=ws)}
    assert stream.acked <= written
    assert stream.acked, "no write was ever acknowledged: the kills came too early"
    print(f"{crashes_with_temp} of {rounds} crashes left a temp file behind")


# --- a storm of small writes: what landed is journaled ------------------------------------------

STORM_WRITERS = 8
STORM_ROUNDS = 4
#: Acknowledged writes per round before the kill (so each kill falls amid the storm).
STORM_ACKS = 40


def storm_body(name: str, version: int) -> str:
    return f"{name} version {version}\n" * 8


def storm(
    d: DaemonProcess, ws: str, name: str, digest: dict[str, str], acks: list[tuple[str, str]]
) -> None:
    """Replace `name` again and again, each write bound to the last one's digest, until
    the daemon dies; each acknowledged write's (name, new digest) goes to `acks`."""
    version = 0
    try:
        client = Client(d.agent_path, timeout=PATIENCE_S)
    except OSError:
        return
    try:
        while True:
            version += 1
            plan = client.call(
                "fs.write",
                workspace=ws,
                path=name,
                content=storm_body(name, version),
                base_sha256=digest[name],
            )
            digest[name] = plan["new_sha256"]
            acks.append((name, plan["new_sha256"]))
    except (ConnectionLost, OSError):
        return
    finally:
        client.close()


def test_kill_9_amid_a_storm_of_writes_leaves_every_landed_write_journaled(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    """Eight connections replace their files as fast as they can; the daemon is killed
    amid the storm (their intents and entries share group commits), several times.
    After each restart every file holds the bytes of its last journal entry: a write
    that landed before its journal commit is journaled at the start (`recovered: true`),
    so `journal.replay` reports no drift; and every acknowledged write is there with the
    entry it had before it was acknowledged."""
    d = daemon_factory()
    names = [f"s{i}.txt" for i in range(STORM_WRITERS)]
    root = d.make_workspace(files={name: storm_body(name, 0) for name in names})
    ws = d.adopt(root)
    digest = {name: sha((root / name).read_bytes()) for name in names}
    recovered = 0
    for _ in range(STORM_ROUNDS):
        acks: list[tuple[str, str]] = []
        writers = [
            threading.Thread(target=storm, args=(d, ws, name, digest, acks)) for name in names
        ]
        for t in writers:
            t.start()
        wait_until(lambda n=acks: len(n) >= STORM_ACKS, timeout_s=60, message="no write landed")
        d.kill()
        for t in writers:
            t.join(PATIENCE_S)
            assert not t.is_alive()

        d.start()
        with d.client() as c:
            replay = c.call("journal.replay", workspace=ws)
            assert c.call("journal.verify")["ok"]
        assert replay["drifted"] == 0, [f for f in replay["files"] if f["status"] != "match"]
        entries = d.journal(kinds={"fs.write"}, workspace=ws)
        last = {e["data"]["path"].split(":", 1)[1]: e["data"]["new_sha256"] for e in entries}
        for name in names:
            digest[name] = sha((root / name).read_bytes())  # the base of the next round
            assert last[name] == digest[name], f"{name}: holds bytes no entry names"
        journaled = {
            (e["data"]["path"].split(":", 1)[1], e["data"]["new_sha256"]): e for e in entries
        }
        for ack in acks:
            assert ack in journaled, f"{ack[0]}: an acknowledged write has no journal entry"
            assert not journaled[ack]["data"].get("recovered"), f"{ack[0]}: entry not durable"
        recovered += sum(bool(e["data"].get("recovered")) for e in entries)
    print(f"{recovered} write(s) journaled at a start after landing before a kill")
