"""Process intents against a real daemon and engine: proc.start, wait, signal, status,
list and subscribe (docs/protocol.md §5), with the tiny busybox profile.

Each test runs its own daemon (subprocess); its sandboxes are removed when it stops and
by the `intent_daemon` fixture (containers labelled with its daemon id).
"""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from substrate.protocol.client import AsyncClient, RpcError
from substrate.sandbox.containers import LABEL_DAEMON, daemon_id_for
from tests.harness import wait_until, wait_until_async
from tests.harness.engine import remove_daemon_containers

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

TICKS = 'i=0; while [ $i -lt {n} ]; do echo "line $i"; i=$((i+1)); sleep {s}; done'


def ticks(n: int, s: float = 0.01) -> list[str]:
    return ["sh", "-c", TICKS.format(n=n, s=s)]


def expected_ticks(n: int) -> bytes:
    return "".join(f"line {i}\n" for i in range(n)).encode()


@pytest.fixture
def intent_daemon(
    daemon_factory: Callable[..., DaemonProcess], docker_client: Any, tiny_image: str
) -> Iterator[DaemonProcess]:
    d = daemon_factory()
    try:
        yield d
    finally:
        d.close()
        remove_daemon_containers(docker_client, d.state_dir)


def piece(params: dict[str, Any]) -> bytes:
    if params.get("data") is not None:
        return str(params["data"]).encode()
    return base64.b64decode(params.get("data_b64") or "")


async def drain(
    client: AsyncClient, proc: str, stop_after: int | None = None, since: int = 0
) -> tuple[dict[str, bytearray], dict[str, Any] | None, list[dict[str, Any]]]:
    """Notifications of `proc` until proc.exit (or `stop_after` stdout bytes); bytes
    before `since` are zeros in the buffers."""
    out = {"stdout": bytearray(since), "stderr": bytearray(since)}
    notices: list[dict[str, Any]] = []
    async for message in client.notifications:
        params = message["params"]
        if params.get("proc") != proc:
            continue
        if message["method"] == "proc.exit":
            return out, params, notices
        assert message["method"] == "proc.output"
        notices.append(params)
        buf = out[params["stream"]]
        assert params["offset"] == len(buf) or params.get("skipped_from") is not None, params
        del buf[params["offset"] :]
        buf += piece(params)
        if stop_after is not None and len(out["stdout"]) >= stop_after:
            return out, None, notices
    raise AssertionError("connection closed before proc.exit")


async def test_start_subscribe_signal_wait(intent_daemon: DaemonProcess) -> None:
    d = intent_daemon
    ws = d.adopt(d.make_workspace())
    call = {"workspace": ws, "profile": "tiny"}
    async with d.async_client() as c:
        long_ = (await c.call("proc.start", argv=ticks(60, 0.02), **call))["proc"]
        poll = await c.call("proc.wait", proc=long_, timeout_s=0)
        assert poll == {"proc": long_, "state": "running"}
        assert (await c.call("proc.status", proc=long_))["state"] == "running"
        sleeper = (await c.call("proc.start", argv=["sleep", "300"], **call))["proc"]
        quick = (await c.call("proc.start", argv=ticks(500, 0), **call))["proc"]

        assert (await c.call("proc.subscribe", proc=long_))["subscribed"] is True
        out, exit_, _ = await drain(c, long_)
        assert bytes(out["stdout"]) == expected_ticks(60)
        assert exit_ is not None and exit_["exit_code"] == 0

        signalled = await c.call("proc.signal", proc=sleeper, signal="KILL")
        assert signalled["delivered"] >= 1
        killed = await c.call("proc.wait", proc=sleeper)
        assert killed["signal"] == "KILL" and killed["exit_code"] == 137
        assert not killed["timed_out"]

        done = await c.call("proc.wait", proc=quick)
        assert done["exit_code"] == 0
        full = expected_ticks(500)
        # From the middle, after it ended: replayed from the record.
        await c.call("proc.subscribe", proc=quick, since=1000)
        out, exit_, _ = await drain(c, quick, since=1000)
        assert bytes(out["stdout"][1000:]) == full[1000:]
        assert exit_ is not None and exit_["stdout"]["sha256"] == done["stdout"]["sha256"]

        status = await c.call("proc.status", proc=sleeper)
        assert status["state"] == "exited" and status["signal"] == "KILL"
        assert (await c.call("proc.status", proc=quick))["stdout_bytes"] == len(full)
        listed = [p["proc"] for p in (await c.call("proc.list", workspace=ws))["processes"]]
        assert listed == [quick, sleeper, long_]
        again = await c.call("proc.signal", proc=sleeper, signal="TERM")
        assert again == {"proc": sleeper, "state": "exited", "delivered": 0}
        for method in ("proc.status", "proc.wait", "proc.subscribe"):
            with pytest.raises(RpcError) as caught:
                await c.call(method, proc="p_0000000000000000")
            assert caught.value.refusal == "process_unknown"


async def test_wait_with_timeout_returns_running(intent_daemon: DaemonProcess) -> None:
    d = intent_daemon
    ws = d.adopt(d.make_workspace())
    async with d.async_client() as c:
        proc = (await c.call("proc.start", workspace=ws, profile="tiny", argv=["sleep", "300"]))[
            "proc"
        ]
        assert await c.call("proc.wait", proc=proc, timeout_s=0.5) == {
            "proc": proc,
            "state": "running",
        }
        await c.call("proc.signal", proc=proc, signal="TERM")
        ended = await c.call("proc.wait", proc=proc, timeout_s=60)
        assert ended["signal"] == "TERM"


async def test_disconnect_detaches_and_resubscribe_has_no_gap(
    intent_daemon: DaemonProcess,
) -> None:
    d = intent_daemon
    ws = d.adopt(d.make_workspace())
    n = 300
    async with d.async_client() as first:
        proc = (await first.call("proc.start", workspace=ws, profile="tiny", argv=ticks(n)))["proc"]
        await first.call("proc.subscribe", proc=proc)
        seen, exit_, _ = await drain(first, proc, stop_after=200)
        assert exit_ is None
    # The connection is gone; the process was not killed by it.
    async with d.async_client() as second:
        await second.call("proc.subscribe", proc=proc, since=len(seen["stdout"]))
        rest, exit_, _ = await drain(second, proc, since=len(seen["stdout"]))
        assert exit_ is not None and exit_["exit_code"] == 0
    whole = bytes(seen["stdout"]) + bytes(rest["stdout"][len(seen["stdout"]) :])
    assert whole == expected_ticks(n)


def test_slow_subscriber_is_told_what_it_skipped(intent_daemon: DaemonProcess) -> None:
    d = intent_daemon
    ws = d.adopt(d.make_workspace())
    other = d.client()
    flood = ["sh", "-c", "yes 0123456789abcdef0123456789abcdef | head -c 100000000"]
    proc = other.call("proc.start", workspace=ws, profile="tiny", argv=flood)["proc"]
    slow = d.raw(timeout=120)
    request = {"jsonrpc": "2.0", "id": 1, "method": "proc.subscribe", "params": {"proc": proc}}
    slow.sendall(json.dumps(request).encode() + b"\n")

    # The slow client reads nothing while the command floods; the daemon still answers.
    def flood_over() -> bool:
        if other.call("proc.status", proc=proc)["state"] != "running":
            return True
        assert other.call("fs.stat", workspace=ws, path="README.md")
        return False

    wait_until(flood_over, 300, interval=0.2, message="the flood never ended")
    skipped: list[dict[str, Any]] = []
    got_exit = None
    reader = slow.makefile("rb")
    for line in reader:
        message = json.loads(line)
        if message.get("method") == "proc.output" and "skipped_from" in message["params"]:
            skipped.append(message["params"])
        if message.get("method") == "proc.exit":
            got_exit = message["params"]
            break
    reader.close()
    slow.close()
    assert got_exit is not None and got_exit["exit_code"] == 0
    assert got_exit["stdout"]["bytes"] == 100_000_000
    assert skipped, "a subscriber far behind must be told it skipped"
    first = skipped[0]
    assert first["skipped_from"] < first["offset"]


def test_closing_the_connection_never_kills_a_started_process(
    intent_daemon: DaemonProcess,
) -> None:
    d = intent_daemon
    ws = d.adopt(d.make_workspace())
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(d.agent_path))
        request = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "proc.start",
            "params": {"workspace": ws, "profile": "tiny", "argv": ticks(50)},
        }
        s.sendall(json.dumps(request).encode() + b"\n")
        proc = json.loads(s.makefile("rb").readline())["result"]["proc"]
    result = d.client().call("proc.wait", proc=proc)
    assert result["exit_code"] == 0 and result["stdout"]["inline"] == expected_ticks(50).decode()


# --- signals, cancellation, records that read the same every time ------------------------


@pytest.mark.parametrize("name", ["TERM", "INT", "KILL"])
async def test_a_signal_right_after_start_reaches_the_command(
    intent_daemon: DaemonProcess, name: str
) -> None:
    d = intent_daemon
    ws = d.adopt(d.make_workspace())
    call = {"workspace": ws, "profile": "tiny"}
    async with d.async_client() as c:
        await c.call("proc.run", argv=["true"], **call)  # a warm sandbox: the fast path
        for _ in range(6):
            proc = (await c.call("proc.start", argv=["sleep", "300"], **call))["proc"]
            sent = await c.call("proc.signal", proc=proc, signal=name)
            assert sent["delivered"] >= 1, sent
            ended = await c.call("proc.wait", proc=proc, timeout_s=60)
            assert ended.get("signal") == name, ended


def _running_in(docker_client: Any, state_dir: Any, needle: str) -> list[str]:
    """Command lines containing `needle` in this daemon's sandboxes (from the engine)."""
    label = f"{LABEL_DAEMON}={daemon_id_for(state_dir)}"
    found = []
    for ctr in docker_client.api.containers(filters={"label": label}):
        top = docker_client.api.top(ctr["Id"])
        found += [" ".join(p) for p in top.get("Processes") or [] if needle in " ".join(p)]
    return found


#: Writes a denied file, then says so, then waits to be cut off.
SETTLE_SCRIPT = "echo x > {tag}.lock; echo started-{tag}; sleep 300"


async def _until_output(c: AsyncClient, ws: str) -> str:
    """The newest process of `ws` once it has written to stdout (so its lock file too)."""

    async def newest_with_output() -> str:
        listed = (await c.call("proc.list", workspace=ws))["processes"]
        return str(listed[0]["proc"]) if listed and listed[0]["stdout_bytes"] > 0 else ""

    return await wait_until_async(newest_with_output, 30, interval=0.05)


async def test_a_run_whose_connection_closes_is_killed_gated_and_keeps_its_output(
    intent_daemon: DaemonProcess, docker_client: Any
) -> None:
    d = intent_daemon
    path = d.make_workspace()
    ws = d.adopt(path, policy={"write_deny": ["*.lock"]})
    script = SETTLE_SCRIPT.format(tag="closed")
    with d.raw() as s:
        request = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "proc.run",
            "params": {"workspace": ws, "profile": "tiny", "argv": ["sh", "-c", script]},
        }
        s.sendall(json.dumps(request).encode() + b"\n")
        async with d.async_client() as c:
            proc = await _until_output(c, ws)
    # The connection is closed: the run is cancelled, and settled.
    async with d.async_client() as c:
        result = await c.call("proc.wait", proc=proc, timeout_s=60)
    assert result["stdout"]["inline"] == "started-closed\n", result
    assert result["signal"] in ("TERM", "KILL")
    assert [(b["path"], b["change"]) for b in result["policy_blocked"]] == [
        (f"{path.name}:closed.lock", "create")
    ]
    assert not (path / "closed.lock").exists()
    assert result["facts_summary"]["verified"] is True
    assert _running_in(docker_client, d.state_dir, "sleep 300") == []


async def test_a_daemon_stop_kills_runs_and_keeps_their_output(
    intent_daemon: DaemonProcess, docker_client: Any
) -> None:
    d = intent_daemon
    path = d.make_workspace()
    ws = d.adopt(path, policy={"write_deny": ["*.lock"]})
    script = SETTLE_SCRIPT.format(tag="stopped")
    async with d.async_client() as c:
        started = (
            await c.call("proc.start", workspace=ws, profile="tiny", argv=["sh", "-c", script])
        )["proc"]
        assert await _until_output(c, ws) == started
    d.restart()
    async with d.async_client() as c:
        result = await c.call("proc.wait", proc=started, timeout_s=10)
        status = await c.call("proc.status", proc=started)
    assert status["state"] == "exited", status
    assert result["stdout"]["inline"] == "started-stopped\n", result
    assert [(b["path"], b["change"]) for b in result["policy_blocked"]] == [
        (f"{path.name}:stopped.lock", "create")
    ]
    assert not (path / "stopped.lock").exists()
    exited = [e for e in d.journal({"proc.exited"}) if e["data"]["proc"] == started]
    assert len(exited) == 1 and exited[0]["data"]["cancelled"] is True


async def test_a_result_reads_the_same_every_time(intent_daemon: DaemonProcess) -> None:
    d = intent_daemon
    path = d.make_workspace()
    ws = d.adopt(path, policy={"write_deny": ["*.lock"]})
    argv = ["sh", "-c", "echo hi; echo x > again.lock"]
    async with d.async_client() as c:
        first = await c.call("proc.run", workspace=ws, profile="tiny", argv=argv, facts="full")
    assert first["facts"] and first["policy_blocked"], first

    async def reads() -> list[dict[str, Any]]:
        async with d.async_client() as c:
            waited = await c.call("proc.wait", proc=first["proc"], facts="full")
            status = await c.call("proc.status", proc=first["proc"], facts="full")
            await c.call("proc.subscribe", proc=first["proc"], facts="full")
            _, exit_, _ = await drain(c, first["proc"])
        assert exit_ is not None
        return [waited, status, exit_]

    before = await reads()
    d.restart()  # from the record now, not from memory
    for read in before + await reads():
        assert read["facts"] == first["facts"], read
        assert read["facts_digest"] == first["facts_digest"], read
        assert read["usage"] == first["usage"], read
        assert read["policy_blocked"] == first["policy_blocked"], read
