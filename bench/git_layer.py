"""Benchmark of the git layer (docs/working-layer.md, "The git layer"): one run, ratios
against baselines measured in the same run (medians).

    python3 bench/git_layer.py [--runs 5] [--files 1000]

Starts a real daemon with the shipped `default` profile (a working layer whose `.git`
is the checkout's git layer) on a checkout holding a repository of `--files` files, and
a copy of that repository on the host. Each run, interleaved:

1. `git commit` of a change to every file inside the sandbox (timed inside, around the
   commit alone) vs the same commit of the same change on the host copy (host git, hooks
   off): the ratio is what the git layer's overlay costs git;
2. the conclusion's cost for that commit: the command's wall time less its
   `duration_ms` (swap-free: the working tree it edits is a copy under /tmp, so only
   the git layer changed) less the same for a warm `true`: the refs' comparison, the
   verified import of the commit's objects into the checkout and the ref's
   compare-and-swap.

Needs the engine, the substrate-sandbox:bookworm image, and root (the checkout is
chowned to uid 1000).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchdaemon import BenchDaemon  # noqa: E402
from substrate.protocol.client import Client  # noqa: E402

WORKSPACE_UID = 1000
HOST_GIT = ["git", "-c", "core.hooksPath=/dev/null", "-c", "safe.directory=*"]
IDENTITY = ["-c", "user.name=bench", "-c", "user.email=bench@example.invalid"]

#: Inside the sandbox: the working tree is copied to /tmp (so the checkout's files are
#: not changed: only the git layer is), every file changed, then the commit timed.
SANDBOX_COMMIT = """\
set -e
rm -rf /tmp/wt && mkdir /tmp/wt && cp -a /workspace/src /tmp/wt/
for f in /tmp/wt/src/*; do echo "{tag}" >> "$f"; done
g="git --git-dir=/workspace/.git --work-tree=/tmp/wt"
$g checkout -q -B agent/{tag}
$g add -A
t0=$(date +%s%N)
$g commit -q -m "bench {tag}"
t1=$(date +%s%N)
echo $(( (t1 - t0) / 1000 ))
"""


def host_git(path: Path, *args: str) -> None:
    subprocess.run([*HOST_GIT, "-C", str(path), *args], check=True, capture_output=True)


def make_repo(path: Path, files: int) -> None:
    (path / "src").mkdir(parents=True)
    for i in range(files):
        (path / "src" / f"f{i:05d}.txt").write_text(f"file {i}\n" * 8)
    host_git(path, "init", "-q", "-b", "main")
    host_git(path, "add", "-A")
    host_git(path, *IDENTITY, "commit", "-qm", "first")


def chown_tree(path: Path) -> None:
    os.lchown(path, WORKSPACE_UID, WORKSPACE_UID)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), WORKSPACE_UID, WORKSPACE_UID)


def host_commit(path: Path, tag: str) -> float:
    """The same change committed on the host copy: seconds of the commit alone."""
    host_git(path, "checkout", "-q", "-B", f"agent/{tag}", "main")
    for f in (path / "src").iterdir():
        with f.open("a") as out:
            out.write(f"{tag}\n")
    host_git(path, "add", "-A")
    t0 = time.perf_counter()
    host_git(path, *IDENTITY, "commit", "-qm", f"bench {tag}")
    return time.perf_counter() - t0


def after_s(client: Client, ws: str, argv: list[str]) -> tuple[float, Any]:
    """Seconds of `proc.run` past the command's own duration (the conclusion), and the
    result."""
    t0 = time.perf_counter()
    result = client.call("proc.run", workspace=ws, profile="default", argv=argv)
    wall = time.perf_counter() - t0
    if result["exit_code"] != 0:
        raise SystemExit(f"command failed: {result}")
    return wall - result["duration_ms"] / 1000, result


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--files", type=int, default=1000)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="substrate-bench-git-"))
    profiles = base / "profiles"
    profiles.mkdir()
    shutil.copy(REPO / "profiles" / "default.toml", profiles / "default.toml")
    daemon = BenchDaemon(base, ["--profiles", str(profiles)])
    client = Client(daemon.socket, timeout=600)
    try:
        checkout = daemon.roots / "project"
        make_repo(checkout, args.files)
        host_copy = base / "host-copy"
        shutil.copytree(checkout, host_copy)
        chown_tree(checkout)
        ws = client.call("workspace.adopt", path=str(checkout))["workspace"]
        after_s(client, ws, ["true"])  # warm: the container, the git layer
        plain = daemon.roots / "plain"
        shutil.copytree(checkout / "src", plain / "src")
        chown_tree(plain)
        plain_ws = client.call("workspace.adopt", path=str(plain))["workspace"]
        after_s(client, plain_ws, ["true"])
        inside, host, conclusion, idle, steady, no_git = [], [], [], [], [], []
        for i in range(args.runs):
            tag = f"b{i}"
            script = SANDBOX_COMMIT.format(tag=tag)
            spent, result = after_s(client, ws, ["sh", "-c", script])
            refs = [e for e in result["changes"]["applied"] if e.get("op") == "ref"]
            if [e["path"] for e in refs] != [f"refs/heads/agent/{tag}"]:
                raise SystemExit(f"the commit's ref did not land: {result['changes']}")
            inside.append(int(result["stdout"]["inline"].split()[-1]) / 1e6)
            conclusion.append(spent)
            host.append(host_commit(host_copy, tag))
            idle.append(after_s(client, ws, ["true"])[0])
            steady.append(after_s(client, ws, ["true"])[0])
            no_git.append(after_s(client, plain_ws, ["true"])[0])
        print(f"git commit of a {args.files}-file change, median of {args.runs}:")
        print(f"  in the sandbox (git layer): {med(inside) * 1000:8.1f} ms")
        print(f"  on the host:                {med(host) * 1000:8.1f} ms")
        print(f"  ratio sandbox/host:         {med(inside) / med(host):8.2f}")
        print("the conclusion after the commit (wall - duration):")
        print(f"  with the commit:            {med(conclusion) * 1000:8.1f} ms")
        print(f"  after `true` (baseline):    {med(idle) * 1000:8.1f} ms")
        print(f"  import + refs cost:         {(med(conclusion) - med(idle)) * 1000:8.1f} ms")
        print("a warm `true` past its duration:")
        print(f"  right after the commit:     {med(idle) * 1000:8.1f} ms")
        print(f"  with a git layer (steady):  {med(steady) * 1000:8.1f} ms")
        print(f"  without .git (baseline):    {med(no_git) * 1000:8.1f} ms")
        client.call("workspace.release", workspace=ws, keep_git=False)
    finally:
        client.close()
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
