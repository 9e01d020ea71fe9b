"""Benchmark of fast exec (docs/fast-exec.md): one run, ratios against baselines
measured in the same run, taking turns so background load hits every side alike.

    python3 bench/fast_exec.py [--runs 60] [--rounds 3]

Two real daemons (`python -m substrate serve`), one with the default configuration (fast
exec) and one with `fast_exec = false` (every command an engine exec), each with one
adopted workspace and three warm sandboxes of it (substrate-sandbox:bookworm): `gvisor`
(runsc; the stream supervisor on the fast daemon, the engine's exec on the other), and
two under runc: the
`default` profile (`workspace = "layer"`: a working layer whose generation every command
joins and concludes) and `interactive` (`workspace = "rw"`: a plain bind mount, the write
gate's check around each command). The two show the supervisor path's own cost (rw)
apart from the working layer's per-command cost (layer). Driven through the agent socket:

1. warm `proc.run ["true"]`, p50/p90 over --runs, one at a time (the sides in turn):
   fast path (layer, rw), engine path (layer, rw), `gvisor` on the stream supervisor and on the engine path,
   `docker exec <ctr> true` (CLI) on the rw sandbox's container and
   on the gvisor one, the SDK's `exec_run` on the rw one, and a host fork/exec of
   /bin/true (`os.posix_spawn` + `waitpid`);
   then back to back (blocks of 20 per side, in turn): the fast path (layer, rw) and
   `docker exec` (CLI);
2. CPU per warm `true` on the fast path, per profile: the daemon's, and the
   supervisor's with its children (the commands), load-independent (the engine's side
   is shared with whatever else uses the engine on this host, so it is not attributed);
   and the engine path's daemon CPU;
3. 100 sequential small commands (`ls /workspace`, `cat /workspace/README`,
   `python3 -c pass`, in turn): total wall time of each side, --rounds times (medians).

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

from bench.benchdaemon import BenchDaemon, cgroup_favordynmods
from substrate.protocol.client import Client
from substrate.sandbox.supervisor import agent

SMALL = (["ls", "/workspace"], ["cat", "/workspace/README"], ["python3", "-c", "pass"])
#: The profiles compared: a working layer ("layer") and a plain rw bind ("rw"), both runc;
#: and gVisor (runsc, rw), whose supervisor speaks over its exec's attach stream
#: (docs/fast-exec.md "Under gVisor").
LAYER, RW, GVISOR = "default", "interactive", "gvisor"
PROFILES = (LAYER, RW, GVISOR)
#: The path each profile's commands take on the fast daemon.
FAST_VIA = {LAYER: "supervisor", RW: "supervisor", GVISOR: "supervisor"}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def in_blocks(fns: list[Callable[[], object]], block: int, rounds: int) -> list[list[float]]:
    """Time each fn `block` times back to back (ms), the sides taking turns by block,
    `rounds` times: an agent's burst of commands, background load still shared alike."""
    out: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for k in range(len(fns)):
            i = (r + k) % len(fns)
            for _ in range(block):
                t = time.perf_counter()
                fns[i]()
                out[i].append((time.perf_counter() - t) * 1000)
    return out


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
    """One daemon with one adopted workspace and a warm sandbox of each of `PROFILES`."""

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
        self.containers: dict[str, str] = {}
        for profile in PROFILES:
            first = self.run(["true"], profile)
            assert first["via"] == (FAST_VIA[profile] if fast else "engine"), first
            probe = self.client.call("facts.probe", workspace=self.ws, profile=profile)
            self.containers[profile] = probe["container"]

    def run(self, argv: list[str], profile: str) -> Any:
        result = self.client.call("proc.run", workspace=self.ws, profile=profile, argv=argv)
        assert result["exit_code"] == 0, result
        return result

    def runner(self, profile: str) -> Callable[[list[str]], object]:
        return lambda argv: self.run(argv, profile)

    def close(self) -> None:
        self.client.close()
        self.daemon.stop()


def cpu(proc: psutil.Process) -> float:
    """User + system seconds of `proc` and its reaped children."""
    t = proc.cpu_times()
    return float(t.user + t.system + t.children_user + t.children_system)


def find_supervisor(container: str) -> psutil.Process:
    """The supervisor process of `container` (its cgroup names the container's id; its
    held child has the same command line, and the supervisor for its parent)."""
    found = []
    for p in psutil.process_iter(["cmdline", "ppid"]):
        if p.info["cmdline"] != list(agent.COMMAND):
            continue
        try:
            cgroup = Path(f"/proc/{p.pid}/cgroup").read_text()
            parent = psutil.Process(p.info["ppid"]).cmdline()
        except (OSError, psutil.Error):
            continue
        if container in cgroup and parent != list(agent.COMMAND):
            found.append(p)
    if len(found) != 1:
        raise SystemExit(f"expected one supervisor of {container[:12]}, found {len(found)}")
    return found[0]


def host_true() -> None:
    pid = os.posix_spawn("/bin/true", ["true"], {})
    os.waitpid(pid, 0)


def cpu_per_true(
    daemon: psutil.Process,
    supervisor: psutil.Process | None,
    run: Callable[[list[str]], object],
    n: int,
) -> tuple[float, float]:
    """(daemon ms, supervisor and command ms) per warm `true`, over `n` runs."""
    d0 = cpu(daemon)
    s0 = cpu(supervisor) if supervisor is not None else 0.0
    for _ in range(n):
        run(["true"])
    d1 = cpu(daemon)
    s1 = cpu(supervisor) if supervisor is not None else 0.0
    return (d1 - d0) * 1000 / n, (s1 - s0) * 1000 / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"load average at the start: {os.getloadavg()}")
    sdk = docker.from_env()
    base = Path(tempfile.mkdtemp(prefix="substrate-bench-fx-"))
    fast = engine = None
    try:
        fast = Side(base / "fast", fast=True)
        engine = Side(base / "engine", fast=False)
        ctr = sdk.containers.get(fast.containers[RW])
        cli = ["docker", "exec", ctr.id]
        gvisor_cli = ["docker", "exec", fast.containers[GVISOR]]

        sides: list[tuple[str, Callable[[], object]]] = [
            (f"fast {LAYER} (layer)", lambda: fast.run(["true"], LAYER)),
            (f"fast {RW} (rw)", lambda: fast.run(["true"], RW)),
            (f"engine {LAYER} (layer)", lambda: engine.run(["true"], LAYER)),
            (f"engine {RW} (rw)", lambda: engine.run(["true"], RW)),
            (f"{GVISOR} stream (runsc, rw)", lambda: fast.run(["true"], GVISOR)),
            (f"{GVISOR} engine (runsc, rw)", lambda: engine.run(["true"], GVISOR)),
            ("docker exec CLI", lambda: subprocess.run([*cli, "true"], check=True)),
            ("docker exec CLI, runsc", lambda: subprocess.run([*gvisor_cli, "true"], check=True)),
            ("SDK exec_run", lambda: ctr.exec_run(["true"])),
            ("host", host_true),
        ]
        names = [n for n, _ in sides]
        for _, fn in sides:  # warm every path once more
            fn()
        times = interleaved([fn for _, fn in sides], args.runs)
        p50 = {n: statistics.median(t) for n, t in zip(names, times, strict=True)}
        print(f"warm `true`, {args.runs} runs each (ms)   p50      p90      min")
        for n, t in zip(names, times, strict=True):
            print(f"  {n:28s} {p50[n]:8.2f} {pct(t, 0.9):8.2f} {min(t):8.2f}")
        cli50 = p50["docker exec CLI"]
        g50 = p50[f"{GVISOR} stream (runsc, rw)"]
        ge50 = p50[f"{GVISOR} engine (runsc, rw)"]
        print(
            f"  ratios p50, {GVISOR}: stream/docker exec (runsc)"
            f" {g50 / p50['docker exec CLI, runsc']:.3f},"
            f" stream/engine path (runsc) {g50 / ge50:.3f},"
            f" engine path/docker exec (runsc) {ge50 / p50['docker exec CLI, runsc']:.3f}"
        )
        for profile, kind in ((RW, "rw"), (LAYER, "layer")):
            f50 = p50[f"fast {profile} ({kind})"]
            print(
                f"  ratios p50, {kind}: fast/docker exec {f50 / cli50:.3f}, "
                f"fast/exec_run {f50 / p50['SDK exec_run']:.3f}, "
                f"fast/engine path {f50 / p50[f'engine {profile} ({kind})']:.3f}, "
                f"fast/host {f50 / p50['host']:.1f}"
            )

        # The same, back to back: a burst of commands in one sandbox (each side in
        # blocks of 20, the sides taking turns), where the one-at-a-time figures above
        # have every command follow the other sides' (their wake-ups and engine work).
        burst = [
            (f"fast {LAYER} (layer)", lambda: fast.run(["true"], LAYER)),
            (f"fast {RW} (rw)", lambda: fast.run(["true"], RW)),
            ("docker exec CLI", lambda: subprocess.run([*cli, "true"], check=True)),
        ]
        rounds = max(1, args.runs // 20)
        btimes = in_blocks([fn for _, fn in burst], 20, rounds)
        b50 = {n: statistics.median(t) for (n, _), t in zip(burst, btimes, strict=True)}
        print(f"warm `true` back to back, {rounds} blocks of 20 each (ms)   p50      p90")
        for (n, _), t in zip(burst, btimes, strict=True):
            print(f"  {n:28s} {b50[n]:8.2f} {pct(t, 0.9):8.2f}")
        print(
            f"  ratios p50 back to back: layer/docker exec"
            f" {b50[f'fast {LAYER} (layer)'] / b50['docker exec CLI']:.3f},"
            f" rw/docker exec {b50[f'fast {RW} (rw)'] / b50['docker exec CLI']:.3f}"
        )

        # CPU per command (load-independent): the daemon, and the supervisor with its
        # children (the commands themselves). The engine's side (dockerd, containerd,
        # runc) is shared with whatever else uses the engine, so it is not attributed.
        count = 100
        fast_ps = psutil.Process(fast.daemon.proc.pid)
        engine_ps = psutil.Process(engine.daemon.proc.pid)
        print(f"CPU per warm `true` (ms, {count} runs each)")
        for profile, kind in ((RW, "rw"), (LAYER, "layer")):
            supervisor = find_supervisor(fast.containers[profile])
            d, s = cpu_per_true(fast_ps, supervisor, fast.runner(profile), count)
            e, _ = cpu_per_true(engine_ps, None, engine.runner(profile), count)
            print(
                f"  {kind:5s}: fast path daemon {d:.2f} + supervisor and command {s:.2f};"
                f" engine path daemon {e:.2f} (+ dockerd, containerd, runc: not attributed)"
            )

        def batch(one: Callable[[list[str]], object]) -> Callable[[], object]:
            def go() -> None:
                for i in range(100):
                    one(list(SMALL[i % len(SMALL)]))

            return go

        batches = [
            ("fast (layer)", batch(fast.runner(LAYER))),
            ("fast (rw)", batch(fast.runner(RW))),
            ("engine (rw)", batch(engine.runner(RW))),
            (
                "docker exec CLI",
                batch(lambda a: subprocess.run([*cli, *a], check=True, capture_output=True)),
            ),
        ]
        totals = interleaved([fn for _, fn in batches], args.rounds)
        print(f"100 small commands (ls, cat, python3 -c pass), total s, median of {args.rounds}")
        med = {n: statistics.median(t) / 1000 for (n, _), t in zip(batches, totals, strict=True)}
        for n, _ in batches:
            print(f"  {n:28s} {med[n]:8.2f}")
        print(
            f"  ratio to docker exec: fast (rw) {med['fast (rw)'] / med['docker exec CLI']:.3f},"
            f" fast (layer) {med['fast (layer)'] / med['docker exec CLI']:.3f};"
            f" fast (rw)/engine (rw) {med['fast (rw)'] / med['engine (rw)']:.3f}"
        )
        print(f"load average at the end: {os.getloadavg()}")
        print(f"cgroup2 favordynmods: {cgroup_favordynmods()} (scripts/cgroup-favor-dynmods)")
    finally:
        for side in (fast, engine):
            if side is not None:
                side.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
