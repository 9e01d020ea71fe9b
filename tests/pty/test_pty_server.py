"""The terminal server end to end over loopback, on the in-memory fake PTY (no Docker)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import wsproto
import wsproto.events as wse
from trio_websocket import ConnectionClosed, WebSocketConnection

from substrate.pty.backend import FakePty, FakePtys
from substrate.pty.client import open_terminal
from substrate.pty.grants import Grants
from substrate.pty.http import TerminalHttp
from substrate.pty.terminals import Terminals, TerminalSettings
from substrate.store.db import Store
from substrate.store.journal import Journal
from tests.harness import wait_until_async
from tests.harness.ws_frames import read_until, send, until_closed
from tests.harness.ws_frames import recv as _recv


@dataclass
class Env:
    http: TerminalHttp
    terminals: Terminals
    grants: Grants
    journal: Journal
    ptys: FakePtys

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.http.port}/pty"

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.http.port}"

    def token(self, uses: int = 1, ttl: float = 60.0, profile: str = "interactive") -> str:
        _, token = self.grants.issue(
            workspace="w1", profile=profile, ttl_s=ttl, uses=uses, actor="operator:0"
        )
        return token


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    store = Store(tmp_path / "db")
    journal = Journal(store)
    grants = Grants(store, journal)
    ptys = FakePtys(non_interactive={"default"})
    settings = TerminalSettings(
        ring_bytes=4096,
        first_frame_timeout_s=0.5,
        ping_interval_s=0.3,
        ping_timeout_s=0.5,
        send_timeout_s=0.5,
    )
    terminals = Terminals(grants=grants, journal=journal, spawner=ptys, settings=settings)
    http = TerminalHttp(terminals)
    async with trio.open_nursery() as nursery:
        await nursery.start(terminals.run)
        await nursery.start(http.serve, "127.0.0.1:0")
        yield Env(http, terminals, grants, journal, ptys)
        nursery.cancel_scope.cancel()
    store.close()


async def recv(ws: WebSocketConnection) -> dict[str, Any]:
    return await _recv(ws, within_s=5)


async def expect_refusal(ws: WebSocketConnection, refusal: str, code: int) -> None:
    f = await recv(ws)
    assert f == {"type": "error", "refusal": refusal, "message": f["message"]}
    with pytest.raises(ConnectionClosed) as info, trio.fail_after(5):
        await ws.get_message()
    assert info.value.reason.code == code


def connect(env: Env, query: str = "") -> Any:
    return open_terminal(env.url + query)


async def open_control(
    env: Env, ws: WebSocketConnection, token: str, **extra: Any
) -> dict[str, Any]:
    await send(ws, type="open", token=token, cols=80, rows=24, **extra)
    opened = await recv(ws)
    assert opened["type"] == "opened", opened
    return opened


async def test_open_echo_resize_exit(env: Env) -> None:
    async with connect(env) as ws:
        opened = await open_control(env, ws, env.token())
        assert (opened["mode"], opened["seq"]) == ("control", 0)
        await read_until(ws, "$ ")
        await send(ws, type="input", data="echo hi\r")
        text, _ = await read_until(ws, "hi\r\n$ ")
        assert "echo hi\r\nhi\r\n" in text
        await send(ws, type="resize", cols=100, rows=30)
        await send(ws, type="input", data="size\r")
        await read_until(ws, "30 100\r\n")
        await send(ws, type="input", data="exit 3\r")
        while (f := await recv(ws))["type"] == "output":
            pass
        assert f == {"type": "exit", "code": 3}
        with pytest.raises(ConnectionClosed) as info, trio.fail_after(5):
            await ws.get_message()
        assert info.value.reason.code == 1000
    await env.terminals.settle()
    kinds = [e.kind for e in env.journal.read()]
    assert kinds[:3] == ["grant.issued", "grant.used", "pty.opened"]
    assert "pty.resized" in kinds and "pty.closed" in kinds
    closed = next(e for e in env.journal.read() if e.kind == "pty.closed")
    assert closed.data["exit_code"] == 3 and closed.data["reason"] == "exit"
    assert (closed.data["cols"], closed.data["rows"]) == (100, 30)
    for e in env.journal.read():
        assert "echo hi" not in json.dumps(e.data)


async def test_observer_sees_same_output_and_cannot_type(env: Env) -> None:
    token = env.token(uses=2)
    async with connect(env) as ctl:
        opened = await open_control(env, ctl, token)
        await read_until(ctl, "$ ")
        async with connect(env) as obs:
            await send(obs, type="open", token=token, mode="observe", session=opened["session"])
            o = await recv(obs)
            assert o["type"] == "opened" and o["mode"] == "observe"
            await read_until(obs, "$ ")  # the scrollback so far
            await send(ctl, type="input", data="echo both\r")
            await read_until(ctl, "both\r\n")
            await read_until(obs, "both\r\n")
            await send(obs, type="input", data="echo nope\r")
            await expect_refusal(obs, "unauthorized", 4403)
        await send(ctl, type="input", data="echo still\r")
        await read_until(ctl, "still\r\n")


async def test_second_controller_refused(env: Env) -> None:
    token = env.token(uses=3)
    async with connect(env) as ctl:
        opened = await open_control(env, ctl, token)
        async with connect(env) as second:
            await send(second, type="open", token=token, session=opened["session"])
            await expect_refusal(second, "controller_busy", 4409)


async def test_disconnect_and_resume_with_since(env: Env) -> None:
    token = env.token(uses=1)  # resuming a session it joined costs no use
    async with connect(env) as ws:
        opened = await open_control(env, ws, token)
        await send(ws, type="input", data="echo one\r")
        _, seq = await read_until(ws, "one\r\n$ ")
    await env.terminals.settle()
    async with connect(env) as ws:
        await send(ws, type="open", token=token, session=opened["session"], since=seq)
        again = await recv(ws)
        assert again == {
            "type": "opened",
            "session": opened["session"],
            "mode": "control",
            "seq": seq,
        }
        await send(ws, type="input", data="echo two\r")
        text, _ = await read_until(ws, "two\r\n")
        assert "one" not in text  # nothing replayed twice
    async with connect(env) as ws:
        await send(ws, type="open", token=token, session=opened["session"], mode="observe")
        await recv(ws)
        text, _ = await read_until(ws, "two\r\n")
        assert "one\r\n" in text  # no since: the whole ring


async def test_resync_after_ring_overflow(env: Env) -> None:
    token = env.token(uses=1)
    async with connect(env) as ws:
        opened = await open_control(env, ws, token)
        _, seq = await read_until(ws, "$ ")
    before = env.terminals.list().sessions[0].end
    env.ptys.spawned[-1]._emit(b"z" * 10000)  # the ring holds 4096
    await wait_until_async(lambda: env.terminals.list().sessions[0].end >= before + 10000)
    async with connect(env) as ws:
        await send(ws, type="open", token=token, session=opened["session"], since=seq)
        assert (await recv(ws))["type"] == "opened"
        f = await recv(ws)
        assert f["type"] == "resync" and f["seq"] > seq
        _, last = await read_until(ws, "zzz")
        assert last > f["seq"]


async def test_multibyte_split_and_invalid_bytes(env: Env) -> None:
    async with connect(env) as ws:
        await open_control(env, ws, env.token())
        await read_until(ws, "$ ")
        pty = env.ptys.spawned[-1]
        euro = "\u20ac".encode()
        pty._emit(b"A" + euro[:1])
        # The split must reach the client as two reads: send the rest once "A" arrived.
        first, _ = await read_until(ws, "A")
        pty._emit(euro[1:] + b"\xff" + b"B")
        rest, _ = await read_until(ws, "B")
        assert first + rest == "A\u20ac\ufffdB"


@pytest.mark.parametrize(
    ("tokens", "refusal"),
    [("none", "invalid_params"), ("wrong", "grant_invalid"), ("garbage", "grant_invalid")],
)
async def test_bad_tokens(env: Env, tokens: str, refusal: str) -> None:
    real = env.token()
    frame: dict[str, Any] = {"type": "open", "cols": 80, "rows": 24}
    if tokens == "wrong":
        frame["token"] = real[:-2] + ("AA" if not real.endswith("AA") else "BB")
    elif tokens == "garbage":
        frame["token"] = "hello"
    async with connect(env) as ws:
        await send(ws, **frame)
        await expect_refusal(ws, refusal, 4400 if refusal == "invalid_params" else 4401)
    assert env.ptys.spawned == []


async def test_expired_revoked_consumed_non_interactive(env: Env) -> None:
    expired = env.token(ttl=0.01)
    await trio.sleep(0.05)  # kept: time must pass for the grant to expire (nothing to poll)
    revoked_id, revoked = env.grants.issue(
        workspace="w1", profile="interactive", ttl_s=60, uses=1, actor="op"
    )
    env.grants.revoke(revoked_id.id, "op")
    used = env.token(uses=1)
    async with connect(env) as ws:
        await open_control(env, ws, used)
        await send(ws, type="close")
        await until_closed(ws)
    spawned = len(env.ptys.spawned)
    for token, refusal in [
        (expired, "grant_expired"),
        (revoked, "grant_expired"),
        (used, "grant_consumed"),
    ]:
        async with connect(env) as ws:
            await send(ws, type="open", token=token)
            await expect_refusal(ws, refusal, 4401)
    async with connect(env) as ws:
        await send(ws, type="open", token=env.token(profile="default"))
        await expect_refusal(ws, "grant_invalid", 4401)
    assert len(env.ptys.spawned) == spawned


@pytest.mark.parametrize("origin", ["http://evil.example", "null", None, "http://127.0.0.1:1"])
async def test_bad_origin_is_403(env: Env, origin: str | None) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", env.http.port)
    head = (
        "GET /pty HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
    )
    if origin is not None:
        head += f"Origin: {origin}\r\n"
    await stream.send_all((head + "\r\n").encode())
    data = b""
    with trio.fail_after(5):
        while chunk := await stream.receive_some():
            data += chunk
    await stream.aclose()
    assert data.startswith(b"HTTP/1.1 403 ")
    assert b'"refusal": "origin_denied"' in data


async def test_token_in_query_string_is_ignored(env: Env) -> None:
    token = env.token()
    stream, conn = await _raw_ws(env, target="/pty?token=" + token)
    fake = "g-0000000000000000." + "a" * 43
    await stream.send_all(
        conn.send(wse.TextMessage(data=json.dumps({"type": "open", "token": fake})))
    )
    got: list[wse.Event] = []
    with trio.fail_after(5):
        while not any(isinstance(ev, wse.CloseConnection) for ev in got):
            conn.receive_data(await stream.receive_some())
            got.extend(conn.events())
    await stream.aclose()
    texts = [json.loads(ev.data) for ev in got if isinstance(ev, wse.TextMessage)]
    assert texts[0]["refusal"] == "grant_invalid"
    assert next(ev for ev in got if isinstance(ev, wse.CloseConnection)).code == 4401
    assert env.ptys.spawned == []


async def test_first_frame_not_open_and_timeout(env: Env) -> None:
    async with connect(env) as ws:
        await send(ws, type="input", data="x")
        await expect_refusal(ws, "invalid_params", 4400)
    async with connect(env) as ws:
        await expect_refusal(ws, "invalid_params", 4408)
    async with connect(env) as ws:
        await ws.send_message(b"\x00binary")
        await expect_refusal(ws, "invalid_params", 4400)
    assert env.ptys.spawned == []


@pytest.mark.parametrize("size", [64 * 1024 + 1, 16 * 1024 * 1024])
async def test_oversize_frames_4413(env: Env, size: int) -> None:
    # A client masks a 16 MiB frame before its first byte leaves: give it time.
    env.terminals.settings.first_frame_timeout_s = 30
    async with connect(env) as ws:
        with contextlib.suppress(ConnectionClosed):
            await ws.send_message("x" * size)
        await expect_refusal(ws, "too_large", 4413)
    assert env.ptys.spawned == []


async def test_oversize_input_after_open(env: Env) -> None:
    async with connect(env) as ws:
        await open_control(env, ws, env.token())
        await read_until(ws, "$ ")
        with contextlib.suppress(ConnectionClosed):
            await send(ws, type="input", data="y" * (70 * 1024))
        await expect_refusal(ws, "too_large", 4413)


async def test_second_open_frame_refused(env: Env) -> None:
    token = env.token()
    async with connect(env) as ws:
        await open_control(env, ws, token)
        await send(ws, type="open", token=token)
        while (f := await recv(ws))["type"] == "output":
            pass
        assert f["type"] == "error" and f["refusal"] == "invalid_params"


async def test_page_and_static_files(env: Env) -> None:
    async def get(path: str) -> bytes:
        stream = await trio.open_tcp_stream("127.0.0.1", env.http.port)
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some():
                data += chunk
        await stream.aclose()
        return data

    page = await get("/")
    assert page.startswith(b"HTTP/1.1 200 ") and b"/static/xterm.js" in page
    assert b"x-frame-options: DENY" in page.lower().replace(b"deny", b"DENY")
    js = await get("/static/xterm.js")
    assert js.startswith(b"HTTP/1.1 200 ") and b"Terminal" in js
    assert (await get("/static/../../etc/passwd")).startswith(b"HTTP/1.1 404 ")
    assert (await get("/pty")).startswith(b"HTTP/1.1 403 ")


async def _raw_ws(env: Env, target: str = "/pty") -> tuple[trio.SocketStream, wsproto.WSConnection]:
    """A WebSocket client that answers nothing on its own (no automatic pongs)."""
    stream = await trio.open_tcp_stream("127.0.0.1", env.http.port)
    conn = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    request = wse.Request(
        host="127.0.0.1", target=target, extra_headers=[(b"origin", env.origin.encode())]
    )
    await stream.send_all(conn.send(request))
    with trio.fail_after(5):
        while True:
            conn.receive_data(await stream.receive_some())
            if any(isinstance(ev, wse.AcceptConnection) for ev in conn.events()):
                return stream, conn


async def test_never_ponging_client_is_disconnected(env: Env) -> None:
    stream, conn = await _raw_ws(env)
    await stream.send_all(
        conn.send(wse.TextMessage(data=json.dumps({"type": "open", "token": env.token()})))
    )
    pings = 0
    closed: wse.CloseConnection | None = None
    with trio.fail_after(10):
        while closed is None:
            data = await stream.receive_some()
            if not data:
                break
            conn.receive_data(data)
            for ev in conn.events():
                if isinstance(ev, wse.Ping):
                    pings += 1  # and never answered
                elif isinstance(ev, wse.CloseConnection):
                    closed = ev
    await stream.aclose()
    assert pings >= 1
    assert closed is not None and closed.code == 4408
    await env.terminals.settle()
    detached = [e for e in env.journal.read() if e.kind == "pty.detached"]
    assert detached and detached[-1].data["reason"] == "ping_timeout"
    assert env.terminals.list().sessions[0].state == "running"  # detached, not ended


async def test_never_reading_client_is_bounded_then_dropped(env: Env) -> None:
    # The 25 MiB pumped below keeps the loop busy: the observer's open may come late.
    env.terminals.settings.first_frame_timeout_s = 30
    token = env.token(uses=2)
    stream, conn = await _raw_ws(env)
    await stream.send_all(
        conn.send(wse.TextMessage(data=json.dumps({"type": "open", "token": token})))
    )
    with trio.fail_after(5):
        while not any(isinstance(ev, wse.TextMessage) for ev in conn.events()):
            conn.receive_data(await stream.receive_some())
    sid = env.terminals.list().sessions[0].session
    pty = env.ptys.spawned[-1]
    # An observer that reads keeps getting output while the other client reads nothing.
    async with connect(env) as obs:
        await send(obs, type="open", token=token, mode="observe", session=sid)
        assert (await recv(obs))["type"] == "opened"
        for _ in range(400):
            pty._emit(b"q" * 65536)  # 25 MiB the reader never takes
            await trio.lowlevel.checkpoint()
        pty._emit(b"END")
        seen = ""
        with trio.fail_after(10):
            while "END" not in seen:
                f = await recv(obs)
                if f["type"] == "output":
                    seen = seen[-10:] + f["data"]

    async def silent_one_detached() -> bool:
        await env.terminals.settle()
        return any(
            e.kind == "pty.detached" and e.data["reason"] in ("too_slow", "ping_timeout")
            for e in env.journal.read()
        )

    await wait_until_async(silent_one_detached, 10, interval=0.1)
    await stream.aclose()
    assert env.terminals.list().sessions[0].state == "running"


async def test_close_frame_ends_session_and_idle_timeout(env: Env) -> None:
    async with connect(env) as ws:
        await open_control(env, ws, env.token())
        await send(ws, type="close")
        await until_closed(ws)
    env.terminals.settings.idle_timeout_s = 0.3
    async with connect(env) as ws:
        await open_control(env, ws, env.token())

    # A session is marked ended before its process is gone and its `pty.closed` queued:
    # wait for the second entry itself, not for the state (that raced under load).
    async def closed_reasons() -> list[str]:
        await env.terminals.settle()
        reasons = [e.data["reason"] for e in env.journal.read() if e.kind == "pty.closed"]
        return reasons if len(reasons) >= 2 else []

    reasons = await wait_until_async(closed_reasons, 30, message="no second pty.closed")
    assert reasons == ["close", "idle"]


async def test_revoke_ends_sessions_and_kicks(env: Env) -> None:
    grant, token = env.grants.issue(
        workspace="w1", profile="interactive", ttl_s=60, uses=1, actor="op"
    )
    async with connect(env) as ws:
        await open_control(env, ws, token)
        await read_until(ws, "$ ")
        env.grants.revoke(grant.id, "op")
        assert await env.terminals.revoke_grant(grant.id) == 1
        await expect_refusal(ws, "grant_expired", 4401)


async def test_selection_for_agents(env: Env) -> None:
    async with connect(env) as ws:
        opened = await open_control(env, ws, env.token())
        await send(ws, type="input", data="echo caf\u00e9\r")
        await read_until(ws, "caf\u00e9\r\n$ ")
        sel = env.terminals.selection(opened["session"], None, 65536)
        assert "caf\u00e9\r\n" in sel.data and sel.seq == 0 and sel.next == sel.end
        part = env.terminals.selection(opened["session"], 2, 5)
        assert part.seq == 2 and part.next <= 7
        again = env.terminals.selection(opened["session"], part.next, 65536)
        assert again.seq == part.next and again.next == sel.end


async def _send_then_read_to_the_end(
    stream: trio.SocketStream, conn: wsproto.WSConnection, data: bytes
) -> list[wse.Event]:
    """A client that writes all it has, then reads to the end: what it gets. A reset on
    the way (on the write or the read) fails the test: the close must end it."""
    with trio.fail_after(30):
        await stream.send_all(data)
        got: list[wse.Event] = []
        while chunk := await stream.receive_some():
            conn.receive_data(chunk)
            got.extend(conn.events())
    await stream.aclose()
    return got


@pytest.mark.parametrize("after_open", [False, True])
async def test_a_1_mib_frame_from_a_client_that_writes_before_it_reads_gets_4413(
    env: Env, after_open: bool
) -> None:
    """The refusal and the close reach a client still writing its frame: the daemon
    reads and drops the rest of it before closing, so the connection is never reset."""
    env.terminals.settings.first_frame_timeout_s = 30
    stream, conn = await _raw_ws(env)
    if after_open:
        await stream.send_all(
            conn.send(wse.TextMessage(data=json.dumps({"type": "open", "token": env.token()})))
        )
    frame = json.dumps({"type": "input", "data": "y" * (1 << 20)})
    got = await _send_then_read_to_the_end(stream, conn, conn.send(wse.TextMessage(data=frame)))
    texts = [json.loads(ev.data) for ev in got if isinstance(ev, wse.TextMessage)]
    closes = [ev.code for ev in got if isinstance(ev, wse.CloseConnection)]
    assert texts and texts[-1]["refusal"] == "too_large"
    assert closes == [4413]


async def test_2000_resizes_are_coalesced_and_the_last_size_wins(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dragged window's resizes never queue up before the keystrokes behind them: the
    PTY is resized to the latest size only, a bounded number of times."""
    applied: list[tuple[int, int]] = []
    release = trio.Event()

    async def slow_resize(pty: FakePty, cols: int, rows: int) -> None:
        applied.append((cols, rows))
        if len(applied) == 1:
            await release.wait()  # an engine call that takes its time
        pty.cols, pty.rows = cols, rows

    monkeypatch.setattr(FakePty, "resize", slow_resize)
    sizes = [(40 + i % 100, 10 + i % 50) for i in range(2000)]
    async with connect(env) as ws:
        await open_control(env, ws, env.token())
        await read_until(ws, "$ ")
        for cols, rows in sizes:
            await send(ws, type="resize", cols=cols, rows=rows)
        # Typed after the resizes, answered while the first resize still runs.
        await send(ws, type="input", data="echo after\r")
        await read_until(ws, "after\r\n$ ")
        release.set()
        pty = env.ptys.spawned[-1]
        await wait_until_async(lambda: (pty.cols, pty.rows) == sizes[-1], 10)
        await send(ws, type="input", data="size\r")
        await read_until(ws, f"{sizes[-1][1]} {sizes[-1][0]}\r\n")
    assert 1 <= len(applied) <= 2
    assert applied[-1] == sizes[-1]
