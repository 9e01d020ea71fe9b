"""Where `fs.search`'s time goes: walk, read, match, results, encoding; grep and rg beside.

In-process (no daemon, no socket): a workspace adopted on the generated tree of
`bench/foundation.py` (5,000 files / 52 MiB by default), and `search.search` timed in
stages, each stage the search with the later work cut out:

- walk: the directory walk alone (every file skipped where it would be opened);
- read: + open, fstat, one `pread` and the binary sniff of every file (nothing matched);
- match: + the prefilter, RE2 and the per-line work (line numbers, slicing, decoding),
  with the result structs replaced by a no-op;
- full: + the `SearchMatch` structs (what `fs.search` runs);
- encode: + the JSON encoding of the result (`msgspec`, as the server replies).

Each stage's cost is its difference to the one before. `grep -rn -E` (LC_ALL=C) and
`rg -n` run interleaved with the stages, in the same rounds; medians of `--rounds`.
`--against FILE` loads another `search.py` (e.g. main's) beside this checkout's and
times its stages in the same rounds: an A/B on the same machine state. On a machine
with two CPUs or more, a row `shared` times the search shared with the worker process
(`search_pool.SearchPool.search`, what the daemon runs), in the same rounds: its total
only, with the part of the files the worker searched.

`--daemons CHECKOUT` instead times `fs.search` through the socket (as
`bench/foundation.py` does) of this checkout's daemon and of CHECKOUT's (e.g. main),
each on its own copy of the tree, interleaved with grep and rg in the same rounds.

    python bench/search_breakdown.py [--rounds 9] [--against PATH/search.py] [PATTERN ...]
    python bench/search_breakdown.py --daemons /work/main [--rounds 9] [PATTERN ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchdaemon import BenchDaemon  # noqa: E402
from bench.foundation import (  # noqa: E402
    SEARCH_PATTERN,
    SEARCH_PATTERN_CLASS,
    SEARCH_PATTERN_NO_LITERAL,
    SEARCH_PATTERN_RARE,
    TREE_BYTES,
    TREE_FILES,
    grep_argv,
    make_tree,
    rg_argv,
)
from bench.foundation_writes import chown_tree  # noqa: E402
from substrate.config import Config  # noqa: E402
from substrate.protocol.client import Client  # noqa: E402
from substrate.schema.fs import SearchParams  # noqa: E402
from substrate.store.db import Store  # noqa: E402
from substrate.store.journal import Journal  # noqa: E402
from substrate.workspace import search as this_search  # noqa: E402
from substrate.workspace.registry import Workspace, WorkspaceRegistry  # noqa: E402
from substrate.workspace.search_pool import SearchPool  # noqa: E402

STAGES = ("walk", "read", "match", "full", "encode")
_ENCODER = msgspec.json.Encoder()


def _no_struct(**_: Any) -> None:
    return None


@contextmanager
def staged(module: ModuleType, stage: str) -> Iterator[None]:
    """`module.search` with the work after `stage` cut out (see the module doc)."""
    mod: Any = module
    scan: Any = mod._Scan
    saved = (scan._file, getattr(scan, "_match", None), mod._collect, mod.SearchMatch)
    try:
        if stage == "walk":
            scan._file = lambda self, dir_fd, name, rel: None
        elif stage == "read":
            if saved[1] is not None:
                scan._match = lambda self, data, rel: None
            else:  # a search.py from before `_match`: everything past the sniff is `_collect`
                mod._collect = lambda *a, **k: False
        elif stage == "match":
            mod.SearchMatch = _no_struct
        yield
    finally:
        scan._file, mod._collect, mod.SearchMatch = saved[0], saved[2], saved[3]
        if saved[1] is not None:
            scan._match = saved[1]


def timed_search(
    mod: ModuleType, ws: Workspace, p: SearchParams, stage: str
) -> Callable[[], float]:
    def run() -> float:
        with staged(mod, stage):
            start = time.perf_counter()
            result = mod.search(ws, p)
            if stage == "encode":
                _ENCODER.encode(result)
            return time.perf_counter() - start

    return run


def timed_shared(pool: SearchPool, ws: Workspace, p: SearchParams) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        result = pool.search(ws, p)
        _ENCODER.encode(result)
        return time.perf_counter() - start

    return run


def timed_tool(argv: list[str]) -> Callable[[], float]:
    env = dict(os.environ, LC_ALL="C")

    def run() -> float:
        start = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.PIPE, env=env, check=False)
        return time.perf_counter() - start

    return run


def timed_daemon(client: Client, ws: str, pattern: str) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        client.call("fs.search", workspace=ws, pattern=pattern, path="tree", max_matches=100000)
        return time.perf_counter() - start

    return run


def daemons(args: argparse.Namespace, patterns: list[str]) -> int:
    """`--daemons`: this checkout's daemon and another's, through their sockets."""
    base = Path(tempfile.mkdtemp(prefix="sbsd-", dir=args.dir))
    running: list[BenchDaemon] = []
    try:
        clients = []
        for k, repo in enumerate([REPO, Path(args.daemons)]):
            (base / f"d{k}").mkdir()
            daemon = BenchDaemon(base / f"d{k}", repo=repo)
            running.append(daemon)
            make_tree(daemon.roots / "bench" / "tree", args.files, args.bytes)
            chown_tree(daemon.roots / "bench")
            client = Client(daemon.socket, timeout=600)
            ws = client.call("workspace.adopt", path=str(daemon.roots / "bench"))["workspace"]
            clients.append((client, ws))
        tree = running[0].roots / "bench" / "tree"
        for client, ws in clients:  # the first search starts a daemon's search worker
            client.call("fs.search", workspace=ws, pattern="x", path="tree", max_matches=1)
        time.sleep(1.0)
        has_rg = shutil.which("rg") is not None
        print(
            f"medians of {args.rounds} rounds, interleaved; {os.cpu_count()} CPUs,"
            f" load {os.getloadavg()[0]:.1f}; the other daemon: {args.daemons}"
        )
        print()
        print("| pattern | this | other | grep | rg | this ÷ grep | other ÷ grep | this ÷ rg |")
        print("|---|---|---|---|---|---|---|---|")
        for pattern in patterns:
            measures = [timed_daemon(c, ws, pattern) for c, ws in clients]
            measures.append(timed_tool(grep_argv(pattern, tree)))
            if has_rg:
                measures.append(timed_tool(rg_argv(pattern, tree)))
            for measure in measures:
                measure()
            samples: list[list[float]] = [[] for _ in measures]
            for _ in range(args.rounds):
                for i, measure in enumerate(measures):
                    samples[i].append(measure())
            med = [statistics.median(x) * 1000 for x in samples]
            this, other, grep = med[0], med[1], med[2]
            rg = med[3] if has_rg else float("nan")
            print(
                f"| `{pattern}` | {this:.0f} | {other:.0f} | {grep:.0f} | {rg:.0f} |"
                f" {this / grep:.2f} | {other / grep:.2f} | {this / rg:.2f} |"
            )
        print(f"\nload {os.getloadavg()[0]:.1f} after")
        for client, _ in clients:
            client.close()
    finally:
        for daemon in running:
            daemon.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


def load_other(path: str) -> ModuleType:
    """Another `search.py`, importing this checkout's other modules."""
    spec = importlib.util.spec_from_file_location("search_against", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("patterns", nargs="*")
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--files", type=int, default=TREE_FILES)
    ap.add_argument("--bytes", type=int, default=TREE_BYTES)
    ap.add_argument("--against", help="another search.py to time beside this one")
    ap.add_argument("--daemons", help="another checkout: time both daemons' fs.search")
    args = ap.parse_args(argv)
    patterns = args.patterns or [
        SEARCH_PATTERN_RARE,
        SEARCH_PATTERN,
        SEARCH_PATTERN_CLASS,
        SEARCH_PATTERN_NO_LITERAL,
    ]
    if args.daemons:
        return daemons(args, patterns)
    versions = [("this", this_search)]
    if args.against:
        versions.append(("against", load_other(args.against)))
    base = Path(tempfile.mkdtemp(prefix="sbsb-", dir=args.dir))
    try:
        roots = base / "roots"
        tree = roots / "bench" / "tree"
        make_tree(tree, args.files, args.bytes)
        chown_tree(roots / "bench")
        state = base / "state"
        state.mkdir(mode=0o700)
        store = Store(state / "substrate.db")
        config = Config(state_dir=str(state), adopt_roots=[str(roots)])
        registry = WorkspaceRegistry(config, store, Journal(store), state)
        ws = registry.adopt(str(roots / "bench"), None, None, "bench")
        has_rg = shutil.which("rg") is not None
        pool = SearchPool.for_machine()
        if pool is not None and not pool.wait_ready(60):
            raise SystemExit("the search worker did not start")
        load = os.getloadavg()[0]
        print(
            f"medians of {args.rounds} rounds, interleaved; {os.cpu_count()} CPUs, load {load:.1f}"
        )
        print()
        print(
            "| pattern (lines) | version | walk | read | match | results | encode | total |"
            " grep | rg | ÷ grep | ÷ rg |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for pattern in patterns:
            p = SearchParams(workspace=ws.id, pattern=pattern, path="tree", max_matches=100000)
            lines = len(this_search.search(ws, p).matches)
            measures: list[Callable[[], float]] = []
            for _, mod in versions:
                measures += [timed_search(mod, ws, p, stage) for stage in STAGES]
            if pool is not None:
                if pool.search(ws, p) != this_search.search(ws, p):
                    raise SystemExit("the shared search differs from the serial one")
                measures.append(timed_shared(pool, ws, p))
            measures.append(timed_tool(grep_argv(pattern, tree)))
            if has_rg:
                measures.append(timed_tool(rg_argv(pattern, tree)))
            for measure in measures:
                measure()  # warm-up
            samples: list[list[float]] = [[] for _ in measures]
            for _ in range(args.rounds):
                for i, measure in enumerate(measures):
                    samples[i].append(measure())
            med = [statistics.median(s) * 1000 for s in samples]
            shared = pool is not None
            grep_ms = med[len(versions) * len(STAGES) + shared]
            rg_ms = med[-1] if has_rg else float("nan")
            for k, (name, _) in enumerate(versions):
                walk, read, match, full, encode = med[k * len(STAGES) : (k + 1) * len(STAGES)]
                parts = [walk, read - walk, match - read, full - match, encode - full]
                print(
                    f"| `{pattern}` ({lines:,}) | {name} | "
                    + " | ".join(f"{x:.0f}" for x in parts)
                    + f" | {full:.0f} | {grep_ms:.0f} | {rg_ms:.0f} |"
                    f" {full / grep_ms:.2f} | {full / rg_ms:.2f} |"
                )
            if pool is not None:
                total = med[len(versions) * len(STAGES)]
                print(
                    f"| `{pattern}` ({lines:,}) | shared | | | | | | {total:.0f} |"
                    f" {grep_ms:.0f} | {rg_ms:.0f} | {total / grep_ms:.2f} | {total / rg_ms:.2f} |"
                )
        if pool is not None:
            print(
                f"\nshared searches {pool.shared}, failed {pool.failed},"
                f" kept serial (no CPU free) {pool.declined}"
            )
            pool.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
