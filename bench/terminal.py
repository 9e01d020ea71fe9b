"""Terminal benchmark (one run; numbers go to docs/performance.md).

1. Keystroke-to-echo latency through the WebSocket (p50, p99 over 200 keystrokes)
   against the same echo over a raw `docker exec -it` attach socket in the same sandbox.
2. 100 MB of output through the PTY to one controller and 3 observers, against the
   raw attach socket.

Runs an in-process daemon on a temporary state dir and workspace (uid 1000), with an
interactive profile on `substrate-tiny:latest`; removes everything it started.
Usage: python bench/terminal.py [--keys 200] [--mbytes 100]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from substrate.config import PROJECT_ROOT, Config  # noqa: E402
from substrate.daemon import open_daemon  # noqa: E402
from substrate.protocol.client import open_client  # noqa: E402
from substrate.pty.client import open_terminal  # noqa: E402
from substrate.sandbox.engine import Engine  # noqa: E402

PROFILE = (
    'image = "substrate-tiny:latest"\nmemory = "256m"\ninteractive = true\n'
    'env = { PATH = "/bin", HOME = "/tmp", SHELL = "/bin/sh", PS1 = "$ " }\n'
)


#: The shell's environment on the raw path: what the PTY path gives it, minus the marker.
RAW_ENV = {"PATH": "/bin", "HOME": "/tmp", "TERM": "xterm-256color", "PS1": "$ "}


def producer(mbytes: int) -> str:
    """A shell line printing `mbytes` MB in large writes, then a marker its echo lacks."""
    blocks = mbytes * 1_000_000 // 65536
    return (
        f"dd if=/dev/zero bs=65536 count={blocks} 2>/dev/null | tr '\\0' x;"
        " echo; echo EN''D-OF-BENCH"
    )


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def ws_latency(url: str, token: str, session: str | None, keys: int) -> list[float]:
    out: list[float] = []
    async with open_terminal(url) as ws:
        frame: dict[str, Any] = {"type": "open", "token": token, "cols": 80, "rows": 24}
        if session:
            frame["session"] = session
        await ws.send_message(json.dumps(frame))
        assert json.loads(await ws.get_message())["type"] == "opened"
        await ws.send_message(json.dumps({"type": "input", "data": "cat\r"}))
        await trio.sleep(0.5)
        with trio.move_on_after(0.3):
            while True:
                await ws.get_message()
        for i in range(keys):
            ch = "abcdefghij"[i % 10]
            t0 = time.perf_counter()
            await ws.send_message(json.dumps({"type": "input", "data": ch}))
            while True:
                f = json.loads(await ws.get_message())
                if f["type"] == "output" and ch in f["data"]:
                    break
            out.append(time.perf_counter() - t0)
        await ws.send_message(json.dumps({"type": "input", "data": "\x03"}))
    return out


async def raw_latency(engine: Engine, container: str, user: str, keys: int) -> list[float]:
    exec_id = await engine.exec_create(
        container, ["/bin/sh"], user=user, workdir="/workspace", environment=RAW_ENV,
        stdin=True, tty=True,
    )  # fmt: skip
    es = await engine.exec_start(exec_id, tty=True)
    await engine.exec_resize(exec_id, rows=24, cols=80)  # as the PTY path does
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(es.sock))
    out: list[float] = []
    async with stream:
        await stream.send_all(b"cat\r")
        await trio.sleep(0.5)
        with trio.move_on_after(0.3):
            while True:
                await stream.receive_some(65536)
        for i in range(keys):
            ch = b"abcdefghij"[i % 10 : i % 10 + 1]
            t0 = time.perf_counter()
            await stream.send_all(ch)
            while ch not in await stream.receive_some(65536):
                pass
            out.append(time.perf_counter() - t0)
        await stream.send_all(b"\x03exit\r")
    return out


async def ws_throughput(url: str, token: str, mbytes: int) -> tuple[float, list[int], list[int]]:
    marker = "END-OF-BENCH"
    command = producer(mbytes) + "\r"
    resyncs = [0, 0, 0, 0]
    received = [0, 0, 0, 0]

    async def reader(ws: Any, idx: int, done: trio.Event) -> None:
        tail = ""
        while marker not in tail:
            f = json.loads(await ws.get_message())
            if f["type"] == "resync":
                resyncs[idx] += 1
            elif f["type"] == "output":
                tail = tail[-20:] + f["data"]
                received[idx] += len(f["data"])
        done.set()

    async with contextlib.AsyncExitStack() as stack:
        ctl = await stack.enter_async_context(open_terminal(url))
        await ctl.send_message(json.dumps({"type": "open", "token": token}))
        session = json.loads(await ctl.get_message())["session"]
        conns = [ctl]
        for _ in range(3):
            obs = await stack.enter_async_context(open_terminal(url))
            await obs.send_message(
                json.dumps({"type": "open", "token": token, "mode": "observe", "session": session})
            )
            assert json.loads(await obs.get_message())["type"] == "opened"
            conns.append(obs)
        await trio.sleep(0.5)
        events = [trio.Event() for _ in conns]
        async with trio.open_nursery() as nursery:
            t0 = time.perf_counter()
            await ctl.send_message(json.dumps({"type": "input", "data": command}))
            for i, ws in enumerate(conns):
                nursery.start_soon(reader, ws, i, events[i])
            for e in events:
                await e.wait()
            elapsed = time.perf_counter() - t0
            nursery.cancel_scope.cancel()
    return elapsed, resyncs, received


async def raw_throughput(engine: Engine, container: str, user: str, mbytes: int) -> float:
    exec_id = await engine.exec_create(
        container, ["/bin/sh"], user=user, workdir="/workspace", environment=RAW_ENV,
        stdin=True, tty=True,
    )  # fmt: skip
    es = await engine.exec_start(exec_id, tty=True)
    await engine.exec_resize(exec_id, rows=24, cols=80)  # as the PTY path does
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(es.sock))
    async with stream:
        await trio.sleep(0.3)
        with trio.move_on_after(0.3):
            while True:
                await stream.receive_some(65536)
        t0 = time.perf_counter()
        await stream.send_all((producer(mbytes) + "\r").encode())
        tail = b""
        while b"END-OF-BENCH" not in tail:
            tail = tail[-20:] + await stream.receive_some(1 << 20)
        elapsed = time.perf_counter() - t0
        await stream.send_all(b"exit\r")
    return elapsed


async def main(keys: int, mbytes: int) -> None:
    os.environ["DOCKER_HOST"] = "unix:///var/run/docker.sock"
    base = Path(tempfile.mkdtemp(prefix="sbst-bench-"))
    try:
        state, profiles, root = base / "state", base / "profiles", base / "roots"
        state.mkdir(mode=0o700)
        profiles.mkdir()
        for shipped in (PROJECT_ROOT / "profiles").glob("*.toml"):
            shutil.copy(shipped, profiles / shipped.name)
        (profiles / "bench-term.toml").write_text(PROFILE)
        project = root / "project"
        project.mkdir(parents=True)
        os.chown(project, 1000, 1000)
        config = Config(
            state_dir=str(state), adopt_roots=[str(root)], profiles_dir=str(profiles),
            listen="127.0.0.1:0",
        )  # fmt: skip
        async with open_daemon(config) as daemon, trio.open_nursery() as nursery:
            await nursery.start(daemon.serve)
            url = f"ws://127.0.0.1:{daemon.terminals.http.port}/pty"
            async with open_client(state / "operator.sock") as op:
                ws = (await op.call("workspace.adopt", path=str(project)))["workspace"]

                async def grant(uses: int) -> str:
                    g = await op.call(
                        "grant.issue", kind="interactive_terminal", workspace=ws,
                        profile="bench-term", uses=uses,
                    )  # fmt: skip
                    token: str = g["token"]
                    return token

                lat_ws = await ws_latency(url, await grant(1), None, keys)
                # The terminal's sandbox: started by the grant's session, still warm.
                sandbox = daemon.execution.containers.cached(ws, "bench-term")
                assert sandbox is not None, "the terminal's sandbox is gone"
                engine = daemon.execution.engine
                lat_raw = await raw_latency(engine, sandbox.id, str(sandbox.who), keys)
                raw_s = await raw_throughput(engine, sandbox.id, str(sandbox.who), mbytes)
                ws_s, resyncs, received = await ws_throughput(url, await grant(4), mbytes)
            nursery.cancel_scope.cancel()
        ms = 1000.0
        print(f"keystroke echo, {keys} keys (ms):")
        print(
            f"  websocket  p50 {statistics.median(lat_ws) * ms:.3f}  p99 {pct(lat_ws, 99) * ms:.3f}"
        )
        print(
            f"  raw attach p50 {statistics.median(lat_raw) * ms:.3f}  p99 {pct(lat_raw, 99) * ms:.3f}"
        )
        goal = 1.5 * statistics.median(lat_raw) * ms + 1
        print(f"  goal p50 <= 1.5 x raw + 1 ms = {goal:.3f}: "
              f"{'met' if statistics.median(lat_ws) * ms <= goal else 'NOT met'}")  # fmt: skip
        print(f"{mbytes} MB of output:")
        print(f"  websocket, controller + 3 observers: {ws_s:.2f} s = {mbytes / ws_s:.1f} MB/s "
              f"(resyncs per client: {resyncs};"
              f" MB shown per client: {[round(r / 1e6, 1) for r in received]})")  # fmt: skip
        print(f"  raw attach socket, one reader:      {raw_s:.2f} s = {mbytes / raw_s:.1f} MB/s")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--mbytes", type=int, default=100)
    args = parser.parse_args()
    trio.run(main, args.keys, args.mbytes)
