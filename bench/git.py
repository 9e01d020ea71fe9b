"""Benchmark of `substrate.git.import_objects`: one run, a ratio against the host's `git fetch`.

    python3 bench/git.py [--files 1000] [--rounds 15] [--dir /tmp]

Makes a scratch repository with one commit of `--files` files (by the host's `git`, hooks
off, in a temp dir this script made), then, in interleaved rounds, each into a fresh
empty repository (made before the clock starts):

1. `import_objects` of the commit's objects as loose objects (what `git commit` leaves);
2. `import_objects` of the same objects as one pack (what `git gc` leaves);
3. the baseline: `git fetch <scratch> main` into the fresh repository (upload-pack,
   pack-objects and index-pack, the host's own way of receiving verified objects).

Prints the medians (ms) and each import's ratio to the baseline. Asserts nothing.
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
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from substrate.git import import_objects  # noqa: E402

GIT = ["git", "-c", "core.hooksPath=/dev/null", "-c", "init.defaultBranch=main", "-c", "gc.auto=0"]
ENV = {
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_AUTHOR_NAME": "Bench",
    "GIT_AUTHOR_EMAIL": "bench@example.com",
    "GIT_COMMITTER_NAME": "Bench",
    "GIT_COMMITTER_EMAIL": "bench@example.com",
}


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        [*GIT, *args], cwd=cwd, env=ENV, capture_output=True, text=True, check=True
    )
    return done.stdout


def scratch_repo(base: Path, files: int) -> tuple[Path, Path, str]:
    """(loose repo, packed repo, commit id): one commit of `files` files, twice."""
    loose = base / "agent-loose"
    loose.mkdir()
    git(loose, "init", "-q")
    for i in range(files):
        sub = loose / f"dir{i % 20:02d}"
        sub.mkdir(exist_ok=True)
        body = "".join(f"file {i} line {j}: some text of a source file\n" for j in range(40))
        (sub / f"file{i:04d}.txt").write_text(body)
    git(loose, "add", "-A")
    git(loose, "commit", "-q", "-m", f"{files} files")
    commit = git(loose, "rev-parse", "HEAD").strip()
    packed = base / "agent-packed"
    shutil.copytree(loose, packed, symlinks=True)
    git(packed, "repack", "-adq")
    return loose, packed, commit


def fresh(base: Path, name: str) -> Path:
    path = base / name
    path.mkdir()
    git(path, "init", "-q")
    return path


def import_into(source: Path, dest: Path) -> None:
    src = os.open(source / ".git" / "objects", os.O_RDONLY | os.O_DIRECTORY)
    dst = os.open(dest / ".git" / "objects", os.O_RDONLY | os.O_DIRECTORY)
    try:
        report = import_objects(
            src, dst, owner=(os.getuid(), os.getgid()), max_bytes=1 << 34, max_objects=1 << 20
        )
    finally:
        os.close(src)
        os.close(dst)
    if report.refused or not report.imported:
        raise SystemExit(f"the import refused something: {report}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dir", default=None, help="where the temp repositories go")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-git-", dir=args.dir))
    try:
        loose, packed, commit = scratch_repo(base, args.files)
        objects = len(git(loose, "rev-list", "--objects", "HEAD").splitlines())
        cases: dict[str, Callable[[Path], object]] = {
            "import (loose)": lambda dest: import_into(loose, dest),
            "import (pack)": lambda dest: import_into(packed, dest),
            "git fetch (baseline)": lambda dest: git(dest, "fetch", "-q", str(loose), "main"),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        n = 0
        for _ in range(args.rounds):
            for name, run in cases.items():
                n += 1
                dest = fresh(base, f"dest{n}")
                start = time.perf_counter()
                run(dest)
                times[name].append((time.perf_counter() - start) * 1000)
                if name == "git fetch (baseline)":
                    git(dest, "cat-file", "-e", commit)
                shutil.rmtree(dest)
        baseline = statistics.median(times["git fetch (baseline)"])
        print(f"{args.files} files, {objects} objects, {args.rounds} rounds (medians)")
        for name, xs in times.items():
            median = statistics.median(xs)
            print(f"  {name:22s} {median:8.1f} ms   {median / baseline:5.2f}x the baseline")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
