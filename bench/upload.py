"""Chunked upload benchmark (docs/protocol.md §14): `fs.upload.*` throughput against a local copy.

Starts a real daemon on a private temp dir and prints, measured in this run:

1. a `--mib` MiB file written into a workspace by `Client.upload_file` (hash, begin,
   chunks of the daemon's `chunk_bytes`, commit: the streamed guarded write), each round
   a new target;
2. the baseline: the same bytes copied locally into the same filesystem the way a
   guarded write lands them (read, write a temp file, fsync, rename, fsync the dir);
3. `fs.write` of a ~700 KiB file per call (the largest one a 1 MiB request line holds),
   as MB/s, to show what a chunk costs compared with a whole small write;
4. the daemon's screen of a chunk's request line for out-of-range integers
   (`rpc.decode_call`: translate + substring search) against the regex it replaced
   (`[0-9]{19,}`), on the same 1 MiB line.

Figures are medians of `--rounds` rounds after one warm-up; the ratio is upload / local.

    python bench/upload.py [--dir /tmp] [--mib 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchdaemon import BenchDaemon  # noqa: E402
from substrate.protocol import rpc  # noqa: E402
from substrate.protocol.client import Client  # noqa: E402
from substrate.schema.upload import chunk_bytes  # noqa: E402

MiB = 1 << 20
#: A whole `fs.write` that still fits one 1 MiB request line as base64.
SMALL_WRITE = 700_000


def median_of(rounds: int, measure: Callable[[], float]) -> float:
    measure()  # warm-up
    return statistics.median(measure() for _ in range(rounds))


def screen_ratio(rounds: int) -> tuple[float, float]:
    """(regex, translate) seconds to screen one 1 MiB chunk line, medians of 50-line runs."""
    data = base64.b64encode(os.urandom(chunk_bytes(MiB))).decode()
    line = rpc.reply_result(1, {"upload": "upl_" + "ab" * 16, "offset": 0, "data_b64": data})
    regex = re.compile(rb"[0-9]{19,}")

    def by_regex() -> float:
        t = time.perf_counter()
        for _ in range(50):
            regex.search(line)
        return time.perf_counter() - t

    def by_translate() -> float:
        t = time.perf_counter()
        for _ in range(50):
            _ = rpc._LONG_DIGITS in line.translate(rpc._DIGITS_AS_ZERO)
        return time.perf_counter() - t

    return median_of(rounds, by_regex) / 50, median_of(rounds, by_translate) / 50


def local_copy(source: Path, target_dir: Path, name: str) -> None:
    """What a guarded write does on disk, without substrate: temp file, fsync, rename."""
    temp = target_dir / f".tmp-{name}"
    with open(source, "rb") as src, open(temp, "wb") as dst:
        while block := src.read(MiB):
            dst.write(block)
        dst.flush()
        os.fsync(dst.fileno())
    os.rename(temp, target_dir / name)
    fd = os.open(target_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="sbst-bench-", dir=args.dir))
    daemon = BenchDaemon(base)
    try:
        root = daemon.roots / "up"
        root.mkdir()
        os.chown(root, 1000, 1000)
        local = base / "local"
        local.mkdir()
        source = base / "source.bin"
        with open(source, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(MiB))
        small = os.urandom(SMALL_WRITE)
        counter = iter(range(1_000_000))
        with Client(daemon.socket) as c:
            ws = c.call("workspace.adopt", path=str(root))["workspace"]

            def upload() -> float:
                t = time.perf_counter()
                c.upload_file(ws, f"big-{next(counter)}.bin", source, base_sha256=None)
                return time.perf_counter() - t

            def copy() -> float:
                t = time.perf_counter()
                local_copy(source, local, f"big-{next(counter)}.bin")
                return time.perf_counter() - t

            def write_small() -> float:
                data_b64 = base64.b64encode(small).decode()
                t = time.perf_counter()
                c.call(
                    "fs.write",
                    workspace=ws,
                    path=f"small-{next(counter)}.bin",
                    base_sha256=None,
                    content_b64=data_b64,
                )
                return time.perf_counter() - t

            t_upload = median_of(args.rounds, upload)
            t_copy = median_of(args.rounds, copy)
            t_small = median_of(args.rounds * 4, write_small)
        size_mb = args.mib * MiB / 1e6
        print(f"file: {args.mib} MiB, rounds: {args.rounds} (medians)")
        print(f"upload_file (fs.upload.*)      {t_upload:7.3f} s  {size_mb / t_upload:8.1f} MB/s")
        print(f"local temp+fsync+rename (base) {t_copy:7.3f} s  {size_mb / t_copy:8.1f} MB/s")
        print(f"ratio upload / local throughput: {t_copy / t_upload:.2f}")
        print(f"fs.write of {SMALL_WRITE} bytes: {SMALL_WRITE / 1e6 / t_small:8.1f} MB/s")
        t_regex, t_translate = screen_ratio(args.rounds)
        print(
            f"integer screen of a 1 MiB chunk line: regex {t_regex * 1e3:.2f} ms,"
            f" translate {t_translate * 1e3:.2f} ms, ratio {t_regex / t_translate:.1f}"
        )
    finally:
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
