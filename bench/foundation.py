"""Foundation benchmark: guarded writes, stat round trips, search vs grep.

Starts a real daemon (`python -m substrate --state-dir D serve --adopt-root R`) on a
private temp dir, waits for its socket, and prints one table measured in this run:

1. guarded 4 KiB replace through the socket (`fs.write` bound to the previous sha256,
   sequential) vs a plain local loop of write temp + fsync + rename + dir fsync on the
   same filesystem: ops/s of both and their ratio (goal >= 0.5); the same with 8
   connections writing a file each at once vs the loop in 8 threads (group commit);
2. `fs.stat` round trips/s on one connection: sequential, and with 32 requests in flight
   (raw socket pipelining, and the Trio client with 32 tasks);
3. `fs.search` of a regex over a generated tree of 5,000 files / 50 MB vs
   `grep -rn -E` on the same tree (argv list, warm cache, both outputs read in full):
   wall-time ratio (goal <= 1.0), for a rare pattern and common ones; `rg -n` (ripgrep,
   its default threads) beside it when installed.

Every figure is the median of `--rounds` rounds (default 5) after one warm-up.

    python bench/foundation.py [--dir /tmp] [--writes 500] [--stats 5000] [--rounds 5]
                               [--no-search] [--only-search]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchdaemon import BenchDaemon  # noqa: E402
from bench.foundation_writes import (  # noqa: E402
    WRITERS,
    chown_tree,
    concurrent_guarded_writes,
    concurrent_local_writes,
    guarded_writes,
    inprocess_writes,
    local_writes,
)
from substrate.protocol.client import Client, open_client  # noqa: E402

WINDOW = 32
TREE_FILES = 5000
TREE_BYTES = 50 << 20
#: The regex searched for: a literal-prefixed pattern, as agents typically search code.
SEARCH_PATTERN = r"def \w+_handler\("
#: A second one that starts with a class, so no literal prefix helps the engine.
SEARCH_PATTERN_CLASS = r"[A-Z][a-z]+Error\(\w+"
#: A third with no literal every match must contain: screened by RE2 (`re2_translate`).
SEARCH_PATTERN_NO_LITERAL = r"[0-9]{5}"
#: A rare one (45 lines in the default tree): the cost is the walk and the reads.
SEARCH_PATTERN_RARE = r"Error\(q[a-z]_"


# --- helpers ------------------------------------------------------------------------------


def median_of(rounds: int, measure: Callable[[], float]) -> float:
    measure()  # warm-up
    return statistics.median(measure() for _ in range(rounds))


def interleaved(rounds: int, *measures: Callable[[], float]) -> list[float]:
    """Medians of several measures taken in alternation, so that all see the same load."""
    for measure in measures:
        measure()  # warm-up
    samples: list[list[float]] = [[] for _ in measures]
    for _ in range(rounds):
        for i, measure in enumerate(measures):
            samples[i].append(measure())
    return [statistics.median(s) for s in samples]


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process and its threads so far (10 ms resolution)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> float:
    """`process_cpu` of `pid` and of its child processes (the daemon's search worker)."""
    total = process_cpu(pid)
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in children.read_text().split():
            with contextlib.suppress(OSError):
                total += process_cpu(int(child))
    return total


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --- 2. stat round trips ----------------------------------------------------------------------


def stat_sequential(client: Client, ws: str, n: int) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        for _ in range(n):
            client.call("fs.stat", workspace=ws, path="w/target.txt")
        return n / (time.perf_counter() - start)

    return run


def stat_pipelined(path: Path, ws: str, n: int) -> Callable[[], float]:
    """Raw socket: keep WINDOW requests in flight; each reply lets one more go."""

    def line(i: int) -> bytes:
        params = {"workspace": ws, "path": "w/target.txt"}
        return (
            msgspec.json.encode({"jsonrpc": "2.0", "id": i, "method": "fs.stat", "params": params})
            + b"\n"
        )

    def run() -> float:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(path))
            start = time.perf_counter()
            sent = min(WINDOW, n)
            s.sendall(b"".join(line(i) for i in range(sent)))
            done = 0
            buf = b""
            while done < n:
                chunk = s.recv(1 << 20)
                if not chunk:
                    raise SystemExit("daemon closed the connection")
                buf += chunk
                *replies, buf = buf.split(b"\n")
                for reply in replies:
                    if b'"error"' in reply:
                        raise SystemExit(f"fs.stat failed: {reply[:200]!r}")
                done += len(replies)
                more = min(len(replies), n - sent)
                if more:
                    s.sendall(b"".join(line(sent + k) for k in range(more)))
                    sent += more
            return n / (time.perf_counter() - start)

    return run


def stat_async(path: Path, ws: str, n: int) -> Callable[[], float]:
    """The Trio client: WINDOW tasks sharing one connection."""

    async def main() -> float:
        async with open_client(path) as client:

            async def worker(count: int) -> None:
                for _ in range(count):
                    await client.call("fs.stat", workspace=ws, path="w/target.txt")

            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for k in range(WINDOW):
                    nursery.start_soon(worker, n // WINDOW + (1 if k < n % WINDOW else 0))
            return n / (time.perf_counter() - start)

    return lambda: trio.run(main)


# --- 3. search vs grep ------------------------------------------------------------------------


def make_tree(root: Path, files: int, total: int, seed: int = 2) -> int:
    """A code-like tree: `files` files, about `total` bytes, a few handler defs in each."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(4000)
    ]
    kinds = ["Value", "Key", "Type", "Lookup", "Runtime", "Index", "Io"]
    pool: list[str] = []
    for _ in range(20000):
        r = rng.random()
        w = rng.sample(words, 6)
        if r < 0.002:
            pool.append(f"    def on_{w[0]}_handler(self, {w[1]}):\n")
        elif r < 0.004:
            pool.append(f"        raise {rng.choice(kinds)}Error({w[0]}_{w[1]})\n")
        elif r < 0.005:
            pool.append(f"    {w[0]}_timeout = {rng.randint(10000, 99999)}\n")
        elif r < 0.3:
            pool.append(f"    {w[0]} = {w[1]}({w[2]}, {w[3]}={w[4]})  # {w[5]}\n")
        elif r < 0.5:
            pool.append(f"        if {w[0]}.{w[1]} is not None and {w[2]}:\n")
        elif r < 0.6:
            pool.append("\n")
        else:
            pool.append(f"        return self.{w[0]}_{w[1]}[{w[2]}] + {w[3]} * {w[4]}\n")
    per_file = total // files
    written = 0
    for i in range(files):
        d = root / f"pkg{i // 100:02d}" / f"mod{(i // 10) % 10}"
        d.mkdir(parents=True, exist_ok=True)
        lines: list[str] = [f'"""module {i}"""\n', "import os\n", "\n"]
        size = sum(len(x) for x in lines)
        while size < per_file:
            chunk = rng.choices(pool, k=32)
            lines.extend(chunk)
            size += sum(len(x) for x in chunk)
        data = "".join(lines).encode()
        (d / f"file{i % 10}.py").write_bytes(data)
        written += len(data)
    return written


def search_daemon(
    client: Client, ws: str, pattern: str, pid: int, cpu: list[float]
) -> Callable[[], float]:
    def run() -> float:
        cpu_before = tree_cpu(pid)
        start = time.perf_counter()
        result = client.call(
            "fs.search", workspace=ws, pattern=pattern, path="tree", max_matches=100000
        )
        elapsed = time.perf_counter() - start
        cpu.append(tree_cpu(pid) - cpu_before)
        if result["truncated"]:
            raise SystemExit("fs.search was truncated: raise max_matches or pick a rarer pattern")
        return elapsed

    return run


def grep_argv(pattern: str, tree: Path) -> list[str]:
    return ["grep", "-rn", "-E", pattern, str(tree)]


def rg_argv(pattern: str, tree: Path) -> list[str]:
    return ["rg", "-n", "--no-config", "-e", pattern, str(tree)]


def search_grep(
    pattern: str,
    tree: Path,
    env: dict[str, str],
    cpu: list[float],
    argv: Callable[[str, Path], list[str]] = grep_argv,
) -> Callable[[], float]:
    def run() -> float:
        cpu_before = children_cpu()
        start = time.perf_counter()
        done = subprocess.run(argv(pattern, tree), stdout=subprocess.PIPE, env=env, check=False)
        elapsed = time.perf_counter() - start
        cpu.append(children_cpu() - cpu_before)
        if done.returncode not in (0, 1):
            raise SystemExit(f"{argv(pattern, tree)[0]} failed with {done.returncode}")
        return elapsed

    return run


def same_matches(client: Client, ws: str, pattern: str, tree: Path, env: dict[str, str]) -> int:
    """Both tools must report the same (path, line) set; returns its size."""
    result = client.call(
        "fs.search", workspace=ws, pattern=pattern, path="tree", max_matches=100000
    )
    ours = {(m["path"].removeprefix("tree/"), m["line"]) for m in result["matches"]}
    out = subprocess.run(grep_argv(pattern, tree), stdout=subprocess.PIPE, env=env, check=True)
    theirs = set()
    for raw in out.stdout.splitlines():
        path, line, _ = raw.decode().split(":", 2)
        theirs.add((os.path.relpath(path, tree), int(line)))
    if ours != theirs:
        raise SystemExit(f"fs.search and grep disagree: {len(ours)} vs {len(theirs)} matches")
    return len(ours)


# --- main -------------------------------------------------------------------------------------


@contextlib.contextmanager
def running(base_dir: str | None, keep: bool) -> Iterator[BenchDaemon]:
    base = Path(tempfile.mkdtemp(prefix="sbb-", dir=base_dir))
    daemon = BenchDaemon(base)
    try:
        yield daemon
    finally:
        daemon.stop()
        if keep:
            print(f"kept {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)


def row(name: str, ours: str, baseline: str, ratio: str, goal: str) -> str:
    return f"| {name} | {ours} | {baseline} | {ratio} | {goal} |"


def print_basics(args: argparse.Namespace, basics: tuple[float, ...]) -> None:
    guarded, inproc, local, together, local_together, seq, piped, tasks = basics
    local_s = f"{local:,.0f} ops/s (temp + fsync + rename + dir fsync)"
    print(
        row(
            f"guarded 4 KiB replace through the socket, sequential (N={args.writes})",
            f"{guarded:,.0f} ops/s",
            local_s,
            f"{guarded / local:.2f}",
            ">= 0.5",
        )
    )
    print(
        row(
            "same, `Writer` in-process (no socket; diagnostic)",
            f"{inproc:,.0f} ops/s",
            local_s,
            f"{inproc / local:.2f}",
            "",
        )
    )
    print(
        row(
            f"guarded 4 KiB replace, {WRITERS} connections at once, a file each (N={args.writes})",
            f"{together:,.0f} ops/s",
            f"{local_together:,.0f} ops/s (the local loop in {WRITERS} threads)",
            f"{together / local_together:.2f}",
            "",
        )
    )
    print(row(f"fs.stat, 1 connection, sequential (N={args.stats})", f"{seq:,.0f} /s", "", "", ""))
    print(
        row(
            f"fs.stat, 1 connection, {WINDOW} in flight (raw pipelining)",
            f"{piped:,.0f} /s",
            "",
            "",
            "",
        )
    )
    print(
        row(
            f"fs.stat, 1 connection, {WINDOW} in flight (Trio client, {WINDOW} tasks)",
            f"{tasks:,.0f} /s",
            "",
            "",
            "",
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", default="/tmp", help="where the temp dir goes (the fs measured)")
    ap.add_argument("--writes", type=int, default=500)
    ap.add_argument("--stats", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--files", type=int, default=TREE_FILES)
    ap.add_argument("--bytes", type=int, default=TREE_BYTES)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--no-search", action="store_true", help="only the write and stat rows")
    ap.add_argument("--only-search", action="store_true", help="only the search rows")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()[0]

    with running(args.dir, args.keep) as daemon:
        ws_dir = daemon.roots / "bench"
        (ws_dir / "w").mkdir(parents=True)
        tree_bytes = 0 if args.no_search else make_tree(ws_dir / "tree", args.files, args.bytes)
        chown_tree(ws_dir)
        client = Client(daemon.socket, timeout=600)
        ws = client.call("workspace.adopt", path=str(ws_dir))["workspace"]

        basics = None
        if not args.only_search:
            guarded, inproc, local = interleaved(
                args.rounds,
                guarded_writes(client, ws, args.writes),
                inprocess_writes(daemon.base / "inproc-state", daemon.roots, args.writes),
                local_writes(daemon.base / "local", args.writes),
            )
            together, local_together = interleaved(
                args.rounds,
                concurrent_guarded_writes(daemon.socket, ws, args.writes, WRITERS),
                concurrent_local_writes(daemon.base / "local-together", args.writes, WRITERS),
            )
            seq, piped, tasks = interleaved(
                args.rounds,
                stat_sequential(client, ws, args.stats),
                stat_pipelined(daemon.socket, ws, args.stats),
                stat_async(daemon.socket, ws, args.stats),
            )
            basics = (guarded, inproc, local, together, local_together, seq, piped, tasks)
        grep_env = dict(os.environ, LC_ALL="C")
        searches = []
        patterns = (
            ()
            if args.no_search
            else (
                SEARCH_PATTERN_RARE,
                SEARCH_PATTERN,
                SEARCH_PATTERN_CLASS,
                SEARCH_PATTERN_NO_LITERAL,
            )
        )
        has_rg = shutil.which("rg") is not None
        for n, pattern in enumerate(patterns):
            count = same_matches(client, ws, pattern, ws_dir / "tree", grep_env)
            if n == 0:
                time.sleep(1.0)  # the first search started the search worker: its start-up
            ours_cpu: list[float] = []
            grep_cpu: list[float] = []
            rg_cpu: list[float] = []
            measures = [
                search_daemon(client, ws, pattern, daemon.proc.pid, ours_cpu),
                search_grep(pattern, ws_dir / "tree", grep_env, grep_cpu),
            ]
            if has_rg:
                measures.append(search_grep(pattern, ws_dir / "tree", grep_env, rg_cpu, rg_argv))
            ours_s, grep_s, *rg_s = interleaved(args.rounds, *measures)
            cpu = (statistics.median(ours_cpu[1:]), statistics.median(grep_cpu[1:]))
            rg = (rg_s[0], statistics.median(rg_cpu[1:])) if rg_s else None
            searches.append((pattern, count, ours_s, grep_s, cpu, rg))
        client.close()

    mib = tree_bytes / (1 << 20)
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    print(f"substrate foundation benchmark: medians of {args.rounds} rounds;")
    print(f"{os.cpu_count()} CPUs, {load}; python {sys.version.split()[0]};")
    print(f"files on {args.dir} ({_fs_type(args.dir)}).\n")
    print("| measure | substrate | baseline | ratio | goal |")
    print("|---|---|---|---|---|")
    if basics is not None:
        print_basics(args, basics)
    for pattern, count, ours_s, grep_s, (ours_cpu_s, grep_cpu_s), rg in searches:
        what = f"`{pattern}` over {args.files:,} files / {mib:.0f} MiB ({count:,} matching lines)"
        print(
            row(
                f"fs.search {what}: wall time",
                f"{ours_s * 1000:,.0f} ms",
                f"{grep_s * 1000:,.0f} ms (grep -rn -E, LC_ALL=C)",
                f"{ours_s / grep_s:.2f}",
                "<= 1.0",
            )
        )
        if rg is not None:
            print(
                row(
                    "same vs ripgrep (rg -n, its default threads)",
                    f"{ours_s * 1000:,.0f} ms",
                    f"{rg[0] * 1000:,.0f} ms (CPU {rg[1] * 1000:,.0f} ms)",
                    f"{ours_s / rg[0]:.2f}",
                    "",
                )
            )
        print(
            row(
                "same: CPU time (daemon and its search worker vs grep)",
                f"{ours_cpu_s * 1000:,.0f} ms",
                f"{grep_cpu_s * 1000:,.0f} ms",
                f"{ours_cpu_s / grep_cpu_s:.2f}" if grep_cpu_s else "n/a",
                "",
            )
        )
    return 0


def _fs_type(path: str) -> str:
    """The type of the filesystem holding `path` (the longest mount point above it)."""
    target = os.path.realpath(path)
    best, kind = "", "?"
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for entry in mounts:
            fields = entry.split()
            if len(fields) < 3:
                continue
            mount = fields[1]
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best):
                best, kind = mount, fields[2]
    return kind


if __name__ == "__main__":
    sys.exit(main())
