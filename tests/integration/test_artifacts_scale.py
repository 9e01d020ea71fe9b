"""Artifacts at scale (docs/artifacts.md), against a real `substrate serve` and the real engine.

- `artifact.lines` / `artifact.grep` on a 20 MB artifact a command printed: lines near
  the end (through the line index), past the end, and the bounds refusals.
- Quota collection under a running writer (`proc.start`): finished artifacts are collected oldest
  first once a live spool pushes the store over `artifact_quota_bytes`; the spool is
  never touched and the writer's artifact is whole when it ends. Age collection too.
- Crash consistency: `kill -9` while a command is mid-output, damage the store the way
  an interrupted rename would, restart: the spool is kept as a `lost` artifact, dangling
  rows and orphan files are gone, and the files on disk and the rows agree exactly.
  (The broader restart test — processes marked lost, containers reaped — lives
  elsewhere; this one is about artifacts.)

Collection runs in the daemon's sweep, every `max(1, container_idle_s / 4)` seconds:
the tests set `container_idle_s = 4` to get a 1 s sweep and poll for its effect (bounded
by `trio.fail_after`, no timing assertions).
"""

from __future__ import annotations

import hashlib
import math
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio

from substrate.protocol.client import AsyncClient, RpcError
from tests.harness import wait_until_async

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

SEQ_LINES = 3_000_000
#: `seq 1 N` as the command prints it.
SEQ_BYTES = sum(len(str(i)) + 1 for i in range(1, SEQ_LINES + 1))
#: A fixed script; the character and sizes arrive as positional parameters.
FILL = 'head -c "$1" /dev/zero | tr \'\\0\' "$0"'
#: Prints $1 bytes of $0, waits for /workspace/go, prints $2 more.
GATED = (
    'head -c "$1" /dev/zero | tr \'\\0\' "$0";'
    " while [ ! -e /workspace/go ]; do sleep 0.1; done;"
    ' head -c "$2" /dev/zero | tr \'\\0\' "$0"'
)
#: Prints $1 bytes of $0, then hangs (the daemon is killed meanwhile).
HANG = 'head -c "$1" /dev/zero | tr \'\\0\' "$0"; sleep 1000'


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def docker_daemons(
    tiny_image: str, engine_daemons: Callable[..., DaemonProcess]
) -> Callable[..., DaemonProcess]:
    """`engine_daemons` on the tiny image."""
    return engine_daemons


async def refusal(c: AsyncClient, method: str, **params: Any) -> str | None:
    with pytest.raises(RpcError) as caught:
        await c.call(method, **params)
    return caught.value.refusal


async def run(c: AsyncClient, ws: str, argv: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = await c.call("proc.run", workspace=ws, profile="tiny", argv=argv)
    assert result["exit_code"] == 0, result
    return result


async def gone(c: AsyncClient, artifact: str) -> bool:
    try:
        await c.call("artifact.stat", artifact=artifact)
    except RpcError as exc:
        assert exc.refusal == "artifact_unknown"
        return True
    return False


async def until_gone(c: AsyncClient, artifact: str) -> None:
    """Poll until a sweep collected `artifact` (callers bound it with `fail_after`)."""
    await wait_until_async(lambda: gone(c, artifact), math.inf, interval=0.2)


async def until_written(c: AsyncClient, proc: str, size: int) -> None:
    """Poll `proc.status` until `proc`'s stdout reached `size` bytes (bounded by callers)."""

    async def written() -> bool:
        status = await c.call("proc.status", proc=proc)
        return bool(status["stdout_bytes"] >= size)

    await wait_until_async(written, math.inf, interval=0.05)


# --- lines and grep on a big artifact -----------------------------------------------------


async def test_lines_and_grep_on_a_big_artifact(
    docker_daemons: Callable[..., DaemonProcess],
) -> None:
    d = docker_daemons()
    ws = d.adopt(d.make_workspace("big"))
    async with d.async_client() as c:
        out = (await run(c, ws, ["seq", "1", str(SEQ_LINES)]))["stdout"]
        art = out["artifact"]
        assert (out["bytes"], out["truncated"]) == (SEQ_BYTES, False)
        assert out["preview_tail"].endswith("2999999\n3000000\n")

        # Near the end: the line index is built on first use, then kept.
        near_end = await c.call("artifact.lines", artifact=art, start=SEQ_LINES - 9, count=100)
        assert near_end["lines"] == [str(i) for i in range(SEQ_LINES - 9, SEQ_LINES + 1)]
        assert near_end["eof"] is True
        index = d.state_dir / "artifacts" / "index" / out["sha256"]
        assert index.is_file()
        middle = await c.call("artifact.lines", artifact=art, start=1_234_567, count=3)
        assert (middle["lines"], middle["eof"]) == (["1234567", "1234568", "1234569"], False)
        last = await c.call("artifact.lines", artifact=art, start=SEQ_LINES, count=1)
        assert (last["lines"], last["eof"]) == (["3000000"], True)
        past = await c.call("artifact.lines", artifact=art, start=SEQ_LINES + 1)
        assert (past["lines"], past["eof"]) == ([], True)
        most = await c.call("artifact.lines", artifact=art, start=2_000_001, count=10000)
        assert most["lines"] == [str(i) for i in range(2_000_001, 2_010_001)]

        # grep: an anchored line near the end, and a capped literal search.
        hit = await c.call("artifact.grep", artifact=art, pattern=r"^299999[89]$")
        assert hit == {
            "matches": [{"line": 2999998, "text": "2999998"}, {"line": 2999999, "text": "2999999"}],
            "truncated": False,
        }
        capped = await c.call(
            "artifact.grep", artifact=art, pattern="12345", fixed=True, max_matches=5
        )
        want = [i for i in range(1, SEQ_LINES + 1) if "12345" in str(i)][:5]
        assert [m["line"] for m in capped["matches"]] == want
        assert [m["text"] for m in capped["matches"]] == [str(i) for i in want]
        assert capped["truncated"] is True
        none = await c.call("artifact.grep", artifact=art, pattern="x")
        assert none == {"matches": [], "truncated": False}

        # Bounds: named refusals, not silent clipping.
        assert await refusal(c, "artifact.lines", artifact=art, count=10001) == "too_large"
        assert await refusal(c, "artifact.lines", artifact=art, start=0) == "invalid_params"
        assert await refusal(c, "artifact.grep", artifact=art, pattern="1", max_matches=10001) == (
            "too_large"
        )
        assert await refusal(c, "artifact.grep", artifact=art, pattern="(") == "invalid_params"
        assert await refusal(c, "artifact.read", artifact=art, length=(1 << 20) + 1) == "too_large"
        assert await refusal(c, "artifact.lines", artifact="art_" + "0" * 32) == "artifact_unknown"

        # A line longer than 64 KiB is cut there, and says so.
        long = await run(c, ws, ["sh", "-c", FILL + "; echo; echo end", "L", "200000"])
        cut = await c.call("artifact.lines", artifact=long["stdout"]["artifact"], count=5)
        assert (cut["lines"], cut["truncated"], cut["eof"]) == (["L" * 65536, "end"], True, True)


# --- quota and age collection -------------------------------------------------------------


async def test_quota_collection_spares_the_running_writer(
    docker_daemons: Callable[..., DaemonProcess],
) -> None:
    mb = 1_000_000
    d = docker_daemons(artifact_quota_bytes=10 * mb, container_idle_s=4)
    path = d.make_workspace("quota")
    ws = d.adopt(path)
    async with d.async_client() as c:
        older = (await run(c, ws, ["sh", "-c", FILL, "a", str(3 * mb)]))["stdout"]["artifact"]
        newer = (await run(c, ws, ["sh", "-c", FILL, "b", str(3 * mb)]))["stdout"]["artifact"]
        # 6 MB stored, under the quota: a sweep or two leaves both alone.
        await trio.sleep(2.5)  # kept: the sweeps must get a chance to (wrongly) act
        assert not await gone(c, older) and not await gone(c, newer)

        started = await c.call(
            "proc.start",
            workspace=ws,
            profile="tiny",
            argv=["sh", "-c", GATED, "w", str(5 * mb), str(mb)],
        )
        proc = started["proc"]
        spool = d.state_dir / "artifacts" / "spool"
        with trio.fail_after(60):
            await until_written(c, proc, 5 * mb)
            # 6 MB stored + a 5 MB live spool > 10 MB: the oldest goes, and only it
            # (3 + 5 fits). The writer is parked meanwhile, so this is no race.
            await until_gone(c, older)
            assert not await gone(c, newer)
            status = await c.call("proc.status", proc=proc)
            assert (status["state"], status["stdout_bytes"]) == ("running", 5 * mb)
            live = {p.name: p.stat().st_size for p in spool.iterdir() if not p.suffix}
            assert 5 * mb in live.values(), live  # the writer's spool, untouched
            (path / "go").touch()
            os.chown(path / "go", 1000, 1000)
            result = await c.call("proc.wait", proc=proc)
    assert result["exit_code"] == 0, result
    out = result["stdout"]
    total = 6 * mb
    assert (out["bytes"], out["sha256"], out["truncated"]) == (total, sha(b"w" * total), False)
    async with d.async_client() as c:
        stat = await c.call("artifact.stat", artifact=out["artifact"])
        assert (stat["bytes"], stat["sha256"]) == (total, out["sha256"])
        tail = await c.call("artifact.read", artifact=out["artifact"], offset=total - 10)
        assert (tail["data"], tail["eof"]) == ("w" * 10, True)
        assert not await gone(c, newer)  # 3 + 6 MB fit: nothing more to collect
        assert (await c.call("artifact.read", artifact=newer, length=4))["data"] == "bbbb"
    # The collected artifact's file went with its row, and the sweep journaled counts.
    a_sha = sha(b"a" * 3 * mb)
    assert not (d.state_dir / "artifacts" / a_sha[:2] / a_sha).exists()
    collected = d.journal({"artifact.collected"})
    assert sum(e["data"]["removed"] for e in collected) == 1


async def test_age_collection(docker_daemons: Callable[..., DaemonProcess]) -> None:
    d = docker_daemons(artifact_max_age_s=1.0, container_idle_s=4)
    ws = d.adopt(d.make_workspace("age"))
    async with d.async_client() as c:
        out = (await run(c, ws, ["sh", "-c", FILL, "z", "100000"]))["stdout"]
        with trio.fail_after(30):
            await until_gone(c, out["artifact"])
    content = d.state_dir / "artifacts" / out["sha256"][:2] / out["sha256"]
    assert not content.exists()


# --- crash consistency --------------------------------------------------------------------


def rows(state_dir: Path) -> dict[str, tuple[str, int, int, int]]:
    """id → (sha256, bytes, truncated, lost) of every artifact row (read-only)."""
    db = sqlite3.connect(f"file:{state_dir / 'substrate.db'}?mode=ro", uri=True)
    try:
        found = db.execute("SELECT id, sha256, bytes, truncated, lost FROM artifacts").fetchall()
    finally:
        db.close()
    return {r[0]: (r[1], r[2], r[3], r[4]) for r in found}


def content_files(root: Path) -> dict[str, int]:
    """sha256 → size of every content file in the store."""
    out = {}
    for shard in root.iterdir():
        if len(shard.name) == 2 and shard.is_dir():
            for f in shard.iterdir():
                out[f.name] = f.stat().st_size
    return out


async def test_kill_mid_output_then_files_and_rows_agree(
    docker_daemons: Callable[..., DaemonProcess],
) -> None:
    d = docker_daemons()
    ws = d.adopt(d.make_workspace("crash"))
    store = d.state_dir / "artifacts"
    spool = store / "spool"
    async with d.async_client() as c:
        kept = (await run(c, ws, ["sh", "-c", FILL, "k", "300000"]))["stdout"]
        doomed = (await run(c, ws, ["sh", "-c", FILL, "d", "400000"]))["stdout"]

        started = await c.call(
            "proc.start",
            workspace=ws,
            profile="tiny",
            argv=["sh", "-c", HANG, "c", "2000000"],
        )
        with trio.fail_after(60):
            await until_written(c, started["proc"], 2_000_000)
    # The command is mid-output (sleeping): its spool holds all 2 MB. Crash now.
    sizes = {p.name: p.stat().st_size for p in spool.iterdir() if not p.suffix}
    d.kill()
    live_id = next(name for name, size in sizes.items() if size == 2_000_000)
    # Its stderr printed nothing: it has no spool (a stream is spooled from its first
    # byte), so there is nothing of it to keep.
    assert set(sizes) == {live_id}
    assert (spool / f"{live_id}.meta").is_file()

    # Damage of the kind an interrupted rename or a lost write leaves behind.
    orphan = sha(b"orphan")
    (store / orphan[:2]).mkdir(exist_ok=True)
    (store / orphan[:2] / orphan).write_bytes(b"orphan")
    (store / "index" / orphan).write_bytes(b"\0" * 16)
    (spool / ("art_" + "f" * 32)).write_bytes(b"no meta: cannot be attributed")
    (store / doomed["sha256"][:2] / doomed["sha256"]).unlink()

    d.start()
    async with d.async_client() as c:
        lost = await c.call("artifact.stat", artifact=live_id)
        want = sha(b"c" * 2_000_000)
        assert (lost["bytes"], lost["sha256"], lost["lost"], lost["truncated"]) == (
            2_000_000,
            want,
            True,
            True,
        )
        assert (await c.call("artifact.read", artifact=live_id, length=3))["data"] == "ccc"
        assert (lost["proc"], lost["stream"]) == (started["proc"], "stdout")
        assert (await c.call("artifact.stat", artifact=kept["artifact"]))["sha256"] == kept[
            "sha256"
        ]
        assert await gone(c, doomed["artifact"])
        repaired = d.journal({"artifact.repaired"})
    assert [e["data"] for e in repaired] == [
        {"spools_kept": 1, "spools_discarded": 1, "orphans_removed": 2, "dangling_removed": 1}
    ]

    # Files and rows agree exactly: every row has its file at its size, nothing else.
    table = rows(d.state_dir)
    files = content_files(store)
    assert files == {digest: size for digest, size, _, _ in table.values()}
    assert set(table) == {kept["artifact"], live_id}
    assert os.listdir(spool) == []
    assert set(os.listdir(store / "index")) <= set(files)
