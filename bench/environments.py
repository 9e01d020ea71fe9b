"""Benchmark of a project's set-up in its sandbox (docs/environments.md): substrate's own checkout,
its dev dependencies from the package index, against the same set-up on the host in the
same run (medians of `--runs`).

    python3 bench/environments.py [--runs 3]

Each run, steps interleaved so both sides see the same load and the same index:

1. **sandbox, fresh home**: a new copy of this checkout's HEAD (`git archive`, owned by
   uid 1000, so a new workspace with an empty persistent home), set up as the README
   says with `setup`: `python3 -m venv --system-site-packages /home/agent/venv`, then
   `/home/agent/venv/bin/pip install -e '.[dev]'` (through the daemon's egress proxy);
2. **host, fresh (the baseline)**: the same two commands on the host, in another copy:
   a venv of this interpreter (no system site packages: this host has substrate's
   dependencies installed), `pip --isolated` (the host's own index settings ignored, so
   the same default index) with an empty `--cache-dir`, through a listener of *the same
   daemon's proxy* on the host with the same allow-list, and the host CA bundle;
3. **sandbox, warm home, same venv**: the workspace released (its containers go, the
   home stays) and adopted again, then the same two commands (after a `git pull`, say);
4. **host, same venv (baseline)**: the same two commands again on the host;
5. **sandbox, warm home, new venv**: `/home/agent/venv2` in the same home: what pip's
   cache in the home saves.

Each line gives the wall time of the venv, of the install and of both (as the client
sees `proc.run`), and how many files pip downloaded (its `Downloading` lines, with their
sizes). After the runs, tests/workspace/test_policy.py runs under `default` with the last venv,
as a check. Needs the engine, the substrate-sandbox:bookworm image and root. Reaches no
address but loopback and the package index, through the daemon's proxy only.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from substrate.config import Config  # noqa: E402
from substrate.daemon import open_daemon  # noqa: E402
from substrate.egress.allow import AllowList  # noqa: E402
from substrate.egress.cabundle import bundle_path  # noqa: E402
from substrate.egress.pipindex import pip_index_hosts  # noqa: E402
from substrate.egress.proxy import Gate  # noqa: E402
from substrate.protocol.client import AsyncClient, open_client  # noqa: E402

DOWNLOAD = re.compile(r"^\s*Downloading (\S+) \(([\d.]+) (bytes|kB|MB|GB)\)", re.M)
UNIT = {"bytes": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}
LABELS = {
    "sandbox-fresh": "sandbox `setup`, fresh home",
    "host-fresh": "host, fresh (baseline)",
    "sandbox-warm": "sandbox, warm home, same venv",
    "host-warm": "host, same venv (baseline)",
    "sandbox-venv2": "sandbox, warm home, new venv",
}


@dataclass
class Step:
    venv_s: float
    install_s: float
    files: int
    mbytes: float

    @property
    def total_s(self) -> float:
        return self.venv_s + self.install_s


def downloads(out: str) -> tuple[int, float]:
    """(files, MB) of pip's `Downloading NAME (SIZE)` lines."""
    found = DOWNLOAD.findall(out)
    return len(found), sum(float(n) * UNIT[u] for _, n, u in found) / 1e6


def text(ref: dict[str, Any]) -> str:
    """An output ref of a result as text (pip's output here is ~16 KB, well under the
    64 KiB `inline_output_bytes`)."""
    if "inline" not in ref:
        raise SystemExit(f"output of {ref['bytes']} bytes not inline")
    return str(ref["inline"])


def copy_checkout(dest: Path, owner: int | None) -> None:
    """This checkout's HEAD (`git archive`, argv lists) at `dest`, owned by `owner`."""
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "HEAD"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    if owner is not None:
        for top, dirs, files in os.walk(dest):
            for name in [*dirs, *files]:
                os.lchown(os.path.join(top, name), owner, owner)
        os.lchown(dest, owner, owner)


class Sandbox:
    """Set-ups of one workspace through the daemon, `setup` profile."""

    def __init__(self, c: AsyncClient, checkout: Path) -> None:
        self.c, self.checkout, self.ws = c, checkout, ""

    async def adopt(self) -> None:
        self.ws = (await self.c.call("workspace.adopt", path=str(self.checkout)))["workspace"]

    async def release(self) -> None:
        await self.c.call("workspace.release", workspace=self.ws)

    async def timed(self, profile: str, argv: list[str]) -> tuple[float, str]:
        t0 = time.perf_counter()
        result = await self.c.call("proc.run", workspace=self.ws, profile=profile, argv=argv)
        wall = time.perf_counter() - t0
        out = text(result["stdout"]) + text(result["stderr"])
        if result["exit_code"] != 0 or "egress_blocked" in result:
            raise SystemExit(f"{argv} failed ({result.get('egress_blocked')}):\n{out[-3000:]}")
        return wall, out

    async def setup(self, venv: str) -> Step:
        venv_s, _ = await self.timed(
            "setup", ["python3", "-m", "venv", "--system-site-packages", venv]
        )
        install_s, out = await self.timed("setup", [f"{venv}/bin/pip", "install", "-e", ".[dev]"])
        return Step(venv_s, install_s, *downloads(out))


def host_setup(checkout: Path, cache: Path, proxy_port: int) -> Step:
    """The baseline: the same set-up on the host, through the daemon's proxy."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    venv = checkout / "venv"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
    t1 = time.perf_counter()
    done = subprocess.run(
        [
            str(venv / "bin" / "pip"),
            "--isolated",
            "install",
            "--cache-dir",
            str(cache),
            "--proxy",
            f"http://127.0.0.1:{proxy_port}",
            "--cert",
            str(bundle_path("host")),
            "-e",
            ".[dev]",
        ],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
    )
    t2 = time.perf_counter()
    if done.returncode != 0:
        raise SystemExit(f"host pip failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return Step(t1 - t0, t2 - t1, *downloads(done.stdout + done.stderr))


async def run(args: argparse.Namespace, base: Path) -> dict[str, list[Step]]:
    profiles = base / "profiles"
    profiles.mkdir()
    for name in ("default", "setup"):
        shutil.copy(REPO / "profiles" / f"{name}.toml", profiles / f"{name}.toml")
    roots, state = base / "roots", base / "state"
    roots.mkdir()
    config = Config(state_dir=str(state), adopt_roots=[str(roots)], profiles_dir=str(profiles))
    steps: dict[str, list[Step]] = {key: [] for key in LABELS}
    refused: list[str] = []

    async def denied(peer: int, host: str, port: int) -> None:
        refused.append(f"{host}:{port}")

    host_run = trio.to_thread.run_sync
    async with open_daemon(config) as daemon, trio.open_nursery() as nursery:
        await nursery.start(daemon.serve)
        # The host baseline goes through the same proxy: a listener of its own on the host.
        lsock = socket.socket()
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(64)
        pport = lsock.getsockname()[1]
        hosts, why = pip_index_hosts()
        if not hosts:
            raise SystemExit(f"no package index: {why}")
        daemon.egress.attach(lsock, Gate(allow=AllowList.of(hosts), label="host", denied=denied))
        async with open_client(state / "substrate.sock") as c:
            for i in range(args.runs):
                box = Sandbox(c, roots / f"substrate-{i}")
                await trio.to_thread.run_sync(copy_checkout, box.checkout, 1000)
                host = base / "host" / f"substrate-{i}"
                await trio.to_thread.run_sync(copy_checkout, host, None)
                cache = base / "host" / f"cache-{i}"
                await box.adopt()
                record(steps, i, "sandbox-fresh", await box.setup("/home/agent/venv"))
                record(steps, i, "host-fresh", await host_run(host_setup, host, cache, pport))
                await box.release()
                await box.adopt()
                record(steps, i, "sandbox-warm", await box.setup("/home/agent/venv"))
                record(steps, i, "host-warm", await host_run(host_setup, host, cache, pport))
                record(steps, i, "sandbox-venv2", await box.setup("/home/agent/venv2"))
            wall, out = await box.timed(
                "default",
                [
                    "/home/agent/venv/bin/python",
                    "-B",
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "tests/workspace/test_policy.py",
                ],
            )
            info = await c.call("workspace.info", workspace=box.ws)
            print(
                f"check: tests/workspace/test_policy.py under `default`: {out.strip().splitlines()[-1]}"
            )
            print(f"  ({wall:.1f} s); home: {info.get('home')}; refused: {refused or 'none'}")
        nursery.cancel_scope.cancel()
    return steps


def record(steps: dict[str, list[Step]], run: int, key: str, step: Step) -> None:
    steps[key].append(step)
    print(
        f"  run {run + 1} {LABELS[key]:32s} venv {step.venv_s:5.1f} s  install"
        f" {step.install_s:6.1f} s  downloaded {step.files:3d} files {step.mbytes:5.1f} MB",
        flush=True,
    )


def report(args: argparse.Namespace, steps: dict[str, list[Step]]) -> None:
    def med(key: str, attr: str) -> float:
        values: list[float] = [getattr(s, attr) for s in steps[key]]
        return statistics.median(values)

    def span(key: str) -> str:
        totals = [s.total_s for s in steps[key]]
        return f"{min(totals):5.1f}-{max(totals):5.1f}"

    print(f"substrate's own set-up: venv + pip install -e .[dev] (wall s, median of {args.runs})")
    print(f"  {'':32s} {'venv':>6s} {'install':>8s} {'total':>7s} {'range':>12s}  downloaded")
    for key, label in LABELS.items():
        ratio = ""
        if key.startswith("sandbox-") and key != "sandbox-venv2":
            baseline = "host-" + key.split("-")[1]
            ratio = f"  ratio {med(key, 'total_s') / med(baseline, 'total_s'):.2f} vs host"
        print(
            f"  {label:32s} {med(key, 'venv_s'):6.1f} {med(key, 'install_s'):8.1f}"
            f" {med(key, 'total_s'):7.1f} {span(key):>12s}  {med(key, 'files'):3.0f} files"
            f" {med(key, 'mbytes'):5.1f} MB{ratio}"
        )
    fresh, warm = med("sandbox-fresh", "total_s"), med("sandbox-warm", "total_s")
    print(f"  warm home, same venv / fresh home (sandbox): {warm / fresh:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="/tmp/sbst-envs-"))
    try:
        steps = trio.run(run, args, base)
    finally:
        # The daemon removed its sandboxes on the way out; the state dir, the homes and
        # the copies go too.
        shutil.rmtree(base, ignore_errors=True)
    report(args, steps)


if __name__ == "__main__":
    main()
