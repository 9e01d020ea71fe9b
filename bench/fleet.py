"""Benchmark of the journal export and the metrics (docs/fleet.md): one run, ratios
against baselines measured in the same run, sides taking turns, medians.

    python3 bench/fleet.py [--entries 100000] [--rounds 3] [--runs 200]

1. Shipping throughput, entries/s: `Exporter.ship_all` of a journal of --entries entries
   (fs.write-like data: a path, two digests, a size) into a private PostgreSQL (initdb
   in a temp dir, a Unix socket, fsync on), against a plain `COPY` of the same rows into
   a table of the same layout and keys, in one transaction. That time is also the
   catch-up time of a node whose database was away while it wrote --entries entries.
2. The hot path: warm `proc.run ["true"]` p50/p90 on two real daemons (the `interactive`
   profile, substrate-sandbox:bookworm, runc), one with the export and the metrics page
   on (scraped twice a second meanwhile), one with neither; interleaved.

Needs the engine, the image, PostgreSQL's server binaries and root.
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
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchdaemon import BenchDaemon
from substrate.export import Cursors, Exporter, ExportSettings, JournalSource, open_target
from substrate.protocol.client import Client
from substrate.secrets import SecretStore
from substrate.store import Journal, Store
from substrate.store.journal import Draft
from tests.harness.postgres import PostgresServer, find_bindir

PROFILE = "interactive"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def make_journal(path: Path, n: int) -> None:
    store = Store(path)
    journal = Journal(store)
    batch = 5000
    for start in range(0, n, batch):
        with store.transaction() as db:
            journal.append_many_in(
                db,
                [
                    Draft(
                        "fs.write",
                        {
                            "path": f"src/module_{i % 997}/file_{i}.py",
                            "old_sha256": f"{i:064x}",
                            "new_sha256": f"{i + 1:064x}",
                            "size": 1000 + i % 5000,
                        },
                        workspace="ws_bench",
                        actor="agent:1000",
                    )
                    for i in range(start, min(start + batch, n))
                ],
            )
    store.close()


def ship(pg: PostgresServer, db: Path, node: str) -> float:
    store = Store(db)
    source = JournalSource(db, node)
    settings = ExportSettings(dsn=pg.dsn, node=node, password=lambda: pg.password)
    exporter = Exporter(settings, source, Cursors(store.transaction))
    t = time.perf_counter()
    shipped = exporter.ship_all()
    elapsed = time.perf_counter() - t
    source.close()
    store.close()
    assert shipped == source_count(db), shipped
    return elapsed


def source_count(db: Path) -> int:
    source = JournalSource(db, "x")
    try:
        return source.head()
    finally:
        source.close()


def plain_copy(pg: PostgresServer, db: Path, node: str) -> float:
    table = f"plain_{node.replace('-', '_')}"
    with pg.connect() as conn:
        conn.execute(f"CREATE TABLE {table} (LIKE substrate_journal INCLUDING ALL)".encode())
    source = JournalSource(db, node)
    rows = source.batch(0, 10_000_000, max_bytes=1 << 40)
    source.close()
    with pg.connect(autocommit=False) as conn:
        t = time.perf_counter()
        with conn.cursor() as cur, cur.copy(f"COPY {table} FROM STDIN".encode()) as copy:
            for row in rows:
                copy.write_row(row)
        conn.commit()
        return time.perf_counter() - t


def bench_shipping(pg: PostgresServer, base: Path, entries: int, rounds: int) -> None:
    db = base / "journal.db"
    make_journal(db, entries)
    open_target(pg.dsn, password=pg.password).close()  # the tables, made once
    ours: list[float] = []
    theirs: list[float] = []
    for r in range(rounds):
        if r % 2:
            theirs.append(plain_copy(pg, db, f"c{r}"))
            ours.append(ship(pg, db, f"s{r}"))
        else:
            ours.append(ship(pg, db, f"s{r}"))
            theirs.append(plain_copy(pg, db, f"c{r}"))
    mine, copy = statistics.median(ours), statistics.median(theirs)
    print(f"shipping {entries} entries (median of {rounds}):")
    print(
        f"  export (batches of 1000, exactly once) {mine:7.2f} s  {entries / mine:9.0f} entries/s"
    )
    print(
        f"  plain COPY, one transaction            {copy:7.2f} s  {entries / copy:9.0f} entries/s"
    )
    print(f"  ratio export / COPY                    {mine / copy:7.2f}")
    print(f"  catch-up of {entries} entries           {mine:7.2f} s")


class Side:
    def __init__(self, base: Path, pg: PostgresServer | None) -> None:
        base.mkdir()
        self.metrics_port = 0
        args: list[str] = []
        if pg is not None:
            (base / "substrate.toml").write_text(
                'metrics_listen = "127.0.0.1:0"\n'
                f'[journal_export]\npostgres_dsn = "{pg.dsn}"\nnode = "bench-hot"\n'
                'password_secret = "pg"\n'
            )
            SecretStore(base / "state").set("pg", pg.password.encode())
            args = ["--config", str(base / "substrate.toml")]
        self.daemon = BenchDaemon(base, args)
        project = self.daemon.roots / "project"
        (project / ".git").mkdir(parents=True)
        for p in (project, project / ".git"):
            os.chown(p, 1000, 1000)
        self.client = Client(self.daemon.socket, timeout=600)
        self.ws = self.client.call("workspace.adopt", path=str(project))["workspace"]
        self.run()
        status = self.client.call("daemon.status")
        if pg is not None:
            self.metrics_port = int(status["metrics_listen"].rpartition(":")[2])

    def run(self) -> Any:
        result = self.client.call("proc.run", workspace=self.ws, profile=PROFILE, argv=["true"])
        assert result["exit_code"] == 0, result
        return result

    def close(self) -> None:
        self.client.close()
        self.daemon.stop()


def bench_hot_path(pg: PostgresServer, base: Path, runs: int) -> None:
    on, off = Side(base / "on", pg), Side(base / "off", None)
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(0.5):
            with urllib.request.urlopen(f"http://127.0.0.1:{on.metrics_port}/metrics") as r:
                r.read()

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    times: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for _ in range(10):
            on.run()
            off.run()
        for i in range(runs):
            for name, side in (("on", on), ("off", off)) if i % 2 else (("off", off), ("on", on)):
                t = time.perf_counter()
                side.run()
                times[name].append((time.perf_counter() - t) * 1000)
        status = on.client.call("daemon.status")["journal_export"]
    finally:
        stop.set()
        scraper.join()
        on.close()
        off.close()
    p50_on, p50_off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"warm `true` ({PROFILE}, {runs} runs each, interleaved):")
    print(f"  export + metrics on   p50 {p50_on:7.2f} ms  p90 {pct(times['on'], 0.9):7.2f} ms")
    print(f"  both off              p50 {p50_off:7.2f} ms  p90 {pct(times['off'], 0.9):7.2f} ms")
    print(f"  ratio on / off (p50)      {p50_on / p50_off:7.3f}")
    print(f"  export at the end: {status['state']}, lag {status['lag_entries']} entries")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--skip-hot-path", action="store_true")
    args = parser.parse_args()
    bindir = find_bindir()
    if bindir is None:
        raise SystemExit("bench/fleet.py: no PostgreSQL server binaries (initdb, postgres)")
    base = Path(tempfile.mkdtemp(prefix="sbfl-", dir="/tmp"))
    base.chmod(0o755)  # the server's user enters it
    pg = PostgresServer(base / "pg", bindir, fsync=True)
    (base / "pg").mkdir()
    pg.init()
    pg.start()
    try:
        bench_shipping(pg, base, args.entries, args.rounds)
        if not args.skip_hot_path:
            bench_hot_path(pg, base, args.runs)
    finally:
        pg.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
