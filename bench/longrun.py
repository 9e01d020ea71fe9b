"""Long-running work benchmark: a responsive daemon under 16 output streams.

    python3 bench/longrun.py [--streams 16] [--workspaces 4] [--bytes 30000000]
                             [--idle 500] [--rounds 3] [--dir /tmp] [--keep]

Starts a real daemon (`python -m substrate --state-dir D serve --adopt-root R`) on a
private temp dir, adopts `--workspaces` workspaces (uid 1000), warms one `tiny` sandbox
in each, then, in each of `--rounds` rounds, in alternation:

1. **idle**: `--idle` sequential `fs.stat` round trips on one connection (latencies);
2. **substrate load**: `--streams` concurrent `proc.run` (one thread and connection
   each, spread over the workspaces) of `sh -c 'yes "$0" | head -c "$1"' word N`, every
   stream a distinct artifact, while the main thread does `fs.stat` in a loop until the
   last stream ends: latencies under load, wall time, aggregate MiB/s to artifacts;
3. **docker exec baseline**: the same command, `--streams` concurrent
   `docker exec <sandbox> sh -c '...' word N > file` (CLI, stdout to a file on the same
   filesystem as the state dir), in the same sandboxes, with the same `fs.stat` loop
   running (so the latency row shows what the machine alone does to the daemon).

Prints one table: `fs.stat` p50/p99 idle vs under each load (goal: p99 under substrate
load ≤ 10x idle p99), aggregate throughput both ways and their ratio, the daemon's CPU
seconds and peak RSS during the substrate load. Percentiles are over every sample of
every round; throughputs are medians of rounds. Every stream's byte count and digest
is checked (outside the timed part). Needs the engine, `substrate-tiny:latest`, root.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchdaemon import BenchDaemon  # noqa: E402
from substrate.protocol.client import Client  # noqa: E402

WORKSPACE_UID = 1000
PROFILE = "tiny"
#: A fixed script; the word and the size arrive as positional parameters.
SCRIPT = 'yes "$0" | head -c "$1"'
PROBE = "probe.txt"
MiB = 1 << 20


# --- the daemon -------------------------------------------------------------------------------


class Daemon(BenchDaemon):
    def __init__(self, base: Path) -> None:
        super().__init__(base)
        self.ps = psutil.Process(self.proc.pid)

    def client(self) -> Client:
        return Client(self.socket, timeout=600)

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return float(t.user + t.system)


def chown_tree(path: Path) -> None:
    os.lchown(path, WORKSPACE_UID, WORKSPACE_UID)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), WORKSPACE_UID, WORKSPACE_UID)


# --- measuring ------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def stat_once(client: Client, ws: str) -> float:
    t = time.perf_counter()
    client.call("fs.stat", workspace=ws, path=PROBE)
    return (time.perf_counter() - t) * 1000


@dataclass
class LoadRun:
    wall_s: float
    stats_ms: list[float]
    cpu_s: float = 0.0
    peak_rss: int = 0
    outputs: list[Any] = field(default_factory=list)


def under_load(
    daemon: Daemon, client: Client, ws: str, starters: list[Callable[[], Any]]
) -> LoadRun:
    """Run every starter in its own thread; stat in a loop until all are done."""
    outputs: list[Any] = [None] * len(starters)
    errors: list[BaseException] = []
    go = threading.Barrier(len(starters) + 1)

    def worker(i: int) -> None:
        go.wait()
        try:
            outputs[i] = starters[i]()
        except BaseException as exc:  # reported after the run
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(starters))]
    for t in threads:
        t.start()
    cpu0, peak = daemon.cpu(), daemon.ps.memory_info().rss
    go.wait()
    t0 = time.perf_counter()
    stats: list[float] = []
    while any(t.is_alive() for t in threads):
        stats.append(stat_once(client, ws))
        peak = max(peak, daemon.ps.memory_info().rss)
    wall = time.perf_counter() - t0
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return LoadRun(wall, stats, daemon.cpu() - cpu0, peak, outputs)


def expected_sha(word: str, size: int) -> str:
    line = (word + "\n").encode()
    block = line * 8192
    digest = hashlib.sha256()
    done = 0
    while done + len(block) <= size:
        digest.update(block)
        done += len(block)
    digest.update(block[: size - done])
    return digest.hexdigest()


# --- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--workspaces", type=int, default=4)
    ap.add_argument("--bytes", type=int, default=30_000_000, help="stdout bytes per stream")
    ap.add_argument("--idle", type=int, default=500, help="fs.stat samples per idle round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp", help="where the temp dir goes")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    base = Path(tempfile.mkdtemp(prefix="sbst-longrun-", dir=args.dir))
    daemon = Daemon(base)
    try:
        main_client = daemon.client()
        workspaces: list[str] = []
        containers: list[str] = []
        for i in range(args.workspaces):
            path = daemon.roots / f"ws{i}"
            path.mkdir()
            (path / PROBE).write_text("probe\n" * 100)
            chown_tree(path)
            ws = main_client.call("workspace.adopt", path=str(path))["workspace"]
            workspaces.append(ws)
            probe = main_client.call("facts.probe", workspace=ws, profile=PROFILE)
            containers.append(probe["container"])
            main_client.call("proc.run", workspace=ws, profile=PROFILE, argv=["true"])
        stat_ws = workspaces[0]
        n, size = args.streams, args.bytes
        words = [f"longrun-{k:02d}" for k in range(n)]
        digests = [expected_sha(w, size) for w in words]
        out_dir = base / "docker-out"
        out_dir.mkdir()

        def substrate_starter(k: int, rnd: int) -> Callable[[], Any]:
            def start() -> Any:
                with daemon.client() as c:
                    return c.call(
                        "proc.run",
                        workspace=workspaces[k % len(workspaces)],
                        profile=PROFILE,
                        argv=["sh", "-c", SCRIPT, words[k], str(size)],
                    )

            return start

        def docker_starter(k: int) -> Callable[[], Any]:
            def start() -> Any:
                target = out_dir / f"{k}.out"
                with target.open("wb") as f:
                    subprocess.run(
                        [
                            "docker",
                            "exec",
                            containers[k % len(containers)],
                            "sh",
                            "-c",
                            SCRIPT,
                            words[k],
                            str(size),
                        ],
                        stdout=f,
                        check=True,
                    )
                return target

            return start

        idle: list[float] = []
        ours: list[LoadRun] = []
        theirs: list[LoadRun] = []
        stat_once(main_client, stat_ws)  # warm-up
        for rnd in range(args.rounds):
            idle += [stat_once(main_client, stat_ws) for _ in range(args.idle)]
            run = under_load(
                daemon, main_client, stat_ws, [substrate_starter(k, rnd) for k in range(n)]
            )
            for k, result in enumerate(run.outputs):
                out = result["stdout"]
                if (out["bytes"], out["sha256"], result["exit_code"]) != (size, digests[k], 0):
                    raise SystemExit(f"stream {k}: wrong output {out}")
            ours.append(run)
            run = under_load(daemon, main_client, stat_ws, [docker_starter(k) for k in range(n)])
            for k, target in enumerate(run.outputs):
                if target.stat().st_size != size:
                    raise SystemExit(f"docker stream {k}: {target.stat().st_size} bytes")
                target.unlink()
            theirs.append(run)
        main_client.close()
    finally:
        daemon.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)

    total = n * size
    our_stats = [x for r in ours for x in r.stats_ms]
    their_stats = [x for r in theirs for x in r.stats_ms]
    our_mib = statistics.median(total / r.wall_s / MiB for r in ours)
    their_mib = statistics.median(total / r.wall_s / MiB for r in theirs)
    i50, i99 = pct(idle, 0.5), pct(idle, 0.99)
    o50, o99 = pct(our_stats, 0.5), pct(our_stats, 0.99)
    t50, t99 = pct(their_stats, 0.5), pct(their_stats, 0.99)
    rows = [
        ("measure", "value"),
        (f"fs.stat idle, p50 / p99 (N={len(idle)})", f"{i50:.2f} / {i99:.2f} ms"),
        (
            f"fs.stat during {n} proc.run streams, p50 / p99 (N={len(our_stats)})",
            f"{o50:.2f} / {o99:.2f} ms",
        ),
        ("  p99 under load / idle p99 (goal <= 10)", f"{o99 / i99:.1f}x"),
        (
            f"fs.stat during {n} docker exec streams, p50 / p99 (N={len(their_stats)})",
            f"{t50:.2f} / {t99:.2f} ms",
        ),
        (
            f"{n} x {size / 1e6:g} MB to artifacts via proc.run (median of {len(ours)})",
            f"{our_mib:.0f} MiB/s ({statistics.median(r.wall_s for r in ours):.2f} s)",
        ),
        (
            f"{n} x {size / 1e6:g} MB via docker exec > file (median of {len(theirs)})",
            f"{their_mib:.0f} MiB/s ({statistics.median(r.wall_s for r in theirs):.2f} s)",
        ),
        ("  throughput ratio substrate / docker exec", f"{our_mib / their_mib:.2f}"),
        (
            "daemon CPU during the proc.run load (median per round)",
            f"{statistics.median(r.cpu_s for r in ours):.2f} s",
        ),
        (
            "daemon peak RSS during the proc.run load",
            f"{max(r.peak_rss for r in ours) / MiB:.0f} MiB",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    print(
        f"cpus {os.cpu_count()}, load average before {load_before:.1f}, after {os.getloadavg()[0]:.1f}"
    )
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
