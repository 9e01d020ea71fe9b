"""Benchmark of the warm pool (docs/execution.md, "The warm pool"; docs/performance.md,
"Warm pool"): one run, baselines measured in the same run, taking turns.

    python3 bench/pool.py [--runs 10] [--density 100] [--density-pool 100,16]

1. The first command (`proc.run ["true"]`, profile `default`: a working layer on
   substrate-sandbox:bookworm, runc) of a new workspace, p50 over --runs, on two real
   daemons: one with `warm_sandboxes = {default = 2}` (each run waits until the pool is
   full again, so it measures a bind, not a cold create), one without (today's path);
   against `docker run --rm --network none <image> true`. Interleaved.
2. Density, once per size in --density-pool (a pool sized for the burst, then one
   smaller, whose remaining sandboxes are made at the engine's pace): --density new
   workspaces each run their first command at once (one
   connection each) on a daemon with `warm_sandboxes = {default = N}` and
   `max_processes` above --density: the wall time of all, the daemon's peak RSS, and
   then the host memory of each idle sandbox (its container cgroup's usage, median) and
   the host's available memory drop per sandbox.

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
import threading
import time
from pathlib import Path
from typing import Any

import docker
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchdaemon import BenchDaemon
from substrate.protocol.client import Client

IMAGE = "substrate-sandbox:bookworm"
PROFILE = "default"


class Side:
    """A daemon (config `toml`) whose adopt root is uid 1000's: whom the pool fills for."""

    def __init__(self, base: Path, toml: str) -> None:
        base.mkdir()
        (base / "substrate.toml").write_text(toml)
        self.daemon = BenchDaemon(base, ["--config", str(base / "substrate.toml")])
        os.chown(self.daemon.roots, 1000, 1000)
        self.client = Client(self.daemon.socket, timeout=120)
        self.made = 0

    def new_workspace(self) -> str:
        self.made += 1
        path = self.daemon.roots / f"ws{self.made}"
        (path / ".git").mkdir(parents=True)
        (path / "README").write_text("hello\n")
        for p in (path, path / ".git", path / "README"):
            os.chown(p, 1000, 1000)
        return str(self.client.call("workspace.adopt", path=str(path))["workspace"])

    def first(self, ws: str, client: Client | None = None) -> None:
        result = (client or self.client).call(
            "proc.run", workspace=ws, profile=PROFILE, argv=["true"]
        )
        assert result["exit_code"] == 0, result

    def pool(self) -> dict[str, Any]:
        status: dict[str, Any] = self.client.call("daemon.status")["warm_pool"].get(PROFILE, {})
        return status

    def wait_full(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (s := self.pool()).get("ready", 0) < s.get("wanted", 0):
            if time.monotonic() > deadline:
                raise SystemExit(f"the pool did not fill: {s}")
            time.sleep(0.05)

    def close(self) -> None:
        self.client.close()
        self.daemon.stop()


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def first_commands(pooled: Side, plain: Side, runs: int) -> None:
    docker_run = ["docker", "run", "--rm", "--network", "none", IMAGE, "true"]
    subprocess.run(docker_run, check=True)
    pooled.first(pooled.new_workspace())  # warm both daemons' code paths once
    plain.first(plain.new_workspace())
    with_pool, without, runs_ms = [], [], []
    for _ in range(runs):
        pooled.wait_full()
        ws = pooled.new_workspace()
        with_pool.append(timed(lambda ws=ws: pooled.first(ws)))
        ws2 = plain.new_workspace()
        without.append(timed(lambda ws2=ws2: plain.first(ws2)))
        runs_ms.append(timed(lambda: subprocess.run(docker_run, check=True)))
    p, w, d = (statistics.median(x) for x in (with_pool, without, runs_ms))
    print(f"first command of a new workspace ({PROFILE}), ms, {runs} runs   p50     min")
    print(f"  with the pool (warm_sandboxes = 2)   {p:8.1f} {min(with_pool):8.1f}")
    print(f"  without (today's path)               {w:8.1f} {min(without):8.1f}")
    print(f"  docker run --rm true                 {d:8.1f} {min(runs_ms):8.1f}")
    print(
        f"  ratios p50: pool/docker run {p / d:.3f} (goal <= 0.33), without/docker run "
        f"{w / d:.3f}, pool/without {p / w:.3f}"
    )


def container_memory(sdk: Any, container: str) -> int:
    stats = sdk.api.stats(container, stream=False)
    mem = stats.get("memory_stats") or {}
    usage = int(mem.get("usage") or 0)
    cache = int((mem.get("stats") or {}).get("cache") or 0)
    return usage - cache


def available() -> int:
    return int(psutil.virtual_memory().available)


def density(base: Path, n: int, pool_size: int) -> None:
    side = Side(
        base / f"density-{pool_size}",
        f"warm_sandboxes = {{{PROFILE} = {pool_size}}}\nmax_processes = {n + 16}\n",
    )
    try:
        handles = [side.new_workspace() for _ in range(n)]
        fill_t = time.perf_counter()
        side.wait_full(timeout_s=600.0)
        fill_s = time.perf_counter() - fill_t
        proc = psutil.Process(side.daemon.proc.pid)
        rss_before = proc.memory_info().rss
        peak = [rss_before]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                time.sleep(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        clients = [Client(side.daemon.socket, timeout=600) for _ in range(n)]
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                side.first(handles[i], clients[i])
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        avail_before = available()
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t
        stop.set()
        watcher.join()
        for c in clients:
            c.close()
        time.sleep(2.0)  # the sandboxes settle idle
        avail_after = available()
        sdk = docker.from_env()
        ids = [
            side.client.call("facts.probe", workspace=ws, profile=PROFILE)["container"]
            for ws in handles[: min(n, 20)]
        ]
        per = statistics.median(container_memory(sdk, c) for c in ids)
        print(f"density: {n} new workspaces' first commands at once (pool of {pool_size})")
        print(f"  the pool filled in {fill_s:.1f} s (after the {n} adopts)")
        print(f"  wall {wall:.2f} s (goal <= 10), failures {len(errors)}")
        for exc in errors[:3]:
            print(f"    {type(exc).__name__}: {str(exc)[:300]}")
        print(
            f"  daemon RSS {rss_before / 2**20:.1f} MiB before, peak {peak[0] / 2**20:.1f} MiB"
            " (goal <= 150)"
        )
        print(
            f"  per idle sandbox: cgroup memory {per / 2**20:.1f} MiB (median of {len(ids)}),"
            f" host available drop {(avail_before - avail_after) / n / 2**20:.1f} MiB"
        )
    finally:
        stop_t = time.perf_counter()
        side.close()
        print(f"  daemon stopped in {time.perf_counter() - stop_t:.1f} s (removing every sandbox)")


def docker_burst(n: int) -> float:
    """The baseline of a burst: `n` plain `docker run -d` at once (then removed)."""
    ids: list[str] = []
    argv = ["docker", "run", "-d", "--network", "none", IMAGE, "sleep", "infinity"]

    def one() -> None:
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
        ids.append(done.stdout.strip())

    threads = [threading.Thread(target=one) for _ in range(n)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    if ids:
        subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, check=False)
    return wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--density", type=int, default=100)
    ap.add_argument(
        "--density-pool",
        default="100,16",
        help="pool sizes, one density run each: one sized for the burst, one smaller",
    )
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="substrate-bench-pool-"))
    os.chmod(base, 0o755)
    pooled = plain = None
    try:
        pooled = Side(base / "pooled", f"warm_sandboxes = {{{PROFILE} = 2}}\n")
        plain = Side(base / "plain", "")
        if args.runs:
            first_commands(pooled, plain, args.runs)
        pooled.close()
        plain.close()
        pooled = plain = None
        if args.density:
            for pool_size in (int(x) for x in args.density_pool.split(",")):
                density(base, args.density, pool_size)
            print(
                f"baseline: {args.density} plain `docker run -d` at once:"
                f" {docker_burst(args.density):.2f} s"
            )
        print(f"load average at the end: {os.getloadavg()}")
    except BaseException:
        for log in base.glob("*/daemon.log"):
            print(f"--- {log}:\n{log.read_text()[-3000:]}", file=sys.stderr)
        raise
    finally:
        for side in (pooled, plain):
            if side is not None:
                side.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
