"""Benchmark of fast exec (issue 12, docs/fast-exec.md): one run, ratios against baselines
measured in the same run, taking turns so background load hits every side alike.

    python3 bench/fast_exec.py [--runs 60] [--rounds 3]

Two real daemons (`python -m substrate serve`), one with the default configuration (fast
exec) and one with `fast_exec = false` (every command an engine exec), each with one
warm `default` sandbox (substrate-sandbox:bookworm), driven through their agent sockets:

1. warm `proc.run ["true"]`, p50/p90 over --runs: fast path, engine path, `docker exec
   <ctr> true` (CLI), the SDK's `exec_run` on the same container, and a host fork/exec
   of /bin/true (`os.posix_spawn` + `waitpid`);
2. 100 sequential small commands (`ls /workspace`, `cat /workspace/README`,
   `python3 -c pass`, in turn): total wall time of each side, --rounds times (medians);
3. CPU per warm `true` on the fast path: the daemon's, and the supervisor's with its
   children (the commands), load-independent (the engine's side is shared with whatever
   else uses the engine on this host, so it is not attributed).

Needs the engine, substrate-sandbox:bookworm, and root (workspaces are chowned to 1000).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchdaemon import BenchDaemon

from substrate.protocol.client import Client
from substrate.sandbox.supervisor import agent

SMALL = (["ls", "/workspace"], ["cat", "/workspace/README"], ["python3", "-c", "pass"])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def interleaved(fns: list[Callable[[], object]], runs: int) -> list[list[float]]:
    """Time each fn `runs` times (ms), taking turns."""
    out: list[list[float]] = [[] for _ in fns]
    for i in range(runs):
        for k in range(len(fns)):
            j = (i + k) % len(fns)
            t = time.perf_counter()
            fns[j]()
            out[j].append((time.perf_counter() - t) * 1000)
    return out


class Side:
    """One daemon with one adopted workspace and its warm default sandbox."""

    def __init__(self, base: Path, fast: bool) -> None:
        base.mkdir()
        serve_args: list[str] = []
        if not fast:
            (base / "substrate.toml").write_text("fast_exec = false\n")
            serve_args = ["--config", str(base / "substrate.toml")]
        self.daemon = BenchDaemon(base, serve_args)
        project = self.daemon.roots / "project"
        (project / ".git").mkdir(parents=True)
        (project / "README").write_text("hello\n")
        for p in (project, project / ".git", project / "README"):
            os.chown(p, 1000, 1000)
        self.client = Client(self.daemon.socket, timeout=600)
        self.ws = self.client.call("workspace.adopt", path=str(project))["workspace"]
        first = self.run(["true"])
        assert first["via"] == ("supervisor" if fast else "engine"), first
        probe = self.client.call("facts.probe", workspace=self.ws, profile="default")
        self.container: str = probe["container"]

    def run(self, argv: list[str]) -> Any:
        result = self.client.call("proc.run", workspace=self.ws, profile="default", argv=argv)
        assert result["exit_code"] == 0, result
        return result

    def close(self) -> None:
        self.client.close()
        self.daemon.stop()


def cpu(proc: psutil.Process) -> float:
    """User + system seconds of `proc` and its reaped children."""
    t = proc.cpu_times()
    return float(t.user + t.system + t.children_user + t.children_system)


def find_supervisor() -> psutil.Process:
    """The one supervisor process on this host (the fast side's sandbox)."""
    found = [
        p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == list(agent.COMMAND)
    ]
    if len(found) != 1:
        raise SystemExit(f"expected one supervisor process, found {len(found)}")
    return found[0]


def host_true() -> None:
    pid = os.posix_spawn("/bin/true", ["true"], {})
    os.waitpid(pid, 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sdk = docker.from_env()
    base = Path(tempfile.mkdtemp(prefix="substrate-bench-fx-"))
    fast = engine = None
    try:
        fast = Side(base / "fast", fast=True)
        engine = Side(base / "engine", fast=False)
        ctr = sdk.containers.get(fast.container)
        cli = ["docker", "exec", ctr.id]

        names = ["substrate fast", "substrate engine", "docker exec CLI", "SDK exec_run", "host"]
        fns: list[Callable[[], object]] = [
            lambda: fast.run(["true"]),  # type: ignore[union-attr]
            lambda: engine.run(["true"]),  # type: ignore[union-attr]
            lambda: subprocess.run([*cli, "true"], check=True),
            lambda: ctr.exec_run(["true"]),
            host_true,
        ]
        for fn in fns:  # warm every path once more
            fn()
        times = interleaved(fns, args.runs)
        p50 = {n: statistics.median(t) for n, t in zip(names, times, strict=True)}
        print(f"warm `true`, {args.runs} runs each (ms)   p50      p90      min")
        for n, t in zip(names, times, strict=True):
            print(f"  {n:28s} {p50[n]:8.2f} {pct(t, 0.9):8.2f} {min(t):8.2f}")
        cli50 = p50["docker exec CLI"]
        print(
            f"  ratios p50: fast/docker exec {p50['substrate fast'] / cli50:.3f}, "
            f"fast/exec_run {p50['substrate fast'] / p50['SDK exec_run']:.3f}, "
            f"fast/engine path {p50['substrate fast'] / p50['substrate engine']:.3f}, "
            f"fast/host {p50['substrate fast'] / p50['host']:.1f}"
        )

        # CPU per command (load-independent): the daemon, and the supervisor with its
        # children (the commands themselves). The engine's side (dockerd, containerd,
        # runc) is shared with whatever else uses the engine, so it is not attributed.
        supervisor = find_supervisor()
        daemon_ps = psutil.Process(fast.daemon.proc.pid)
        d0, s0 = cpu(daemon_ps), cpu(supervisor)
        n = 100
        for _ in range(n):
            fast.run(["true"])
        d1, s1 = cpu(daemon_ps), cpu(supervisor)
        engine_ps = psutil.Process(engine.daemon.proc.pid)
        e0 = cpu(engine_ps)
        for _ in range(n):
            engine.run(["true"])
        e1 = cpu(engine_ps)
        print(
            f"CPU per warm `true` (ms, {n} runs): fast path daemon {(d1 - d0) * 1000 / n:.2f}"
            f" + supervisor and command {(s1 - s0) * 1000 / n:.2f}; engine path daemon "
            f"{(e1 - e0) * 1000 / n:.2f} (+ dockerd, containerd, runc: not attributed)"
        )

        def batch(one: Callable[[list[str]], object]) -> Callable[[], object]:
            def go() -> None:
                for i in range(100):
                    one(list(SMALL[i % len(SMALL)]))

            return go

        sides = [
            ("substrate fast", batch(fast.run)),
            ("substrate engine", batch(engine.run)),
            (
                "docker exec CLI",
                batch(lambda a: subprocess.run([*cli, *a], check=True, capture_output=True)),
            ),
        ]
        totals = interleaved([fn for _, fn in sides], args.rounds)
        print(f"100 small commands (ls, cat, python3 -c pass), total s, median of {args.rounds}")
        med = {n: statistics.median(t) / 1000 for (n, _), t in zip(sides, totals, strict=True)}
        for n, _ in sides:
            print(f"  {n:28s} {med[n]:8.2f}")
        print(
            f"  ratio fast/docker exec {med['substrate fast'] / med['docker exec CLI']:.3f}, "
            f"fast/engine path {med['substrate fast'] / med['substrate engine']:.3f}"
        )
        print(f"load average at the end: {os.getloadavg()}")
    finally:
        for side in (fast, engine):
            if side is not None:
                side.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
