"""`substrate mcp` process tools against a real daemon and engine (profile "tiny"):
proc_run, proc_start/output/wait/signal, artifacts as tools and as resources, and a
proc result cut to the size limit with its whole output still readable.

Each test runs its own daemon; its sandboxes are removed when it stops and by the
`mcp_daemon` fixture (containers labelled with its daemon id).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
from mcp import ClientSession
from mcp.types import TextResourceContents

from tests.harness.mcp import call_ok, open_mcp, payload

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

SEQ = "".join(f"{i}\n" for i in range(1, 5001)).encode()


@pytest.fixture
def mcp_daemon(engine_daemons: Callable[..., DaemonProcess], tiny_image: str) -> DaemonProcess:
    # Output past 1 KiB becomes an artifact, so a `seq` is enough to make one.
    return engine_daemons(inline_output_bytes=1024)


def workspace(d: DaemonProcess) -> str:
    return d.adopt(d.make_workspace(files={"hello.txt": "hi\n"}))


async def read_output(session: ClientSession, proc: str) -> tuple[bytes, bytes, dict[str, Any]]:
    """Both streams of `proc` from byte 0, through `proc_output` pages."""
    got = {"stdout": b"", "stderr": b""}
    while True:
        since = {f"{name}_since": len(data) for name, data in got.items()}
        page = await call_ok(session, "proc_output", proc=proc, **since)
        for name in got:
            piece = page[name]
            assert piece["offset"] == len(got[name]) and "skipped_from" not in piece
            assert piece["next"] == piece["offset"] + len(piece["data"].encode())
            got[name] += piece["data"].encode()
        if not page["more"] and page["state"] != "running":
            return got["stdout"], got["stderr"], page


async def test_run_and_read_its_output_and_artifact(mcp_daemon: DaemonProcess) -> None:
    ws = workspace(mcp_daemon)
    async with open_mcp(mcp_daemon, "--workspace", ws) as session:
        small = await call_ok(
            session, "proc_run", profile="tiny", argv=["sh", "-c", "cat hello.txt; echo oops >&2"]
        )
        assert small["exit_code"] == 0
        assert small["stdout"]["inline"] == "hi\n" and small["stderr"]["inline"] == "oops\n"

        big = await call_ok(session, "proc_run", profile="tiny", argv=["seq", "1", "5000"])
        ref = big["stdout"]
        assert big["exit_code"] == 0 and ref["bytes"] == len(SEQ) and "inline" not in ref
        artifact = ref["artifact"]

        # The artifact as tools ...
        lines = await call_ok(session, "artifact_lines", artifact=artifact, start=4999, count=5)
        assert lines["lines"] == ["4999", "5000"] and lines["eof"] is True
        grep = await call_ok(session, "artifact_grep", artifact=artifact, pattern="^4242$")
        assert grep["matches"] == [{"line": 4242, "text": "4242"}]
        part = await call_ok(session, "artifact_read", artifact=artifact, offset=0, length=10)
        assert part["data"] == SEQ[:10].decode()

        # ... and as a resource, listed once a result pointed at it, read in ranges.
        listed = (await session.list_resources()).resources
        uri = f"substrate://artifact/{artifact}"
        assert [r.uri for r in listed] == [uri] and listed[0].size == len(SEQ)
        whole = (await session.read_resource(uri)).contents
        assert isinstance(whole[0], TextResourceContents)
        assert whole[0].text.encode() == SEQ
        tail = (await session.read_resource(f"{uri}?offset={len(SEQ) - 5}&length=100")).contents
        assert isinstance(tail[0], TextResourceContents) and tail[0].text == "5000\n"


async def test_start_output_wait_and_signal(mcp_daemon: DaemonProcess) -> None:
    ws = workspace(mcp_daemon)
    script = 'i=0; while [ $i -lt 200 ]; do echo "line $i"; i=$((i+1)); done; echo done >&2'
    async with open_mcp(mcp_daemon, "--workspace", ws) as session:
        started = await call_ok(session, "proc_start", profile="tiny", argv=["sh", "-c", script])
        proc = started["proc"]
        ended = await call_ok(session, "proc_wait", proc=proc)
        assert ended["exit_code"] == 0
        out, err, last = await read_output(session, proc)
        assert out == "".join(f"line {i}\n" for i in range(200)).encode()
        assert err == b"done\n" and last["state"] == "exited"

        sleeper = await call_ok(session, "proc_start", profile="tiny", argv=["sleep", "300"])
        running = await call_ok(session, "proc_wait", proc=sleeper["proc"], timeout_s=0)
        assert running["state"] == "running"
        signalled = await call_ok(session, "proc_signal", proc=sleeper["proc"], signal="KILL")
        assert signalled["delivered"] >= 1
        killed = await call_ok(session, "proc_wait", proc=sleeper["proc"])
        assert killed["signal"] == "KILL"


async def test_a_large_inline_result_is_cut_and_stays_readable(
    engine_daemons: Callable[..., DaemonProcess], tiny_image: str
) -> None:
    d = engine_daemons()  # output up to 64 KiB stays inline
    ws = workspace(d)
    limit = 8192
    async with open_mcp(d, "--workspace", ws, "--max-result-bytes", str(limit)) as session:
        result = await session.call_tool(
            "proc_run", {"profile": "tiny", "argv": ["seq", "1", "5000"]}
        )
        assert not result.is_error
        assert len(result.content[0].text.encode()) <= limit  # type: ignore[union-attr]
        value: dict[str, Any] = result.structured_content or {}
        ref = value["stdout"]
        assert "inline" not in ref and ref["bytes"] == len(SEQ)
        assert ref["preview_head"].startswith("1\n2\n")
        assert ref["preview_tail"].endswith("4999\n5000\n")
        assert "proc_output" in value["elided"]
        out, err, _ = await read_output(session, value["proc"])
        assert out == SEQ and err == b""


async def test_a_long_call_reports_progress_when_asked(mcp_daemon: DaemonProcess) -> None:
    ws = workspace(mcp_daemon)
    seen: list[tuple[float, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        assert total is None  # how long a command takes is not known
        seen.append((progress, message))

    async with open_mcp(mcp_daemon, "--workspace", ws) as session:
        argv = ["sh", "-c", "sleep 3; echo done"]
        result = await session.call_tool(
            "proc_run", {"profile": "tiny", "argv": argv}, progress_callback=on_progress
        )
        assert payload(result)["stdout"]["inline"] == "done\n"
        assert len(seen) >= 2, seen  # one a second while the command ran
        assert [p for p, _ in seen] == sorted(p for p, _ in seen) and seen[0][0] > 0
        assert seen[0][1] is not None and seen[0][1].startswith("proc_run: working for")
        # Without a progress token nothing is sent (and the call is the same).
        quiet = await call_ok(session, "proc_run", profile="tiny", argv=["true"])
        assert quiet["exit_code"] == 0
