"""Where the wall-clock time of one sequential guarded write goes (docs/performance.md).

A real daemon, started through `write_probes.py` (stamps around each step of the write
path), takes `--writes` sequential 4 KiB replaces of one file on one connection; the
client times each round trip. Printed: the median of each step and of each gap between
steps, in microseconds, in the order they happen, with the local loop's steps (temp
file, write, fsync, rename, directory fsync) measured in the same run beside them:

    python bench/write_breakdown.py [--dir /tmp] [--writes 400] [--repo CHECKOUT]

`--flushes N` measures instead what one write's first durability point costs made in
different ways (N times each, interleaved): the temp file's fsync alone (the loop's),
that fsync beside a WAL-like file's `fdatasync` on another thread (what a write does
today: its temp file and its intent), and one `syncfs(2)` for both; first on a quiet
file system, then while another process keeps rewriting a 512 MiB file there without
flushing it (a build, an editor's save, an image pull on the same disk).

The client's stamps and the daemon's are of one clock (`perf_counter`, CLOCK_MONOTONIC),
so the first and last rows are the client's encode and decode, the socket, and the event
loop's wake-up, read and send.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchdaemon import BenchDaemon  # noqa: E402
from bench.foundation_writes import chown_tree, payload  # noqa: E402
from substrate.protocol.client import Client  # noqa: E402

#: The steps of one write in the order they happen (`write_probes.py`'s names).
STEPS = [
    ("dispatch", "request decoded, validated, its task spawned (event loop)"),
    ("write", None),
    ("plan", "plan: path, policy, read + SHA-256 of the current bytes, diff preview"),
    ("create", "temp file created (`O_CREAT`, `O_EXCL`: a reserved name)"),
    ("fill", "temp file written, chown, chmod, fsync (the intent commits meanwhile)"),
    ("intent_wait", "waiting for the intent's commit"),
    ("reread", "under the commit lock: the base re-read and hashed"),
    ("rename", "rename over the target"),
    ("dir_fsync", "directory fsync"),
    ("entry_commit", "journal entry's commit (WAL fdatasync)"),
    ("send", "reply sent (event loop)"),
]


def local_steps(directory: Path, n: int) -> dict[str, float]:
    """Medians (µs) of the local loop's steps, `n` writes."""
    directory.mkdir()
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    times: dict[str, list[float]] = {k: [] for k in ("create", "write", "fsync", "rename", "dir")}
    times["total"] = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            fd = os.open(f".tmp-{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
            t1 = time.perf_counter()
            os.write(fd, payload(i))
            t2 = time.perf_counter()
            os.fsync(fd)
            t3 = time.perf_counter()
            os.close(fd)
            os.rename(f".tmp-{i}", "target.txt", src_dir_fd=dfd, dst_dir_fd=dfd)
            t4 = time.perf_counter()
            os.fsync(dfd)
            t5 = time.perf_counter()
            for key, a, b in (
                ("create", t0, t1),
                ("write", t1, t2),
                ("fsync", t2, t3),
                ("rename", t3, t4),
                ("dir", t4, t5),
                ("total", t0, t5),
            ):
                times[key].append((b - a) * 1e6)
    finally:
        os.close(dfd)
    return {k: statistics.median(v) for k, v in times.items()}


#: The concurrent writer of `--flushes`: rewrites a 512 MiB file, never flushing it, until
#: its stdin closes (argv only, no shell).
_DIRTIER = """
import os, select, sys
buf = os.urandom(1 << 20)
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
i = 0
while not select.select([sys.stdin], [], [], 0)[0]:
    os.pwrite(fd, buf, (i % 512) << 20)
    i += 1
"""


def _syncfs() -> Callable[[int], None]:
    libc = ctypes.CDLL(None, use_errno=True)

    def syncfs(fd: int) -> None:
        if libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return syncfs


def flush_costs(directory: Path, n: int) -> dict[str, list[float]]:
    """µs of one write's first durability point, `n` times each way, interleaved: a new
    4 KiB temp file written and made durable with a WAL-like file's new 8 KiB (`fsync
    alone`: the temp file only)."""
    directory.mkdir()
    syncfs = _syncfs()
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    wal = os.open("wal", os.O_RDWR | os.O_CREAT, 0o600, dir_fd=dfd)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    out: dict[str, list[float]] = {"fsync alone": [], "fsync beside fdatasync": [], "syncfs": []}
    try:
        os.ftruncate(wal, 4 << 20)
        os.fsync(wal)
        for i in range(n):
            for way, times in out.items():
                start = time.perf_counter()
                fd = os.open(f".t{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dfd)
                os.write(fd, payload(i))
                if way != "fsync alone":
                    os.pwrite(wal, os.urandom(8192), (i * 8192) % (4 << 20))
                if way == "fsync beside fdatasync":
                    other = pool.submit(os.fdatasync, wal)
                    os.fsync(fd)
                    other.result()
                elif way == "syncfs":
                    syncfs(fd)
                else:
                    os.fsync(fd)
                times.append((time.perf_counter() - start) * 1e6)
                os.close(fd)
                os.unlink(f".t{i}", dir_fd=dfd)
    finally:
        pool.shutdown()
        os.close(wal)
        os.close(dfd)
    return out


def print_flushes(base: Path, n: int) -> None:
    print(f"one write's first durability point, {n} of each, µs")
    print("| way | quiet p50 / p90 / max | 512 MiB being dirtied beside: p50 / p90 / max |")
    print("|---|---|---|")
    quiet = flush_costs(base / "quiet", n)
    dirtier = subprocess.Popen(
        [sys.executable, "-c", _DIRTIER, str(base / "dirty.bin")], stdin=subprocess.PIPE
    )
    try:
        time.sleep(1.0)
        busy = flush_costs(base / "busy", n)
    finally:
        assert dirtier.stdin is not None
        dirtier.stdin.close()
        dirtier.wait()
    for way, times in quiet.items():
        cells = []
        for run in (times, busy[way]):
            ranked = sorted(run)
            p50, p90 = statistics.median(ranked), ranked[int(len(ranked) * 0.9)]
            cells.append(f"{p50:,.0f} / {p90:,.0f} / {ranked[-1]:,.0f}")
        print(f"| {way} | {cells[0]} | {cells[1]} |")
    print(f"(load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs)")


def segments(record: dict[str, list[float]], sent: float, got: float) -> dict[str, float]:
    """One write's steps and the gaps between them, in µs; `sent` and `got`: when the
    client began to send the request and had decoded the reply (the same clock)."""
    out: dict[str, float] = {}
    prev_end: float | None = None
    prev = ""
    for step, _ in STEPS:
        span = record.get(step)
        if span is None:
            continue
        start, end = span
        if step == "write":
            assert prev_end is not None  # the dispatch comes first
            out["hop in: task start, handler, to the worker thread"] = (start - prev_end) * 1e6
            prev_end, prev = start, step
            continue
        if prev_end is not None:
            gap = (start - prev_end) * 1e6
            if step == "send":
                write_end = record["write"][1]
                out["hop out: back to the event loop, reply encoded"] = (start - write_end) * 1e6
                out[f"python between {prev} and the end of Writer.write"] = (
                    write_end - prev_end
                ) * 1e6
            elif prev != "write":
                out[f"python between {prev} and {step}"] = gap
        out[step] = (end - start) * 1e6
        prev_end, prev = end, step
    out["client to dispatch: encode, socket, loop wake-up, read"] = (
        record["dispatch"][0] - sent
    ) * 1e6
    out["reply's send to the client's decoded result"] = (got - record["send"][0]) * 1e6
    out["round trip"] = (got - sent) * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--writes", type=int, default=400)
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose daemon runs")
    ap.add_argument("--flushes", type=int, default=0, help="measure the flushes only")
    args = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="sbb-", dir=args.dir))
    if args.flushes:
        try:
            print_flushes(base, args.flushes)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return 0
    probes = base / "probes.jsonl"
    stamps: list[tuple[float, float]] = []
    try:
        (base / "d").mkdir()
        launcher = [str(REPO / "bench" / "write_probes.py")]
        env = {"SUBSTRATE_WRITE_PROBES": str(probes)}
        daemon = BenchDaemon(base / "d", repo=args.repo.resolve(), launcher=launcher, env=env)
        try:
            ws_dir = daemon.roots / "bench"
            (ws_dir / "w").mkdir(parents=True)
            chown_tree(ws_dir)
            client = Client(daemon.socket, timeout=600)
            ws = client.call("workspace.adopt", path=str(ws_dir))["workspace"]
            sha = None
            warm = 50
            for i in range(warm + args.writes):
                start = time.perf_counter()
                plan = client.call(
                    "fs.write",
                    workspace=ws,
                    path="w/target.txt",
                    content=payload(i).decode(),
                    base_sha256=sha,
                )
                stamps.append((start, time.perf_counter()))
                sha = plan["new_sha256"]
            client.close()
        finally:
            daemon.stop()
        local = local_steps(base / "local", args.writes)
        records = [json.loads(line) for line in probes.read_text().splitlines()]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows: dict[str, list[float]] = {}
    for record, (sent, got) in list(zip(records, stamps, strict=True))[warm:]:
        if "send" not in record or "dispatch" not in record:
            continue
        for key, value in segments(record, sent, got).items():
            rows.setdefault(key, []).append(value)
    print(f"one sequential guarded 4 KiB replace, medians of {args.writes} writes, µs")
    print(f"(the daemon of {args.repo})")
    print(f"(load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs)")
    print("| step | µs |")
    print("|---|---|")
    names = dict(STEPS)
    for key, values in rows.items():
        print(f"| {names.get(key) or key} | {statistics.median(values):.0f} |")
    print()
    print("the local loop, same run: " + ", ".join(f"{k} {v:.0f}" for k, v in local.items()))
    rtt = statistics.median(rows["round trip"])
    print(f"ratio (loop total / round trip): {local['total'] / rtt:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
