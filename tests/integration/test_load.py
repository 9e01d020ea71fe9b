"""Load: 16 commands streaming output at once in 4 workspaces, while another
client does `fs.stat` and `fs.read` in a loop.

"Responsive" is asserted as correctness, never as timing (timings are in
bench/longrun.py): every `fs.stat`/`fs.read` made during the load succeeds with the
right answer, at least one of each overlapped the streams, and every stream's bytes
and SHA-256 are exactly what the command printed, down to the artifact's last bytes.

The daemon is a real `substrate serve` subprocess (`daemon_factory`); its sandboxes
are removed by label at teardown even if it was killed.
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import trio

from substrate.protocol.client import AsyncClient
from tests.harness.engine import remove_daemon_containers

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

WORKSPACES = 4
PER_WORKSPACE = 4
STREAMS = WORKSPACES * PER_WORKSPACE
#: Bytes of stdout per stream: 30 MB plus a little more each, so no two are alike.
BASE_BYTES = 30_000_000
#: A fixed script: the word and the sizes come in as positional parameters ($0..$2),
#: never spliced into the script text.
SCRIPT = 'yes "$0" | head -c "$1"; yes "$0" | head -c "$2" >&2'
STDERR_BYTES = 100_000  # over the inline limit: both streams of every command are artifacts
#: A workspace file the reader checks while the streams run (bigger than one pipe buffer).
PROBE_FILE = "data/probe.bin"


def expected(word: str, size: int) -> tuple[bytes, str]:
    """What `yes word | head -c size` prints: its last (up to) 64 KiB, and its SHA-256."""
    line = (word + "\n").encode()
    digest = hashlib.sha256()
    block = line * 8192
    done = 0
    while done + len(block) <= size:
        digest.update(block)
        done += len(block)
    digest.update((line * (len(block) // len(line)))[: size - done])
    n = min(size, 1 << 16)
    phase = (size - n) % len(line)
    tail = (line * (n // len(line) + 2))[phase : phase + n]
    return tail, digest.hexdigest()


@pytest.fixture
def load_daemon(
    tiny_image: str, docker_client: Any, daemon_factory: Callable[..., DaemonProcess]
) -> Iterator[DaemonProcess]:
    d = daemon_factory()
    try:
        yield d
    finally:
        if d.running:
            d.stop()
        remove_daemon_containers(docker_client, d.state_dir)


async def test_sixteen_streams_and_a_responsive_reader(load_daemon: DaemonProcess) -> None:
    rng = random.Random(4)
    probes: dict[str, bytes] = {}
    workspaces: list[str] = []
    for i in range(WORKSPACES):
        data = rng.randbytes(300_000)
        path = load_daemon.make_workspace(f"load-{i}", {PROBE_FILE: data, "README.md": "x\n"})
        ws = load_daemon.adopt(path)
        workspaces.append(ws)
        probes[ws] = data

    jobs = [
        (workspaces[k % WORKSPACES], f"substrate-{k:02d}", BASE_BYTES + 7919 * k)
        for k in range(STREAMS)
    ]
    results: dict[int, dict[str, Any]] = {}
    finished = trio.Event()
    counts = {"stat": 0, "read": 0, "stat_during": 0, "read_during": 0}
    running = [STREAMS]

    async def stream(k: int, ws: str, word: str, size: int) -> None:
        async with load_daemon.async_client() as c:
            results[k] = await c.call(
                "proc.run",
                workspace=ws,
                profile="tiny",
                argv=["sh", "-c", SCRIPT, word, str(size), str(STDERR_BYTES)],
            )
        running[0] -= 1
        if running[0] == 0:
            finished.set()

    async def reader(c: AsyncClient) -> None:
        # Until every stream is done: stat and read each workspace's probe file in turn.
        turn = 0
        while not finished.is_set():
            ws = workspaces[turn % WORKSPACES]
            turn += 1
            data = probes[ws]
            during = running[0] > 0
            st = await c.call("fs.stat", workspace=ws, path=PROBE_FILE)
            assert (st["kind"], st["size"]) == ("file", len(data))
            counts["stat"] += 1
            counts["stat_during"] += during and running[0] > 0
            offset = rng.randrange(0, len(data) - 4096)
            got = await c.call("fs.read", workspace=ws, path=PROBE_FILE, offset=offset, length=4096)
            assert got["sha256"] == hashlib.sha256(data).hexdigest()
            raw = (
                base64.b64decode(got["data"])
                if got["encoding"] == "base64"
                else got["data"].encode()
            )
            assert raw == data[offset : offset + 4096]
            counts["read"] += 1
            counts["read_during"] += during and running[0] > 0

    with trio.fail_after(240):
        async with load_daemon.async_client() as checker:
            # Warm the four sandboxes first, so the streams overlap rather than queue
            # behind container creation.
            async with trio.open_nursery() as warm:
                for ws in workspaces:
                    warm.start_soon(
                        lambda ws=ws: checker.call(
                            "proc.run", workspace=ws, profile="tiny", argv=["true"]
                        )
                    )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader, checker)
                for k, (ws, word, size) in enumerate(jobs):
                    nursery.start_soon(stream, k, ws, word, size)

            # Every stream is exactly what the command printed.
            for k, (_ws, word, size) in enumerate(jobs):
                result = results[k]
                assert (result["exit_code"], result["timed_out"]) == (0, False), result
                for name, n in (("stdout", size), ("stderr", STDERR_BYTES)):
                    ref = result[name]
                    tail, digest = expected(word, n)
                    assert (ref["bytes"], ref["sha256"], ref["truncated"]) == (n, digest, False)
                    stat = await checker.call("artifact.stat", artifact=ref["artifact"])
                    assert (stat["bytes"], stat["sha256"], stat["stream"]) == (n, digest, name)
                    end = await checker.call(
                        "artifact.read",
                        artifact=ref["artifact"],
                        offset=n - len(tail),
                        length=len(tail),
                    )
                    assert (end["eof"], end["data"].encode()) == (True, tail)
            # The daemon still answers a plain call after the load.
            status = await checker.call("daemon.status")
            assert status["engine"]["reachable"] is True

    # The reader really overlapped the streams (counted only while some were running).
    assert counts["stat_during"] >= 1 and counts["read_during"] >= 1, counts
    assert counts["stat"] == counts["read"] or counts["stat"] == counts["read"] + 1
    # No spool is left behind: every stream became a stored artifact.
    assert os.listdir(load_daemon.state_dir / "artifacts" / "spool") == []
