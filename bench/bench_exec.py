"""Benchmark of confined execution: one run, ratios against the engine's own tools.

    python3 bench/bench_exec.py [--runs 50] [--skip-gvisor] [--skip-big]

Starts a real daemon (`python -m substrate serve`) in a temporary state dir, drives it
through its agent socket with the synchronous client, and compares:

1. warm `proc.run ["true"]` (p50/p95 over --runs) with `docker exec <ctr> true` (CLI)
   and the SDK's `exec_run` on the same container;
2. the first command in a new workspace (container create + start + fact checks) with
   `docker run --rm --network none <image> true`;
3. 1 GiB of output through `proc.run` into an artifact with
   `docker exec <ctr> sh -c 'head -c 1G /dev/zero' > file`, and the daemon's peak RSS;
4. warm `true` under the `gvisor` profile.

Needs the engine, both images, and root (workspaces are chowned to uid 1000).
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from substrate.protocol.client import Client  # noqa: E402

GIB = 1 << 30


def percentiles(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def interleaved(fns: list[Callable[[], object]], runs: int) -> list[list[float]]:
    """Time each fn `runs` times, taking turns, so background load hits all alike."""
    out: list[list[float]] = [[] for _ in fns]
    for i in range(runs):
        for k in range(len(fns)):
            j = (i + k) % len(fns)
            t = time.perf_counter()
            fns[j]()
            out[j].append((time.perf_counter() - t) * 1000)
    return out


def new_workspace(root: Path, name: str) -> Path:
    path = root / name
    (path / ".git").mkdir(parents=True)
    for p in (path, path / ".git"):
        os.chown(p, 1000, 1000)
    return path


class Daemon:
    def __init__(self, base: Path) -> None:
        self.state = base / "state"
        self.roots = base / "roots"
        self.roots.mkdir(parents=True)
        cmd = [
            sys.executable,
            "-m",
            "substrate",
            "--state-dir",
            str(self.state),
            "serve",
            "--adopt-root",
            str(self.roots),
        ]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL)
        sock = self.state / "substrate.sock"
        deadline = time.monotonic() + 30
        while not sock.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit("daemon did not start")
            time.sleep(0.05)
        self.client = Client(sock, timeout=600)
        self.ps = psutil.Process(self.proc.pid)

    def adopt(self, name: str) -> str:
        path = new_workspace(self.roots, name)
        ws: str = self.client.call("workspace.adopt", path=str(path))["workspace"]
        return ws

    def run(self, ws: str, argv: list[str], profile: str = "default") -> Any:
        return self.client.call("proc.run", workspace=ws, profile=profile, argv=argv)

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(60)


def peak_rss_during(ps: psutil.Process, fn: Callable[[], object]) -> tuple[float, int]:
    peak = ps.memory_info().rss
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, ps.memory_info().rss)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t = time.perf_counter()
    try:
        fn()
    finally:
        elapsed = time.perf_counter() - t
        done.set()
        sampler.join()
    return elapsed, peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--skip-gvisor", action="store_true")
    ap.add_argument("--skip-big", action="store_true")
    args = ap.parse_args()
    sdk = docker.from_env()
    base = Path(tempfile.mkdtemp(prefix="substrate-bench-"))
    daemon = Daemon(base)
    report: list[str] = []
    try:
        # 1. warm true
        ws = daemon.adopt("warm")
        daemon.run(ws, ["true"])
        short = daemon.client.call("facts.probe", workspace=ws, profile="default")["container"]
        ctr = sdk.containers.get(short)
        ours, cli, sdk_run = interleaved(
            [
                lambda: daemon.run(ws, ["true"]),
                lambda: subprocess.run(["docker", "exec", ctr.id, "true"], check=True),
                lambda: ctr.exec_run(["true"]),
            ],
            args.runs,
        )
        (o50, o95), (c50, c95), (s50, s95) = map(percentiles, (ours, cli, sdk_run))
        report += [
            "warm true (ms)          p50      p95",
            f"  proc.run           {o50:7.1f}  {o95:7.1f}",
            f"  docker exec (CLI)  {c50:7.1f}  {c95:7.1f}",
            f"  SDK exec_run       {s50:7.1f}  {s95:7.1f}",
            f"  ratio p50: {o50 / c50:.2f}x CLI, {o50 / s50:.2f}x exec_run",
        ]

        # 2. first command in a new workspace
        firsts = []
        for i in range(5):
            fresh = daemon.adopt(f"first{i}")
            t = time.perf_counter()
            daemon.run(fresh, ["true"])
            firsts.append((time.perf_counter() - t) * 1000)
            daemon.client.call("workspace.release", workspace=fresh)
        image = "substrate-sandbox:bookworm"
        runs = timed(
            lambda: subprocess.run(
                ["docker", "run", "--rm", "--network", "none", image, "true"], check=True
            ),
            5,
        )  # not interleaved: each first command needs a fresh workspace
        f50, r50 = statistics.median(firsts), statistics.median(runs)
        report += [
            "first command (ms, median of 5)",
            f"  proc.run (new workspace)   {f50:7.1f}",
            f"  docker run --rm true       {r50:7.1f}",
            f"  ratio: {f50 / r50:.2f}x",
        ]

        # 3. 1 GiB of output
        if not args.skip_big:
            idle = daemon.ps.memory_info().rss
            box: dict[str, Any] = {}

            def big() -> None:
                box["r"] = daemon.run(ws, ["head", "-c", str(GIB), "/dev/zero"])

            elapsed, peak = peak_rss_during(daemon.ps, big)
            out = box["r"]["stdout"]
            target = base / "cli-out"
            t = time.perf_counter()
            with target.open("wb") as f:
                subprocess.run(
                    ["docker", "exec", ctr.id, "head", "-c", str(GIB), "/dev/zero"],
                    stdout=f,
                    check=True,
                )
            cli_s = time.perf_counter() - t
            target.unlink()
            ours_mb, cli_mb = GIB / elapsed / 2**20, GIB / cli_s / 2**20
            report += [
                "1 GiB of output",
                f"  proc.run -> artifact    {elapsed:6.2f} s  {ours_mb:7.1f} MiB/s"
                f"  (bytes={out['bytes']}, truncated={out['truncated']})",
                f"  docker exec > file      {cli_s:6.2f} s  {cli_mb:7.1f} MiB/s",
                f"  throughput ratio: {ours_mb / cli_mb:.2f}",
                f"  daemon RSS idle {idle / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB"
                f" (+{(peak - idle) / 2**20:.1f})",
            ]

        # 4. warm true under gVisor
        if not args.skip_gvisor:
            gws = daemon.adopt("gvisor")
            daemon.run(gws, ["true"], "gvisor")
            g = timed(lambda: daemon.run(gws, ["true"], "gvisor"), args.runs)
            g50, g95 = percentiles(g)
            report += [f"warm true under gvisor (ms)  p50 {g50:.1f}  p95 {g95:.1f}"]
    finally:
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)
        sdk.close()
    print("\n".join(report))


if __name__ == "__main__":
    main()
