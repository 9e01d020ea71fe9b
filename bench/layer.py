"""Benchmark of the working layer (docs/working-layer.md): one run, ratios against baselines measured
in the same run (medians).

    python3 bench/layer.py [--suite-runs 5] [--many-runs 5] [--true-runs 30]
    python3 bench/layer.py --fresh-view [--fresh-runs 60]   (section 4 alone)

Starts a real daemon (`python -m substrate serve --profiles D`) whose profiles dir holds
the shipped `agent` profile (`workspace = "layer"`) and `agent-rw`, the same profile with
`workspace = "rw"`, and compares, each pair interleaved so both see the same load:

1. a generated pytest suite (200 tests that write, read and delete files in the
   workspace, each leaving one result file) on the layer vs on the rw bind: wall time of
   `proc.run`, and the part after the command ended (wall - `duration_ms`: for the layer
   the swap, re-verification, scan and apply of the change set);
2. a command creating 5,000 files of 1 KiB: the layer's after-command time less the rw
   profile's is the apply, in files/s, against `cp -a` of the same 5,000 files on the
   host into a fresh directory (the copies interleaved with the commands);
3. warm `proc.run ["true"]` p50 on both profiles: the difference is the per-command cost
   of a layer (swap + scan of an empty layer + re-verification);
4. `python3 -m venv` (with pip: about 1,700 files, 25 MB) into the checkout, on the layer
   vs on the rw bind: wall time of `proc.run` (`venv_cost`);
5. a command writing a 1 GiB file: the layer's after-command time less the rw profile's
   is its apply (streamed), against `cp` of the same file on the host, and the daemon's
   RSS growth while it applies: VmRSS sampled every 10 ms, the peak less the value
   before (`big_file_cost`).

Needs the engine, the substrate-sandbox:bookworm image, and root (workspaces are chowned
to uid 1000).
"""

from __future__ import annotations

import argparse
import json
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchdaemon import BenchDaemon, cgroup_favordynmods  # noqa: E402
from substrate.protocol.client import Client  # noqa: E402

WORKSPACE_UID = 1000
LAYER, RW = "agent", "agent-rw"
TEST_FILES, TESTS_PER_FILE = 20, 10
MANY_FILES, MANY_SIZE = 5000, 1024

#: One generated test module; `{k}` is its number. Each test writes a scratch file in the
#: workspace, reads it back, removes it, and leaves a result file that changes every run.
TEST_MODULE = """\
import os
import time

import pytest

from pkg.mod_{k} import checksum

OUT = os.path.join("out", "m{k}")
SCRATCH = os.path.join("scratch", "m{k}")


@pytest.mark.parametrize("n", range({per}))
def test_roundtrip(n):
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(SCRATCH, exist_ok=True)
    data = ("line %d of test %d\\n" % (n, {k}) * 200).encode()
    scratch = os.path.join(SCRATCH, "t%d.bin" % n)
    with open(scratch, "wb") as f:
        f.write(data)
    with open(scratch, "rb") as f:
        assert checksum(f.read()) == checksum(data)
    os.remove(scratch)
    with open(os.path.join(OUT, "t%d.txt" % n), "w") as f:
        f.write("passed at %d\\n" % time.time_ns())
"""

MODULE = """\
import hashlib


def checksum(data):
    return hashlib.sha256(data).hexdigest()
"""

#: Creates `MANY_FILES` files of `MANY_SIZE` bytes under the directory named by argv[1].
MANY_SCRIPT = """\
import os, sys
d = sys.argv[1]
os.mkdir(d)
for i in range(int(sys.argv[2])):
    with open(os.path.join(d, "f%05d.txt" % i), "wb") as f:
        f.write(b"%05d" % i + b"x" * (int(sys.argv[3]) - 6) + b"\\n")
"""


def chown_tree(path: Path) -> None:
    os.lchown(path, WORKSPACE_UID, WORKSPACE_UID)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), WORKSPACE_UID, WORKSPACE_UID)


def make_profiles(base: Path) -> Path:
    profiles = base / "profiles"
    profiles.mkdir()
    agent = (REPO / "profiles" / "default.toml").read_text()
    assert 'workspace = "layer"' in agent
    (profiles / f"{LAYER}.toml").write_text(agent)
    (profiles / f"{RW}.toml").write_text(agent.replace('workspace = "layer"', 'workspace = "rw"'))
    return profiles


def make_workspace(roots: Path, name: str, suite: bool) -> Path:
    path = roots / name
    (path / ".git").mkdir(parents=True)
    if suite:
        (path / "pkg").mkdir()
        (path / "pkg" / "__init__.py").write_text("")
        (path / "tests").mkdir()
        for k in range(TEST_FILES):
            (path / "pkg" / f"mod_{k}.py").write_text(MODULE)
            (path / "tests" / f"test_m{k}.py").write_text(
                TEST_MODULE.format(k=k, per=TESTS_PER_FILE)
            )
    chown_tree(path)
    return path


class Bench:
    def __init__(self, client: Client) -> None:
        self.client = client

    def adopt(self, path: Path) -> str:
        ws: str = self.client.call("workspace.adopt", path=str(path))["workspace"]
        return ws

    def run(self, ws: str, profile: str, argv: list[str]) -> tuple[float, float, Any]:
        """(wall ms, ms after the command ended, result) of one proc.run."""
        t = time.perf_counter()
        result = self.client.call("proc.run", workspace=ws, profile=profile, argv=argv)
        wall = (time.perf_counter() - t) * 1000
        if result["exit_code"] != 0:
            raise SystemExit(f"{argv[:3]} on {profile} exited {result['exit_code']}")
        changes = result.get("changes")
        if changes is not None and changes.get("error"):
            raise SystemExit(f"{profile}: change set error {changes['error']}")
        return wall, wall - result["duration_ms"], result


def interleaved(fns: list[Callable[[int], object]], runs: int) -> None:
    """Call each fn `runs` times, taking turns (fn gets the round number)."""
    for i in range(runs):
        for k in range(len(fns)):
            fns[(i + k) % len(fns)](i)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite-runs", type=int, default=5)
    ap.add_argument("--many-runs", type=int, default=5)
    ap.add_argument("--true-runs", type=int, default=30)
    ap.add_argument("--venv-runs", type=int, default=3)
    ap.add_argument("--big-runs", type=int, default=3)
    ap.add_argument("--big-mib", type=int, default=BIG_MIB)
    ap.add_argument("--big-only", action="store_true", help="only section 5")
    args = ap.parse_args()
    if args.big_only:
        big_only(args.big_runs, args.big_mib)
        return
    base = Path(tempfile.mkdtemp(prefix="substrate-bench-layer-"))
    profiles = make_profiles(base)
    daemon = BenchDaemon(base, ["--profiles", str(profiles)])
    client = Client(daemon.socket, timeout=600)
    bench = Bench(client)
    report: list[str] = []
    try:
        # 1. the test suite
        suite = ["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
        ws = {p: bench.adopt(make_workspace(daemon.roots, f"suite-{p}", True)) for p in (LAYER, RW)}
        for p in (LAYER, RW):
            bench.run(ws[p], p, suite)  # warm: container, __pycache__, out/
        wall: dict[str, list[float]] = {LAYER: [], RW: []}
        after: dict[str, list[float]] = {LAYER: [], RW: []}
        applied: list[int] = []

        def suite_on(profile: str) -> Callable[[int], object]:
            def go(_: int) -> None:
                w, a, r = bench.run(ws[profile], profile, suite)
                wall[profile].append(w)
                after[profile].append(a)
                if r.get("changes") is not None:
                    applied.append(r["changes"]["counts"]["applied"])

            return go

        interleaved([suite_on(LAYER), suite_on(RW)], args.suite_runs)
        lw, rw = med(wall[LAYER]), med(wall[RW])
        report += [
            f"1. pytest suite, {TEST_FILES * TESTS_PER_FILE} tests (ms, median of"
            f" {args.suite_runs})",
            "                       wall  after the command",
            f"  layer ({LAYER})    {lw:8.1f}  {med(after[LAYER]):8.1f}"
            f"   ({med([float(a) for a in applied]):.0f} files applied per run)",
            f"  rw ({RW})    {rw:8.1f}  {med(after[RW]):8.1f}",
            f"  ratio layer/rw: {lw / rw:.2f}x (goal <= 1.1x)",
        ]

        # 2. applying 5,000 small files
        many = {
            p: bench.adopt(make_workspace(daemon.roots, f"many-{p}", False)) for p in (LAYER, RW)
        }
        mwall: dict[str, list[float]] = {LAYER: [], RW: []}
        mafter: dict[str, list[float]] = {LAYER: [], RW: []}
        counts: list[int] = []
        cp_ms: list[float] = []

        def many_on(profile: str) -> Callable[[int], object]:
            def go(i: int) -> None:
                argv = ["python3", "-c", MANY_SCRIPT, f"many{i}", str(MANY_FILES), str(MANY_SIZE)]
                w, a, r = bench.run(many[profile], profile, argv)
                mwall[profile].append(w)
                mafter[profile].append(a)
                if r.get("changes") is not None:
                    counts.append(r["changes"]["counts"]["applied"])

            return go

        def copy(i: int) -> None:
            source = daemon.roots / f"many-{RW}" / "many0"
            t = time.perf_counter()
            subprocess.run(["cp", "-a", str(source), str(base / f"cp{i}")], check=True)
            cp_ms.append((time.perf_counter() - t) * 1000)

        for p in (LAYER, RW):
            bench.run(many[p], p, ["true"])  # warm: the container exists
        # The copies take turns with the commands, so both see the same load.
        interleaved([many_on(LAYER), many_on(RW), copy], args.many_runs)
        apply_ms = med(mafter[LAYER]) - med(mafter[RW])
        ours, cp = MANY_FILES / (apply_ms / 1000), MANY_FILES / (med(cp_ms) / 1000)
        report += [
            f"2. a change set of {MANY_FILES:,} files of {MANY_SIZE} B (ms, median of"
            f" {args.many_runs}; applied per run: {sorted(set(counts))})",
            "                       wall  after the command",
            f"  layer ({LAYER})    {med(mwall[LAYER]):8.1f}  {med(mafter[LAYER]):8.1f}",
            f"  rw ({RW})    {med(mwall[RW]):8.1f}  {med(mafter[RW]):8.1f}",
            f"  apply (layer after - rw after)  {apply_ms:8.1f} ms  {ours:8.0f} files/s",
            f"  cp -a on the host               {med(cp_ms):8.1f} ms  {cp:8.0f} files/s",
            f"  ratio: {ours / cp:.2f} (goal >= 0.5)",
        ]

        # 3. warm true: the per-command cost of a layer
        twall: dict[str, list[float]] = {LAYER: [], RW: []}
        tafter: dict[str, list[float]] = {LAYER: [], RW: []}

        def true_on(profile: str) -> Callable[[int], object]:
            def go(_: int) -> None:
                w, a, _r = bench.run(many[profile], profile, ["true"])
                twall[profile].append(w)
                tafter[profile].append(a)

            return go

        interleaved([true_on(LAYER), true_on(RW)], args.true_runs)
        tl, tr = med(twall[LAYER]), med(twall[RW])
        report += [
            f"3. warm proc.run ['true'] (ms, p50 of {args.true_runs})",
            "                       wall  after the command",
            f"  layer ({LAYER})    {tl:8.1f}  {med(tafter[LAYER]):8.1f}",
            f"  rw ({RW})    {tr:8.1f}  {med(tafter[RW]):8.1f}",
            f"  per-command cost of the layer: {tl - tr:.1f} ms ({tl / tr:.2f}x)",
        ]
        report += venv_cost(bench, daemon, args.venv_runs)
        report += big_file_cost(bench, daemon, base, args.big_runs, args.big_mib)
    finally:
        client.close()
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)
    print("\n".join(report))


# -- the fresh view (`--fresh-view`): its own daemon, checkout and figures ---------------

FRESH_DIRS = 10_000


def make_wide_checkout(path: Path, dirs: int) -> Path:
    """A checkout of `dirs` directories (100 per parent), one small file in each tenth."""
    (path / ".git").mkdir(parents=True)
    for i in range(dirs):
        d = path / f"d{i // 100:03d}" / f"e{i % 100:02d}"
        d.mkdir(parents=True, exist_ok=True)
        if i % 10 == 0:
            (d / "f.txt").write_text("x\n")
    chown_tree(path)
    return path


def fresh_view_cost(runs: int) -> list[str]:
    """Warm `proc.run ["true"]` p50 on the shipped `default` profile (`workspace =
    "layer"`) over a checkout of `FRESH_DIRS` directories: with nothing changed on the
    host (the watch's one `poll(2)`), and with a host change before each command (the
    generation mounted again and re-verified), against `docker exec <ctr> true` (CLI)
    and the SDK's `exec_run` on the same container, interleaved (the same profile as
    "rw" is no baseline here: the rw write gate walks the checkout each command), and
    the same checkout without `.git` (no git layer); the layer's own part of each
    unchanged command, `LayerUsers.join` + `end` timed in the daemon (run as
    `bench.layerclock`), with `.git` and without; then, in this process, the watch's
    own costs on the same checkout: its walk and a `pending` check."""
    import docker

    from substrate.layer.mounts.lower_watch import LowerWatch

    base = Path(tempfile.mkdtemp(prefix="substrate-bench-fresh-"))
    profiles = base / "profiles"
    profiles.mkdir()
    shutil.copy(REPO / "profiles" / "default.toml", profiles / "default.toml")
    clock = base / "layerclock.json"
    daemon = BenchDaemon(
        base,
        ["--profiles", str(profiles)],
        module="bench.layerclock",
        env={"SUBSTRATE_BENCH_CLOCK": str(clock)},
    )
    client = Client(daemon.socket, timeout=600)
    try:
        project = make_wide_checkout(daemon.roots / "wide", FRESH_DIRS)
        ws = client.call("workspace.adopt", path=str(project))["workspace"]
        plain = make_wide_checkout(daemon.roots / "wide-nogit", FRESH_DIRS)
        shutil.rmtree(plain / ".git")
        ws_plain = client.call("workspace.adopt", path=str(plain))["workspace"]
        bench = Bench(client)
        t = time.perf_counter()
        bench.run(ws, "default", ["true"])  # the sandbox: container, layer, the watch's walk
        first_ms = (time.perf_counter() - t) * 1000
        bench.run(ws_plain, "default", ["true"])
        container = client.call("facts.probe", workspace=ws, profile="default")["container"]
        ctr = docker.from_env().containers.get(container)
        touched = project / "d000" / "e00" / "f.txt"

        kinds = ["first"]  # of each command on `ws`, in order (the daemon's clock's too)

        def unchanged() -> None:
            kinds.append("unchanged")
            bench.run(ws, "default", ["true"])

        def changed() -> None:
            kinds.append("changed")
            touched.write_text(f"{time.time_ns()}\n")  # in place: an event, a remount
            bench.run(ws, "default", ["true"])

        sides: list[tuple[str, Callable[[], object]]] = [
            ("default, checkout unchanged", unchanged),
            ("the same without .git", lambda: bench.run(ws_plain, "default", ["true"])),
            ("default, a host edit before each", changed),
            ("docker exec CLI", lambda: subprocess.run(["docker", "exec", container, "true"])),
            ("SDK exec_run", lambda: ctr.exec_run(["true"])),
        ]
        for _, fn in sides:
            fn()
        times: list[list[float]] = [[] for _ in sides]
        for i in range(runs):
            for k in range(len(sides)):
                j = (i + k) % len(sides)
                t = time.perf_counter()
                sides[j][1]()
                times[j].append((time.perf_counter() - t) * 1000)
        status = client.call("daemon.status")["fresh_view"]
        p50 = [med(t) for t in times]
        cli, sdk = p50[3], p50[4]
        report = [
            f"7. the fresh view: warm proc.run ['true'] over {FRESH_DIRS:,} directories"
            f" (ms, p50 of {runs})",
        ]
        report += [f"  {name:36s} {v:8.2f}" for (name, _), v in zip(sides, p50, strict=True)]
        report += [
            f"  ratio unchanged/docker exec: {p50[0] / cli:.2f}, /exec_run: {p50[0] / sdk:.2f}",
            f"  a host edit before a command costs {p50[2] - p50[0]:.2f} ms more"
            f" (remount + re-verify; remounts so far: {status['remounts']})",
            f"  cgroup2 favordynmods: {cgroup_favordynmods()} (scripts/cgroup-favor-dynmods)",
            f"  first command (sandbox made, the watch's walk included): {first_ms:.0f} ms;"
            f" watched dirs {status['watched_dirs']:,}, degraded {status['degraded']}",
        ]
    finally:
        client.close()
        daemon.stop()
    # The layer's own part of each warm unchanged command (join + end, timed in the daemon).
    if clock.exists():
        own = json.loads(clock.read_text())
        with_git = [t for k, t in zip(kinds, own.get(ws, []), strict=False) if k == "unchanged"]
        without = own.get(ws_plain, [])[1:]
        report.append(
            f"  the layer's own cost per unchanged command (join + end, in the daemon):"
            f" {med(with_git):.3f} ms with .git, {med(without):.3f} ms without"
            f" (p50 of {len(with_git)} / {len(without)})"
        )
    # The watch's own costs, in this process, on the same checkout.
    root = os.open(project, os.O_RDONLY | os.O_DIRECTORY)
    try:
        walks = []
        for _ in range(3):
            t = time.perf_counter()
            watch = LowerWatch.open(root)
            walks.append((time.perf_counter() - t) * 1000)
            watch.drain(root)
            watch.mounted()
            if _ != 2:
                watch.close()
        checks = []
        for _ in range(1000):
            t = time.perf_counter()
            watch.pending()
            checks.append((time.perf_counter() - t) * 1e6)
        touched.write_text("y\n")
        drains = []
        for _ in range(200):
            touched.write_text(f"{time.time_ns()}\n")
            t = time.perf_counter()
            watch.drain(root)
            drains.append((time.perf_counter() - t) * 1e6)
            watch.mounted()
        watch.close()
    finally:
        os.close(root)
        shutil.rmtree(base, ignore_errors=True)
    report += [
        f"  detection per command: pending() {med(checks):.1f} us (p50 of 1000),"
        f" drain of one event {med(drains):.1f} us; the walk of {watch.walks} x"
        f" {FRESH_DIRS:,} dirs {med(walks):.0f} ms (once per sandbox)",
    ]
    return report


def venv_cost(bench: Bench, daemon: BenchDaemon, runs: int) -> list[str]:
    """Section 4: `python3 -m venv` (pip included) into the checkout, layer vs rw."""
    ws = {p: bench.adopt(make_workspace(daemon.roots, f"venv-{p}", False)) for p in (LAYER, RW)}
    wall: dict[str, list[float]] = {LAYER: [], RW: []}
    after: dict[str, list[float]] = {LAYER: [], RW: []}
    files: list[int] = []

    def venv_on(profile: str) -> Callable[[int], object]:
        def go(i: int) -> None:
            w, a, r = bench.run(ws[profile], profile, ["python3", "-m", "venv", f"venv{i}"])
            wall[profile].append(w)
            after[profile].append(a)
            if r.get("changes") is not None:
                files.append(r["changes"]["counts"]["applied"])

        return go

    for p in (LAYER, RW):
        bench.run(ws[p], p, ["true"])  # warm: the container exists
    interleaved([venv_on(LAYER), venv_on(RW)], runs)
    lw, rw = med(wall[LAYER]), med(wall[RW])
    return [
        f"4. python3 -m venv (with pip) into the checkout (ms, median of {runs};"
        f" changes applied per run: {sorted(set(files))})",
        "                       wall  after the command",
        f"  layer ({LAYER})    {lw:8.1f}  {med(after[LAYER]):8.1f}",
        f"  rw ({RW})    {rw:8.1f}  {med(after[RW]):8.1f}",
        f"  ratio layer/rw: {lw / rw:.2f}x (goal <= 2x)",
    ]


#: Writes argv[2] MiB of a pattern to the file named by argv[1], a MiB at a time.
BIG_SCRIPT = """\
import sys
with open(sys.argv[1], "wb") as f:
    for i in range(int(sys.argv[2])):
        f.write(bytes([i % 251]) * (1 << 20))
"""
BIG_MIB = 1024


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class RssPeak:
    """The peak VmRSS of `pid` less its value at the start, sampled every 10 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = _rss_kib(pid)
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss_kib(self.pid))

    def growth_mib(self) -> float:
        self._stop.set()
        self._thread.join()
        return (self.peak - self.start) / 1024


def big_only(runs: int, mib: int) -> None:
    """Section 5 alone, on a daemon of its own (`--big-only`, `--big-mib 2048`)."""
    base = Path(tempfile.mkdtemp(prefix="substrate-bench-layer-"))
    daemon = BenchDaemon(base, ["--profiles", str(make_profiles(base))])
    client = Client(daemon.socket, timeout=600)
    try:
        report = big_file_cost(Bench(client), daemon, base, runs, mib)
    finally:
        client.close()
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)
    print("\n".join(report))


def big_file_cost(
    bench: Bench, daemon: BenchDaemon, base: Path, runs: int, mib: int = BIG_MIB
) -> list[str]:
    """Section 5: a `mib` MiB file applied (streamed) vs `cp` of it, and the RSS growth."""
    ws = {p: bench.adopt(make_workspace(daemon.roots, f"big-{p}", False)) for p in (LAYER, RW)}
    after: dict[str, list[float]] = {LAYER: [], RW: []}
    growth: list[float] = []
    rss_start: list[int] = []
    cp_ms: list[float] = []

    def big_on(profile: str) -> Callable[[int], object]:
        def go(i: int) -> None:
            argv = ["python3", "-c", BIG_SCRIPT, f"big{i}.bin", str(mib)]
            rss = RssPeak(daemon.proc.pid) if profile == LAYER else None
            _w, a, r = bench.run(ws[profile], profile, argv)
            if rss is not None:
                growth.append(rss.growth_mib())
                rss_start.append(rss.start)
                applied = r["changes"]["counts"]["applied"]
                if applied != 1:
                    raise SystemExit(f"the 1 GiB file was not applied: {r['changes']}")
            after[profile].append(a)

        return go

    def copy(i: int) -> None:
        source = daemon.roots / f"big-{RW}" / "big0.bin"
        t = time.perf_counter()
        subprocess.run(["cp", str(source), str(base / f"big-cp{i}.bin")], check=True)
        subprocess.run(["sync", "-f", str(base)], check=True)  # the apply's syncfs too
        cp_ms.append((time.perf_counter() - t) * 1000)
        os.unlink(base / f"big-cp{i}.bin")

    for p in (LAYER, RW):
        bench.run(ws[p], p, ["true"])  # warm: the container exists
    interleaved([big_on(LAYER), big_on(RW), copy], runs)
    apply_ms = med(after[LAYER]) - med(after[RW])
    return [
        f"5. a {mib} MiB file (ms, median of {runs})",
        f"  layer after the command  {med(after[LAYER]):8.1f}",
        f"  rw after the command     {med(after[RW]):8.1f}",
        f"  apply (layer - rw)       {apply_ms:8.1f}",
        f"  cp + sync -f on the host {med(cp_ms):8.1f}",
        f"  ratio cp/apply: {med(cp_ms) / apply_ms:.2f}",
        f"  daemon RSS growth over the command and its apply: median {med(growth):.1f} MiB,"
        f" max {max(growth):.1f} MiB (goal < 32; VmRSS before: {rss_start[0] / 1024:.0f} MiB)",
    ]


if __name__ == "__main__":
    if "--fresh-view" in sys.argv[1:]:
        fresh = argparse.ArgumentParser()
        fresh.add_argument("--fresh-view", action="store_true")
        fresh.add_argument("--fresh-runs", type=int, default=60)
        print("\n".join(fresh_view_cost(fresh.parse_args().fresh_runs)))
    else:
        main()
