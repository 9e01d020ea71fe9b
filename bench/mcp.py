"""MCP benchmark (docs/mcp.md): an `fs.stat` round trip through `substrate mcp` vs the socket.

Starts a real daemon (`python -m substrate --state-dir D serve --adopt-root R`) on a
private temp dir, adopts a small workspace, and spawns `python -m substrate mcp` with
the MCP SDK's own stdio client (as an MCP host does). Then, in alternating rounds on
the same machine and event loop, one call at a time:

1. `tools/call fs_stat` through the MCP session (SDK client → stdio → MCP server →
   agent socket → daemon, and back);
2. `fs.stat` over the agent socket with the plain synchronous client (the baseline);
3. `fs.stat` over the agent socket with the Trio client (the one the MCP server uses).

Prints the median latency of each (the median over rounds of each round's median), its
ratio to the baseline, and the CPU time per call of this process, the MCP server and
the daemon: the load-independent check (on a loaded machine a latency waits for CPUs,
CPU time does not). Then the median time from spawning `substrate mcp` to an
initialized session.

    python bench/mcp.py [--calls 300] [--rounds 5] [--starts 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psutil
import trio

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# This file is bench/mcp.py: with bench/ first on sys.path, `import mcp` would import
# it again instead of the SDK. The SDK first, then the repo (for `bench.` and `substrate.`).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402

sys.path.insert(0, str(REPO))

from bench.benchdaemon import BenchDaemon  # noqa: E402
from substrate.protocol.client import Client, open_client  # noqa: E402

WORKSPACE_UID = 1000
WARM_UP = 20


def make_workspace(root: Path) -> Path:
    ws = root / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src" / "main.py").write_text("def main() -> None:\n    print('hello')\n")
    for path in (ws, ws / "src", ws / "src" / "main.py"):
        os.chown(path, WORKSPACE_UID, WORKSPACE_UID)
    return ws


def server_params(state: Path, workspace: str) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "substrate", "mcp", "--state-dir", str(state), "--workspace", workspace],
        env={"PYTHONPATH": str(REPO)},
    )


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


class Route:
    """One way to stat: its round medians and CPU seconds per process."""

    def __init__(self, name: str, call: Callable[[], Awaitable[object]]) -> None:
        self.name = name
        self.call = call
        self.medians: list[float] = []
        self.cpu: dict[str, float] = {}
        self.calls = 0

    async def round(self, procs: dict[str, psutil.Process], calls: int) -> None:
        before = {key: cpu_s(p) for key, p in procs.items()}
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            await self.call()
            times.append(time.perf_counter() - t)
        self.medians.append(statistics.median(times))
        self.calls += calls
        for key, p in procs.items():
            self.cpu[key] = self.cpu.get(key, 0.0) + cpu_s(p) - before[key]

    def median_ms(self) -> float:
        return statistics.median(self.medians) * 1000

    def cpu_ms(self, key: str) -> float:
        return self.cpu[key] * 1000 / self.calls

    def total_cpu_ms(self) -> float:
        return sum(self.cpu.values()) * 1000 / self.calls


async def run(daemon: BenchDaemon, workspace: str, calls: int, rounds: int, starts: int) -> None:
    args = {"path": "src/main.py"}
    errlog = await trio.to_thread.run_sync(open, daemon.base / "mcp.log", "a")
    me = psutil.Process()
    try:
        async with (
            stdio_client(server_params(daemon.state, workspace), errlog=errlog) as (read, write),
            ClientSession(read, write) as session,
            open_client(daemon.socket) as aclient,
        ):
            await session.initialize()
            (server,) = [c for c in me.children() if "mcp" in c.cmdline()]
            procs = {"client": me, "mcp server": server, "daemon": psutil.Process(daemon.proc.pid)}
            with Client(daemon.socket) as client:

                async def via_mcp() -> object:
                    result = await session.call_tool("fs_stat", args)
                    assert not result.is_error, result
                    return result

                async def via_sync() -> object:
                    return client.call("fs.stat", workspace=workspace, **args)

                async def via_trio() -> object:
                    return await aclient.call("fs.stat", workspace=workspace, **args)

                routes = [
                    Route("MCP `tools/call fs_stat` (SDK stdio client)", via_mcp),
                    Route("agent socket, sync client (baseline)", via_sync),
                    Route("agent socket, Trio client", via_trio),
                ]
                for _ in range(WARM_UP):
                    for p in routes:
                        await p.call()
                for _ in range(rounds):
                    for p in routes:
                        await p.round(procs, calls)
        start_times = []
        for _ in range(starts):
            t = time.perf_counter()
            async with (
                stdio_client(server_params(daemon.state, workspace), errlog=errlog) as (r, w),
                ClientSession(r, w) as session,
            ):
                await session.initialize()
                start_times.append(time.perf_counter() - t)
    finally:
        errlog.close()

    base = routes[1]
    print(f"fs.stat round trip, {calls} sequential calls x {rounds} rounds, load {load()}")
    print(
        "| path | median latency (round medians) | ratio | CPU per call: client + MCP "
        "server + daemon | CPU ratio |"
    )
    print("|---|---|---|---|---|")
    for p in routes:
        spread = f"{min(p.medians) * 1000:.2f}-{max(p.medians) * 1000:.2f}"
        cpu = " + ".join(f"{p.cpu_ms(k):.3f}" for k in procs)
        print(
            f"| {p.name} | {p.median_ms():.2f} ms ({spread}) "
            f"| {p.median_ms() / base.median_ms():.2f} | {cpu} = {p.total_cpu_ms():.2f} ms "
            f"| {p.total_cpu_ms() / base.total_cpu_ms():.2f} |"
        )
    median_start = statistics.median(start_times)
    print(f"spawn to initialized MCP session: {median_start:.2f} s (median of {starts})")


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--dir", default=None)
    opts = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="sbst-mcp-", dir=opts.dir))
    daemon = BenchDaemon(base)
    try:
        ws = make_workspace(daemon.roots)
        with Client(daemon.socket) as c:
            handle = str(c.call("workspace.adopt", path=str(ws))["workspace"])
        trio.run(run, daemon, handle, opts.calls, opts.rounds, opts.starts)
    finally:
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
