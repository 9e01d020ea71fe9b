"""The write measures of `bench/foundation.py` (docs/performance.md): a guarded 4 KiB
replace through the socket, sequential and from several connections at once, the same
`Writer` in-process, and the local atomic-replace loop they are compared with.

Run alone, it prints only the write rows, each against the local loop measured in the
same run (medians of `--rounds` rounds after a warm-up, the measures interleaved):

    python bench/foundation_writes.py [--dir /tmp] [--writes 400] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchdaemon import BenchDaemon  # noqa: E402
from substrate.config import Config  # noqa: E402
from substrate.protocol.client import Client  # noqa: E402
from substrate.schema.fs import WriteParams, write_request  # noqa: E402
from substrate.store.db import Store  # noqa: E402
from substrate.store.journal import Journal  # noqa: E402
from substrate.workspace.registry import WorkspaceRegistry  # noqa: E402
from substrate.workspace.writes import Writer  # noqa: E402

WORKSPACE_UID = 1000
PAYLOAD = 4096
#: Connections (and local threads) writing at once in the concurrent write row.
WRITERS = 8


def payload(i: int) -> bytes:
    head = f"revision {i:08d}\n".encode()
    line = b"lorem ipsum dolor sit amet, consectetur adipiscing elit\n"
    body = (line * (PAYLOAD // len(line) + 1))[: PAYLOAD - len(head)]
    return head + body


def chown_tree(path: Path) -> None:
    if os.geteuid() != 0:
        return
    os.lchown(path, WORKSPACE_UID, WORKSPACE_UID)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), WORKSPACE_UID, WORKSPACE_UID)


# --- 1. guarded writes vs a local atomic-replace loop -------------------------------------------


def guarded_writes(client: Client, ws: str, n: int) -> Callable[[], float]:
    first = client.call(
        "fs.write", workspace=ws, path="w/target.txt", content=payload(0).decode(), base_sha256=None
    )
    base: str = first["new_sha256"]
    i = 0

    def run() -> float:
        nonlocal base, i
        start = time.perf_counter()
        for _ in range(n):
            i += 1
            plan = client.call(
                "fs.write",
                workspace=ws,
                path="w/target.txt",
                content=payload(i).decode(),
                base_sha256=base,
            )
            base = plan["new_sha256"]
        return n / (time.perf_counter() - start)

    return run


def local_write(dfd: int, i: int, target: str) -> None:
    """The baseline's one write: temp file, fsync, rename over `target`, dir fsync."""
    temp = f".tmp-{i}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
    try:
        os.write(fd, payload(i))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(temp, target, src_dir_fd=dfd, dst_dir_fd=dfd)
    os.fsync(dfd)


def local_writes(directory: Path, n: int) -> Callable[[], float]:
    directory.mkdir()
    counter = iter(range(1, 1 << 30))

    def run() -> float:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            start = time.perf_counter()
            for _ in range(n):
                local_write(dfd, next(counter), "target.txt")
            return n / (time.perf_counter() - start)
        finally:
            os.close(dfd)

    return run


def process_cpu(pid: int) -> float:
    """Seconds of CPU (user + system) the process `pid` has used, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def concurrent_guarded_writes(
    path: Path, ws: str, n: int, writers: int, cpu: list[float] | None = None, pid: int = 0
) -> Callable[[], float]:
    """`writers` connections, each replacing its own file `n // writers` times, at once;
    with `cpu`, each run appends the daemon's (`pid`) CPU seconds per write."""
    clients = [Client(path, timeout=600) for _ in range(writers)]
    bases: list[str] = []
    for k, client in enumerate(clients):
        first = client.call(
            "fs.write", workspace=ws, path=f"w/c{k}.txt", content=payload(0).decode(),
            base_sha256=None,
        )  # fmt: skip
        bases.append(first["new_sha256"])
    each = max(1, n // writers)
    counter = iter(range(1, 1 << 30))

    def one(k: int) -> None:
        for _ in range(each):
            plan = clients[k].call(
                "fs.write", workspace=ws, path=f"w/c{k}.txt",
                content=payload(next(counter)).decode(), base_sha256=bases[k],
            )  # fmt: skip
            bases[k] = plan["new_sha256"]

    def run() -> float:
        threads = [threading.Thread(target=one, args=(k,)) for k in range(writers)]
        cpu_before = process_cpu(pid) if cpu is not None else 0.0
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        if cpu is not None:
            cpu.append((process_cpu(pid) - cpu_before) / (each * writers))
        return each * writers / elapsed

    return run


def concurrent_local_writes(directory: Path, n: int, writers: int) -> Callable[[], float]:
    """The local loop in `writers` threads, each on its own file in one directory."""
    directory.mkdir()
    each = max(1, n // writers)
    counter = iter(range(1, 1 << 30))

    def one(dfd: int, k: int) -> None:
        for _ in range(each):
            local_write(dfd, next(counter), f"target{k}.txt")

    def run() -> float:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            threads = [threading.Thread(target=one, args=(dfd, k)) for k in range(writers)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return each * writers / (time.perf_counter() - start)
        finally:
            os.close(dfd)

    return run


def inprocess_writes(state: Path, roots: Path, n: int) -> Callable[[], float]:
    """The same guarded replace without the daemon: `Writer` called in this process.

    A diagnostic: the gap between this and the socket figure is the transport (JSON-RPC,
    the Trio loop, one worker-thread hop), the gap to the local loop is the write path's
    own work (the base check, the plan, the journal commit).
    """
    state.mkdir(mode=0o700)
    ws_dir = roots / "inproc"
    ws_dir.mkdir()
    chown_tree(ws_dir)
    store = Store(state / "substrate.db")
    journal = Journal(store)
    config = Config(state_dir=str(state), adopt_roots=[str(roots)])
    registry = WorkspaceRegistry(config, store, journal, state)
    ws = registry.adopt(str(ws_dir), None, None, "bench")
    writer = Writer(store, journal)

    def params(i: int, base: str | None) -> WriteParams:
        return WriteParams(
            workspace=ws.id, path="target.txt", content=payload(i).decode(), base_sha256=base
        )

    base = writer.write(ws, write_request(params(0, None)), "bench").new_sha256
    i = 0

    def run() -> float:
        nonlocal base, i
        start = time.perf_counter()
        for _ in range(n):
            i += 1
            base = writer.write(ws, write_request(params(i, base)), "bench").new_sha256
        return n / (time.perf_counter() - start)

    return run


# --- run alone: the write rows only -------------------------------------------------------------


def _interleaved(rounds: int, *measures: Callable[[], float]) -> list[float]:
    """Medians of the measures taken in alternation (all see the same load)."""
    for measure in measures:
        measure()  # warm-up
    samples: list[list[float]] = [[] for _ in measures]
    for _ in range(rounds):
        for i, measure in enumerate(measures):
            samples[i].append(measure())
    return [statistics.median(s) for s in samples]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", default="/tmp", help="where the temp dir goes (the fs measured)")
    ap.add_argument("--writes", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--against", type=Path, help="another checkout's daemon, side by side")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    base = Path(tempfile.mkdtemp(prefix="sbw-", dir=args.dir))
    daemons: list[BenchDaemon] = []
    clients: list[Client] = []
    try:
        sides: list[tuple[Callable[[], float], Callable[[], float]]] = []
        #: Each daemon's CPU seconds per write, 8 connections (one list per daemon).
        cpus: list[list[float]] = []
        for k, repo in enumerate([REPO] if args.against is None else [REPO, args.against]):
            (base / f"d{k}").mkdir()
            daemon = BenchDaemon(base / f"d{k}", repo=repo.resolve())
            daemons.append(daemon)
            ws_dir = daemon.roots / "bench"
            (ws_dir / "w").mkdir(parents=True)
            chown_tree(ws_dir)
            client = Client(daemon.socket, timeout=600)
            clients.append(client)
            ws = client.call("workspace.adopt", path=str(ws_dir))["workspace"]
            cpus.append([])
            sides.append(
                (
                    guarded_writes(client, ws, args.writes),
                    concurrent_guarded_writes(
                        daemon.socket, ws, args.writes, WRITERS, cpus[-1], daemon.proc.pid
                    ),
                )
            )
        inproc, local, *guarded = _interleaved(
            args.rounds,
            inprocess_writes(base / "inproc-state", daemons[0].roots, args.writes),
            local_writes(base / "local", args.writes),
            *(seq for seq, _ in sides),
        )
        local_together, *together = _interleaved(
            args.rounds,
            concurrent_local_writes(base / "local-together", args.writes, WRITERS),
            *(conc for _, conc in sides),
        )
    finally:
        for client in clients:
            client.close()
        for daemon in daemons:
            daemon.stop()
        shutil.rmtree(base, ignore_errors=True)
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    print(
        f"substrate guarded writes: medians of {args.rounds} rounds; {os.cpu_count()} CPUs, {load}"
    )
    print("| measure | substrate | local loop, same run | ratio | goal |")
    print("|---|---|---|---|---|")
    seq_name = f"4 KiB replace through the socket, sequential (N={args.writes})"
    rows = [
        (seq_name, guarded[0], local, ">= 0.5"),
        ("same, `Writer` in-process (diagnostic)", inproc, local, ""),
        (f"same, {WRITERS} connections at once", together[0], local_together, ">= 0.5"),
    ]
    if args.against is not None:
        rows += [
            (f"sequential, the daemon of {args.against}", guarded[1], local, ""),
            (
                f"{WRITERS} connections, the daemon of {args.against}",
                together[1],
                local_together,
                "",
            ),
        ]
    for name, ours, theirs, goal in rows:
        print(
            f"| {name} | {ours:,.0f} ops/s | {theirs:,.0f} ops/s | {ours / theirs:.2f} | {goal} |"
        )
    for k, cpu in enumerate(cpus):
        who = "this daemon" if k == 0 else f"the daemon of {args.against}"
        print(
            f"CPU per write, {WRITERS} connections, {who}: "
            f"{statistics.median(cpu) * 1e6:,.0f} µs (user + system, all threads, median)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
