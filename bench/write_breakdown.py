"""Where the wall-clock time of one sequential guarded write goes (docs/performance.md).

A real daemon, started through `write_probes.py` (stamps around each step of the write
path), takes `--writes` sequential 4 KiB replaces of one file on one connection; the
client times each round trip. Printed: the median of each step and of each gap between
steps, in microseconds, in the order they happen, with the local loop's steps (temp
file, write, fsync, rename, directory fsync) measured in the same run beside them:

    python bench/write_breakdown.py [--dir /tmp] [--writes 400] [--repo CHECKOUT]

The client's stamps and the daemon's are of one clock (`perf_counter`, CLOCK_MONOTONIC),
so the first and last rows are the client's encode and decode, the socket, and the event
loop's wake-up, read and send.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
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
    args = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="sbb-", dir=args.dir))
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
