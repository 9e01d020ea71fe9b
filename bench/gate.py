"""Benchmark of the write gate for sandboxed code (docs/write-gate.md): one run.

    python3 bench/gate.py [--files 10000] [--runs 30]

Generates a workspace of --files files (100 per directory, a few denied ones among
them: a 256 KiB `poetry.lock`, `.env`, one `*.lock` per 10 directories) under
`write_deny = ["*.lock", ".env"]`, then measures, medians over --runs:

1. the gate alone, in-process: `before` (snapshot) and `after` (walk + compare) with
   nothing changed, and `after` that finds and reverts a modified `poetry.lock` plus a
   created `.env`;
2. warm `proc.run ["true"]` through a real in-process daemon on that workspace, with the
   gate and with the gate switched off: the difference is what the gate adds to a
   command, and the ratio is against the command's own wall time.

Needs the engine, the tiny image, and root (the workspace is chowned to uid 1000).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from substrate.config import PROJECT_ROOT, Config  # noqa: E402
from substrate.daemon import open_daemon  # noqa: E402
from substrate.protocol.client import open_client  # noqa: E402
from substrate.schema.workspace import Policy  # noqa: E402
from substrate.store.db import Store  # noqa: E402
from substrate.store.journal import Journal  # noqa: E402
from substrate.workspace.gate import EVERY_CHANGE_IS_THE_SANDBOXS, SnapshotGate  # noqa: E402
from substrate.workspace.registry import WorkspaceRegistry  # noqa: E402

OWNER = 1000
DENY = ["*.lock", ".env"]
LOCK = b"# lock\n" + b"x" * (256 << 10)


def generate(root: Path, files: int) -> int:
    """A tree of `files` small files, 100 per dir; returns how many are denied."""
    denied = 0
    root.mkdir(parents=True)
    (root / ".git" / "objects").mkdir(parents=True)
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "poetry.lock").write_bytes(LOCK)
    (root / ".env").write_text("TOKEN=x\n")
    denied += 2
    for i in range(files - 2):
        d = root / f"pkg{i // 1000:02d}" / f"mod{(i // 100) % 10:02d}"
        if i % 100 == 0:
            d.mkdir(parents=True, exist_ok=True)
        name = "deps.lock" if i % 1000 == 0 else f"f{i:05d}.py"
        denied += name.endswith(".lock")
        (d / name).write_text(f"VALUE = {i}\n")
    for base, dirs, names in os.walk(root):
        for name in [*dirs, *names]:
            os.lchown(os.path.join(base, name), OWNER, OWNER)
    os.chown(root, OWNER, OWNER)
    return denied


def tamper(project: Path) -> None:
    """What an offending command does: append to the lock, create another."""
    with open(project / "poetry.lock", "ab") as f:
        f.write(b"tampered\n")
    (project / "new.env").write_text("x")
    os.rename(project / "new.env", project / "sub.lock")


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.2f} ms (p90 {sorted(xs)[int(0.9 * (len(xs) - 1))]:.2f})"


async def timed(fn: Callable[[], Awaitable[Any]], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


async def gate_alone(base: Path, project: Path, runs: int) -> dict[str, list[float]]:
    state = base / "state-gate"
    state.mkdir(mode=0o700)
    store = Store(state / "substrate.db")
    journal = Journal(store)
    config = Config(state_dir=str(state), adopt_roots=[str(project.parent)])
    registry = WorkspaceRegistry(config, store, journal, state)
    ws = registry.adopt(str(project), None, Policy(write_deny=DENY), "bench")
    gate = SnapshotGate(state / "gate", journal, attribution=EVERY_CHANGE_IS_THE_SANDBOXS)
    out: dict[str, list[float]] = {"before": [], "after": [], "revert": []}
    try:
        await gate.after(ws, await gate.before(ws))  # first snapshot keeps the bytes
        for _ in range(runs):
            t0 = time.perf_counter()
            ticket = await gate.before(ws)
            t1 = time.perf_counter()
            blocked = await gate.after(ws, ticket)
            t2 = time.perf_counter()
            assert blocked == [], blocked
            out["before"].append((t1 - t0) * 1000)
            out["after"].append((t2 - t1) * 1000)
        for _ in range(runs):
            ticket = await gate.before(ws)
            await trio.to_thread.run_sync(tamper, project)
            t = time.perf_counter()
            blocked = await gate.after(ws, ticket)
            out["revert"].append((time.perf_counter() - t) * 1000)
            assert len(blocked) == 2 and all(b.reverted for b in blocked), blocked
        assert (project / "poetry.lock").read_bytes() == LOCK
    finally:
        registry.close()
        store.close()
    return out


async def through_daemon(base: Path, project: Path, runs: int) -> dict[str, list[float]]:
    state = base / "state"
    state.mkdir(mode=0o700)
    profiles = base / "profiles"
    profiles.mkdir()
    shutil.copy(PROJECT_ROOT / "profiles" / "tiny.toml", profiles / "tiny.toml")
    config = Config(  # terminals on a free port: the default one may be another daemon's
        state_dir=str(state), adopt_roots=[str(project.parent)], profiles_dir=str(profiles),
        listen="127.0.0.1:0",
    )  # fmt: skip
    async with open_daemon(config) as daemon, trio.open_nursery() as nursery:
        await nursery.start(daemon.serve)
        async with open_client(state / "substrate.sock") as client:
            ws = await client.call(
                "workspace.adopt", path=str(project), policy={"write_deny": DENY}
            )

            async def true() -> Any:
                return await client.call(
                    "proc.run", workspace=ws["workspace"], profile="tiny", argv=["true"]
                )

            await true()  # container start and fact checks
            processes = daemon.execution.processes
            gate = processes.write_gate
            for _ in range(3):
                await true()
            gated: list[float] = []
            bare: list[float] = []
            duration: list[float] = []
            try:
                for _ in range(runs):  # interleaved, so background load hits both alike
                    processes.write_gate = gate
                    gated += await timed(true, 1)
                    processes.write_gate = None
                    t = time.perf_counter()
                    result = await true()
                    bare.append((time.perf_counter() - t) * 1000)
                    duration.append(result["duration_ms"])
            finally:
                processes.write_gate = gate
        nursery.cancel_scope.cancel()
    return {"gated": gated, "bare": bare, "duration": duration}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10000)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    os.environ["DOCKER_HOST"] = "unix:///var/run/docker.sock"
    base = Path(tempfile.mkdtemp(prefix="sbg-", dir="/tmp"))
    try:
        project = base / "roots" / "project"
        denied = generate(project, args.files)
        print(f"workspace: {args.files} files, {denied} denied, write_deny={DENY}")
        alone = await gate_alone(base, project, args.runs)
        check = [b + a for b, a in zip(alone["before"], alone["after"], strict=True)]
        print(f"gate before (snapshot)         {ms(alone['before'])}")
        print(f"gate after (nothing changed)   {ms(alone['after'])}")
        print(f"gate snapshot + check          {ms(check)}")
        print(f"gate after (detect + revert 2) {ms(alone['revert'])}")
        daemon = await through_daemon(base, project, args.runs)
        gated, bare = statistics.median(daemon["gated"]), statistics.median(daemon["bare"])
        print(f"proc.run true, gate on         {ms(daemon['gated'])}")
        print(f"proc.run true, gate off        {ms(daemon['bare'])}")
        print(f"  command's own duration_ms    {ms(daemon['duration'])}")
        print(
            f"gate adds {gated - bare:.2f} ms to a warm command ({gated / bare:.2f}x); "
            f"snapshot+check is {statistics.median(check) / bare:.2f}x the bare command"
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    trio.run(main)
