"""Terminals in the real engine: a TTY shell in the workspace's verified sandbox, reached
through grants, the WebSocket protocol and the agent socket (docs/protocol.md §7).

An in-process daemon (own state dir, adopt root, HTTP on an ephemeral loopback port)
with the shipped profiles plus `term-tiny`, an interactive profile on the tiny image
whose shell is busybox `sh`. Everything it starts carries its daemon id and is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import wsproto
import wsproto.events as wse
from trio_websocket import ConnectionClosed, WebSocketConnection

from substrate.config import PROJECT_ROOT
from substrate.daemon import Daemon
from substrate.protocol.client import AsyncClient, RpcError, open_client
from substrate.pty.client import open_terminal
from substrate.sandbox.containers import LABEL_DAEMON, daemon_id_for
from tests.harness import wait_until_async
from tests.harness.engine import sweep_mounts
from tests.harness.inprocess import in_process_config, serving
from tests.harness.ws_frames import read_until as _read_until
from tests.harness.ws_frames import recv, send, until_closed

OWNER = 1000
PROFILES = {
    "term-tiny": (
        'image = "substrate-tiny:latest"\nmemory = "64m"\ninteractive = true\n'
        'env = { PATH = "/bin", HOME = "/tmp", SHELL = "/bin/sh", PS1 = "$ " }\n'
    ),
    "plain-tiny": 'image = "substrate-tiny:latest"\nmemory = "64m"\n',
    "term-layer": (
        'image = "substrate-tiny:latest"\nmemory = "64m"\ninteractive = true\n'
        'workspace = "layer"\n'
        'env = { PATH = "/bin", HOME = "/tmp", SHELL = "/bin/sh", PS1 = "$ " }\n'
    ),
}


@dataclass
class Env:
    daemon: Daemon
    agent: AsyncClient
    operator: AsyncClient
    ws: str
    ws_path: Path
    docker: Any
    daemon_id: str

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.daemon.terminals.http.port}/pty"

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.daemon.terminals.http.port}"

    async def grant(
        self, profile: str = "term-tiny", workspace: str | None = None, **params: Any
    ) -> str:
        issued = await self.operator.call(
            "grant.issue",
            kind="interactive_terminal",
            workspace=workspace or self.ws,
            profile=profile,
            **params,
        )
        token: str = issued["token"]
        return token

    def containers(self) -> list[Any]:
        return list(
            self.docker.containers.list(
                all=True, filters={"label": f"{LABEL_DAEMON}={self.daemon_id}"}
            )
        )

    async def journal(self) -> list[dict[str, Any]]:
        await self.daemon.terminals.sessions.settle()
        entries: list[dict[str, Any]] = (await self.agent.call("journal.read", limit=10000))[
            "entries"
        ]
        return entries


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    for shipped in (PROJECT_ROOT / "profiles").glob("*.toml"):
        shutil.copy(shipped, profiles / shipped.name)
    for name, body in PROFILES.items():
        (profiles / f"{name}.toml").write_text(body)
    root = tmp_path / "roots"
    project = root / "project"
    project.mkdir(parents=True)
    (project / "README").write_text("hello\n")
    for path in (project, project / "README"):
        os.chown(path, OWNER, OWNER)
    return state, profiles, root


@pytest.fixture
def leftovers(docker_client: Any, dirs: tuple[Path, Path, Path]) -> Iterator[str]:
    daemon_id = daemon_id_for(dirs[0])
    yield daemon_id
    for ctr in docker_client.containers.list(
        all=True, filters={"label": f"{LABEL_DAEMON}={daemon_id}"}
    ):
        ctr.remove(force=True, v=True)
    assert sweep_mounts(dirs[0]) == []  # a layer profile's mounts: never leave one behind


@pytest.fixture
async def env(
    docker_client: Any,
    tiny_image: str,
    leftovers: str,
    dirs: tuple[Path, Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Env]:
    monkeypatch.setenv("DOCKER_HOST", "unix:///var/run/docker.sock")
    state, profiles, root = dirs
    config = in_process_config(state, root, profiles, listen="127.0.0.1:0")
    async with (
        serving(config, prepare=quick_terminal_clocks) as daemon,
        open_client(state / "substrate.sock") as agent,
        open_client(state / "operator.sock") as operator,
    ):
        ws = await agent.call("workspace.adopt", path=str(root / "project"))
        yield Env(
            daemon, agent, operator, ws["workspace"], root / "project", docker_client, leftovers
        )


def quick_terminal_clocks(daemon: Daemon) -> None:
    """Pings, sends and the first frame time out within a second or two."""
    settings = daemon.terminals.sessions.settings
    settings.ping_interval_s = 0.5
    settings.ping_timeout_s = 1.0
    settings.send_timeout_s = 1.0
    settings.first_frame_timeout_s = 1.0


async def read_until(ws: WebSocketConnection, needle: str) -> tuple[str, int]:
    return await _read_until(ws, needle, allow_resync=True)


async def opened(ws: WebSocketConnection, token: str, **extra: Any) -> dict[str, Any]:
    await send(ws, type="open", token=token, cols=80, rows=24, **extra)
    frame = await recv(ws)
    assert frame["type"] == "opened", frame
    return frame


async def expect_refusal(ws: WebSocketConnection, refusal: str, code: int) -> None:
    frame = await recv(ws)
    while frame["type"] == "output":  # an observer may still be shown the prompt first
        frame = await recv(ws)
    assert (frame["type"], frame["refusal"]) == ("error", refusal), frame
    with pytest.raises(ConnectionClosed) as info, trio.fail_after(10):
        await ws.get_message()
    assert info.value.reason.code == code


async def test_shell_in_the_verified_sandbox(env: Env) -> None:
    token = await env.grant()
    async with open_terminal(env.url) as ws:
        o = await opened(ws, token)
        await read_until(ws, "$ ")
        await send(ws, type="input", data="echo hi; id -u; pwd\r")
        text, _ = await read_until(ws, "/workspace")
        assert "\r\nhi\r\n1000\r\n/workspace" in text
        await send(ws, type="resize", cols=132, rows=43)
        await send(ws, type="input", data="stty size\r")
        await read_until(ws, "43 132")
        await send(ws, type="input", data="exit 7\r")
        while (f := await recv(ws))["type"] == "output":
            pass
        assert f == {"type": "exit", "code": 7}
    entries = await env.journal()
    kinds = [e["kind"] for e in entries]
    opened_entry = next(e for e in entries if e["kind"] == "pty.opened")
    facts = [e for e in entries if e["kind"] == "proc.facts"]
    assert facts and facts[0]["data"]["ok"] is True
    assert opened_entry["data"]["process"]["container"] == facts[0]["data"]["container"]
    assert kinds.index("proc.facts") < kinds.index("pty.opened")
    closed = next(e for e in entries if e["kind"] == "pty.closed")
    assert (closed["data"]["session"], closed["data"]["exit_code"]) == (o["session"], 7)
    assert (closed["data"]["cols"], closed["data"]["rows"]) == (132, 43)
    blob = json.dumps(entries)
    assert "echo hi" not in blob and token.split(".")[1] not in blob


async def test_observer_same_output_cannot_type_second_controller_refused(env: Env) -> None:
    token = await env.grant(uses=3)
    async with open_terminal(env.url) as ctl:
        o = await opened(ctl, token)
        await read_until(ctl, "$ ")
        async with open_terminal(env.url) as obs:
            await opened(obs, token, mode="observe", session=o["session"])
            await send(ctl, type="input", data="echo shared-$((6*7))\r")
            await read_until(ctl, "shared-42")
            await read_until(obs, "shared-42")
            async with open_terminal(env.url) as second:
                await send(second, type="open", token=token, session=o["session"])
                await expect_refusal(second, "controller_busy", 4409)
            await send(obs, type="input", data="echo nope\r")
            await expect_refusal(obs, "unauthorized", 4403)
        await send(ctl, type="input", data="echo ali$((0))ve\r")
        await read_until(ctl, "ali0ve\r\n")


async def test_disconnect_resume_and_resync(env: Env) -> None:
    token = await env.grant()
    async with open_terminal(env.url) as ws:
        o = await opened(ws, token)
        await send(ws, type="input", data="echo first\r")
        _, seq = await read_until(ws, "first\r\n$ ")
    async with open_terminal(env.url) as ws:
        again = await opened(ws, token, session=o["session"], since=seq)
        assert again["seq"] == seq
        await send(ws, type="input", data="echo second\r")
        text, seq2 = await read_until(ws, "second\r\n$ ")
        assert "first" not in text
        # Overflow the 1 MiB ring while nobody is attached.
        await send(ws, type="input", data="yes | head -c 3000000; echo; echo do$((2+2))ne\r")

    async def overflowed() -> bool:
        sel = await env.agent.call("pty.selection", session=o["session"], max_bytes=16)
        return bool(sel["end"] >= seq2 + 3_000_000)

    await wait_until_async(overflowed, 30, interval=0.1)
    async with open_terminal(env.url) as ws:
        await opened(ws, token, session=o["session"], since=seq2)
        f = await recv(ws)
        assert f["type"] == "resync" and f["seq"] > seq2
        await read_until(ws, "do4ne\r\n")
    sel = await env.agent.call("pty.selection", session=o["session"], max_bytes=64)
    assert sel["next"] == sel["end"] and len(sel["data"].encode()) <= 64
    old = await env.agent.call("pty.selection", session=o["session"], since=0, max_bytes=100)
    assert old["truncated"] is True and old["seq"] > 0


async def test_refusals_start_nothing(env: Env) -> None:
    with pytest.raises(RpcError) as caught:
        await env.grant(profile="plain-tiny")
    assert caught.value.refusal == "grant_invalid"
    with pytest.raises(RpcError) as caught:
        await env.agent.call(
            "grant.issue", kind="interactive_terminal", workspace=env.ws, profile="term-tiny"
        )
    assert caught.value.refusal == "unauthorized"
    expired = await env.grant(ttl_s=0.05)
    revoked_issue = await env.operator.call(
        "grant.issue", kind="interactive_terminal", workspace=env.ws, profile="term-tiny"
    )
    await env.operator.call("grant.revoke", grant=revoked_issue["grant"])
    await trio.sleep(0.1)  # kept: time must pass for the 0.05 s grant to expire
    wrong = (await env.grant())[:-3] + "abc"
    cases = [
        ({"type": "open"}, "invalid_params", 4400),
        ({"type": "open", "token": wrong}, "grant_invalid", 4401),
        ({"type": "open", "token": expired}, "grant_expired", 4401),
        ({"type": "open", "token": revoked_issue["token"]}, "grant_expired", 4401),
        ({"type": "input", "data": "id\r"}, "invalid_params", 4400),
    ]
    for frame, refusal, code in cases:
        async with open_terminal(env.url) as ws:
            await send(ws, **frame)
            await expect_refusal(ws, refusal, code)
    async with open_terminal(env.url) as ws:
        await expect_refusal(ws, "invalid_params", 4408)  # no first frame
    # A client masks a 16 MiB frame before its first byte leaves: give it time.
    env.daemon.terminals.sessions.settings.first_frame_timeout_s = 30
    for size in (64 * 1024 + 1, 16 << 20):
        async with open_terminal(env.url) as ws:
            with contextlib.suppress(ConnectionClosed):
                await ws.send_message("x" * size)
            await expect_refusal(ws, "too_large", 4413)
    assert env.containers() == []  # no sandbox was even created
    grants = (await env.operator.call("grant.list"))["grants"]
    assert all("token" not in g for g in grants)
    assert all(g["used"] == 0 for g in grants)


async def test_used_up_grant_and_origins(env: Env) -> None:
    token = await env.grant(uses=1)
    async with open_terminal(env.url) as ws:
        await opened(ws, token)
        await send(ws, type="close")
        await until_closed(ws)
    count = len(env.containers())
    async with open_terminal(env.url) as ws:
        await send(ws, type="open", token=token)
        await expect_refusal(ws, "grant_consumed", 4401)
    token2 = await env.grant()
    for origin in (
        "http://evil.example",
        "null",
        f"http://127.0.0.1:{env.daemon.terminals.http.port + 1}",
    ):
        status = await _upgrade_status(env, origin, "/pty")
        assert status == 403
    # A token in the query string is ignored: the open frame's token is what counts.
    stream, conn = await _raw_ws(env, "/pty?token=" + token2)
    fake = "g-0000000000000000." + "a" * 43
    await stream.send_all(
        conn.send(wse.TextMessage(data=json.dumps({"type": "open", "token": fake})))
    )
    events = await _events_until_close(stream, conn)
    first = next(ev for ev in events if isinstance(ev, wse.TextMessage))
    assert json.loads(first.data)["refusal"] == "grant_invalid"
    assert len(env.containers()) == count
    refused = [e for e in await env.journal() if e["kind"] == "pty.refused"]
    assert {e["data"]["refusal"] for e in refused} >= {"origin_denied", "grant_invalid"}, refused


async def _upgrade_status(env: Env, origin: str, target: str) -> int:
    stream = await trio.open_tcp_stream("127.0.0.1", env.daemon.terminals.http.port)
    head = (
        f"GET {target} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        f"Origin: {origin}\r\n\r\n"
    )
    await stream.send_all(head.encode())
    data = b""
    with trio.fail_after(10):
        while chunk := await stream.receive_some():
            data += chunk
    await stream.aclose()
    return int(data.split(b" ", 2)[1])


async def _raw_ws(env: Env, target: str = "/pty") -> tuple[trio.SocketStream, wsproto.WSConnection]:
    stream = await trio.open_tcp_stream("127.0.0.1", env.daemon.terminals.http.port)
    conn = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    await stream.send_all(
        conn.send(
            wse.Request(host="x", target=target, extra_headers=[(b"origin", env.origin.encode())])
        )
    )
    with trio.fail_after(10):
        while True:
            conn.receive_data(await stream.receive_some())
            if any(isinstance(ev, wse.AcceptConnection) for ev in conn.events()):
                return stream, conn


async def _events_until_close(
    stream: trio.SocketStream, conn: wsproto.WSConnection
) -> list[wse.Event]:
    got: list[wse.Event] = []
    with trio.fail_after(20):
        while not any(isinstance(ev, wse.CloseConnection) for ev in got):
            data = await stream.receive_some()
            if not data:
                break
            conn.receive_data(data)
            got.extend(conn.events())
    await stream.aclose()
    return got


async def test_slow_and_silent_clients_never_stall_the_pty(env: Env) -> None:
    token = await env.grant(uses=3)
    async with open_terminal(env.url) as ctl:
        o = await opened(ctl, token)
        await read_until(ctl, "$ ")
        # A client that never reads and never answers pings.
        stream, conn = await _raw_ws(env)
        await stream.send_all(
            conn.send(
                wse.TextMessage(
                    data=json.dumps(
                        {"type": "open", "token": token, "mode": "observe", "session": o["session"]}
                    )
                )
            )
        )
        await send(ctl, type="input", data="yes | head -c 2000000; echo; echo fin$((1+1))shed\r")
        await read_until(ctl, "fin2shed\r\n")  # the controller got everything, or a resync

        async def silent_one_detached() -> bool:
            return any(
                e["kind"] == "pty.detached" and e["data"]["reason"] in ("too_slow", "ping_timeout")
                for e in await env.journal()
            )

        await wait_until_async(silent_one_detached, 20, interval=0.2)
        await stream.aclose()
        await send(ctl, type="input", data="echo still-$((1+2))\r")
        await read_until(ctl, "still-3\r\n")


async def _layered(env: Env) -> tuple[str, Path]:
    """A checkout with a `.git`, adopted under `write_deny = ["*.lock"]`."""
    project = env.ws_path.parent / "layered"
    (project / ".git").mkdir(parents=True)
    for path in (project, project / ".git"):
        os.chown(path, OWNER, OWNER)
    adopted = await env.agent.call(
        "workspace.adopt", path=str(project), policy={"write_deny": ["*.lock"]}
    )
    return adopted["workspace"], project


async def test_a_shell_on_a_layer_profile_lands_its_changes_when_it_ends(env: Env) -> None:
    ws, project = await _layered(env)
    token = await env.grant("term-layer", workspace=ws)
    async with open_terminal(env.url) as term:
        o = await opened(term, token)
        await read_until(term, "$ ")
        await send(
            term,
            type="input",
            data="echo shell > made.txt; echo x > deps.lock; touch .git/x; echo do$((1+1))ne\r",
        )
        await read_until(term, "do2ne\r\n")
        # While the session runs: its writes are in its layer only.
        assert not (project / "made.txt").exists()
        assert not (project / "deps.lock").exists()
        await send(term, type="close")
        await until_closed(term)
    # Closed: the generation concluded, through the guarded path, as the terminal's grant.
    assert (project / "made.txt").read_text() == "shell\n"
    assert (project / "made.txt").stat().st_uid == OWNER
    assert not (project / "deps.lock").exists()  # denied: never in the checkout
    assert not (project / ".git" / "x").exists()  # in the git layer only
    entries = await env.journal()
    applied = [e for e in entries if e["kind"] == "changes.apply"]
    grant = next(e for e in entries if e["kind"] == "pty.opened")["data"]["grant"]
    assert [(e["data"]["path"], e["actor"]) for e in applied] == [
        ("layered:made.txt", f"terminal:{grant}")
    ]
    closed = next(e for e in entries if e["kind"] == "pty.closed")
    assert closed["data"]["session"] == o["session"]
    changes = closed["data"]["changes"]
    assert changes["mode"] == "apply" and changes["changeset"].startswith("cs_")
    assert (changes["counts"]["applied"], changes["counts"]["blocked"]) == (1, 1)
    kept = await env.agent.call("changes.get", changeset=changes["changeset"])
    assert kept["state"] == "applied"
    await env.agent.call("workspace.release", workspace=ws)


async def test_an_open_shell_defers_a_command_beside_it_and_concludes_both(env: Env) -> None:
    ws, project = await _layered(env)
    token = await env.grant("term-layer", workspace=ws)
    async with open_terminal(env.url) as term:
        o = await opened(term, token)
        await read_until(term, "$ ")
        await send(term, type="input", data="echo person > notes.txt; echo do$((1+1))ne\r")
        await read_until(term, "do2ne\r\n")
        # An agent's command on the same sandbox neither waits for the shell nor lands
        # while the shell is open: it shares the generation, deferred.
        with trio.fail_after(30):
            ran = await env.agent.call(
                "proc.run",
                workspace=ws,
                profile="term-layer",
                argv=["sh", "-c", "cat notes.txt && echo agent > agent.txt"],
            )
        assert ran["stdout"]["inline"] == "person\n"
        assert ran["changes"]["deferred"] is True
        assert not (project / "agent.txt").exists()
        await send(term, type="input", data="exit\r")
        await until_closed(term)
    assert (project / "agent.txt").read_text() == "agent\n"
    assert (project / "notes.txt").read_text() == "person\n"
    entries = await env.journal()
    (shared,) = [e for e in entries if e["kind"] == "changes.shared"]
    assert (shared["data"]["procs"], shared["data"]["sessions"]) == ([ran["proc"]], [o["session"]])
    closed = next(e for e in entries if e["kind"] == "pty.closed")
    assert closed["data"]["changes"]["changeset"] == shared["data"]["changeset"]
    assert closed["data"]["changes"]["counts"]["applied"] == 2
    await env.agent.call("workspace.release", workspace=ws)
