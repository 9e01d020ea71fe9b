"""Benchmark of the egress proxy (docs/egress.md): one run, ratios against baselines measured in
the same run (medians).

    python3 bench/egress.py [--mib 512] [--runs 5] [--conns 200]

Everything is on loopback: an origin server (a subprocess) serves `/big` (`--mib` MiB)
and `/small` (2 bytes); a client (a subprocess, the same script everywhere) reads a
response to its end and reports its own timing. Compared, interleaved so both see the
same load:

1. throughput of one large download: the client on the host straight from the origin
   (the baseline), vs the same client on the host through an `EgressProxy` in this
   process, vs the client *inside an egress sandbox* (a daemon in this process, a
   profile allowing `mirror.test`, which the proxy's resolver maps to the origin) through
   the listener in its namespace;
2. added latency per connection: `--conns` sequential connections, each one small GET
   to its end, direct vs through the proxy (host client), and from the sandbox (where
   there is no direct path: its figure is absolute);
3. only with `--index-package NAME`: one real download from the package index this
   machine's pip uses (the largest wheel of NAME for this platform, or its last file),
   with urllib, on the host straight (the baseline), on the host through the proxy, and
   in a `setup` sandbox through the proxy (and the host CA bundle), interleaved,
   `--index-runs` times.

Setting substrate's own checkout up through `setup` is bench/environments.py.

Needs the engine, the substrate-sandbox:bookworm image and root (the workspace is owned
by uid 1000). Reaches no address but loopback, except the package index with
`--index-package`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from substrate.config import Config  # noqa: E402
from substrate.daemon import open_daemon  # noqa: E402
from substrate.egress.allow import AllowList  # noqa: E402
from substrate.egress.pipindex import pip_index_hosts, pip_index_urls  # noqa: E402
from substrate.egress.proxy import Addresses, EgressProxy, Gate, system_resolve  # noqa: E402
from substrate.protocol.client import AsyncClient, open_client  # noqa: E402

MIRROR = "mirror.test"
#: (bytes, seconds) of each request.
Samples = list[tuple[int, float]]
#: The origin: `/big` is `size` bytes from a 1 MiB buffer, anything else 2 bytes.
ORIGIN = """\
import socket, sys, threading
size = int(sys.argv[1])
block = memoryview(bytes(range(256)) * 4096)
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0))
srv.listen(256)
print(srv.getsockname()[1], flush=True)
def serve(c):
    with c:
        buf = b""
        while b"\\r\\n\\r\\n" not in buf:
            d = c.recv(65536)
            if not d:
                return
            buf += d
        big = b" /big " in buf.split(b"\\r\\n", 1)[0] or b"/big HTTP" in buf.split(b"\\r\\n", 1)[0]
        n = size if big else 2
        c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\nConnection: close\\r\\n\\r\\n" % n)
        while n > 0:
            k = min(n, len(block))
            c.sendall(block[:k])
            n -= k
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""
#: The client: argv host port path count; prints one "bytes seconds" line per request.
CLIENT = """\
import socket, sys, time
host, port, path, count = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
buf = bytearray(1 << 20)
for _ in range(count):
    t0 = time.perf_counter()
    s = socket.create_connection((host, port))
    s.sendall(b"GET " + path.encode() + b" HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
    total = 0
    while (n := s.recv_into(buf)):
        total += n
    s.close()
    print(total, time.perf_counter() - t0)
"""


#: Downloads argv[1] with urllib; prints "bytes seconds".
FETCH = """\
import sys, time, urllib.request
t0 = time.perf_counter()
total = 0
with urllib.request.urlopen(sys.argv[1], timeout=120) as r:
    while (d := r.read(1 << 20)):
        total += len(d)
print(total, time.perf_counter() - t0)
"""
#: Prints the URL of the largest file on the simple index page argv[1] (a wheel for
#: CPython 3.11 on x86-64 Linux if there is one).
PICK = """\
import re, sys, urllib.parse, urllib.request
page = urllib.request.urlopen(sys.argv[1], timeout=60).read().decode()
links = [urllib.parse.urljoin(sys.argv[1], h.split("#")[0]) for h in re.findall(r'href="([^"]+)"', page)]
fit = [u for u in links if "cp311" in u and "manylinux" in u and "x86_64" in u]
print((fit or links)[-1])
"""


def client(host: str, port: int, path: str, count: int) -> list[tuple[int, float]]:
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, host, str(port), path, str(count)],
        capture_output=True,
        check=True,
        text=True,
    ).stdout
    return [(int(a), float(b)) for a, b in (line.split() for line in out.splitlines())]


async def in_sandbox(c: AsyncClient, ws: str, path: str, count: int) -> list[tuple[int, float]]:
    result = await c.call(
        "proc.run",
        workspace=ws,
        profile="local",
        argv=["python3", "-c", CLIENT, "127.0.0.1", "3128", path, str(count)],
    )
    if result["exit_code"] != 0:
        raise SystemExit(f"sandbox client failed: {result['stderr']}")
    out = result["stdout"]["inline"]
    return [(int(a), float(b)) for a, b in (line.split() for line in out.splitlines())]


def mib_s(samples: list[tuple[int, float]]) -> float:
    return statistics.median(n / t for n, t in samples) / (1 << 20)


def main(args: argparse.Namespace) -> None:
    origin = subprocess.Popen(
        [sys.executable, "-c", ORIGIN, str(args.mib << 20)], stdout=subprocess.PIPE, text=True
    )
    assert origin.stdout is not None
    port = int(origin.stdout.readline())
    base = Path(tempfile.mkdtemp(prefix="/tmp/sbst-egress-"))
    try:
        trio.run(run, args, port, base)
    finally:
        origin.kill()
        origin.wait()
        # The daemon removed its sandboxes on the way out; the state dir goes too.
        shutil.rmtree(base, ignore_errors=True)


async def run(args: argparse.Namespace, port: int, base: Path) -> None:
    async def to_origin(host: str, want: int) -> Addresses:
        if host != MIRROR:  # the package index of figure 3
            return await system_resolve(host, want)
        return [(socket.AF_INET, ("127.0.0.1", port))]

    async def nothing(peer: int, host: str, p: int) -> None:
        pass

    profiles = base / "profiles"
    profiles.mkdir()
    (profiles / "local.toml").write_text('network = "egress"\negress_allow = ["mirror.test"]\n')
    shutil.copy(REPO / "profiles" / "setup.toml", profiles / "setup.toml")
    shutil.copy(REPO / "profiles" / "default.toml", profiles / "default.toml")
    project = base / "roots" / "project"
    project.mkdir(parents=True)
    os.chown(project, 1000, 1000)
    state = base / "state"
    config = Config(
        state_dir=str(state), adopt_roots=[str(project.parent)], profiles_dir=str(profiles)
    )
    async with open_daemon(config) as daemon, trio.open_nursery() as nursery:
        await nursery.start(daemon.serve)
        daemon.egress.resolve = to_origin
        daemon.egress.allow_local = True
        # A proxy of its own for the host client: the same code, a listener on the host.
        proxy = EgressProxy(resolve=to_origin, allow_local=True)
        await nursery.start(proxy.serve)
        lsock = socket.socket()
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(256)
        pport = lsock.getsockname()[1]
        allow = AllowList.of([MIRROR, *pip_index_hosts()[0]])
        proxy.attach(lsock, Gate(allow=allow, label="bench", denied=nothing))
        async with open_client(state / "substrate.sock") as c:
            ws = (await c.call("workspace.adopt", path=str(project)))["workspace"]
            await in_sandbox(c, ws, f"http://{MIRROR}/small", 1)  # warm the sandbox
            direct: list[tuple[int, float]] = []
            proxied: list[tuple[int, float]] = []
            sandboxed: list[tuple[int, float]] = []

            async def run_client(host: str, port_: int, path: str, count: int) -> Samples:
                return await trio.to_thread.run_sync(client, host, port_, path, count)

            for _ in range(args.runs):
                direct += await run_client("127.0.0.1", port, "/big", 1)
                proxied += await run_client("127.0.0.1", pport, f"http://{MIRROR}/big", 1)
                sandboxed += await in_sandbox(c, ws, f"http://{MIRROR}/big", 1)
            assert all(n > args.mib << 20 for n, _ in direct + proxied + sandboxed)
            lat_direct = await run_client("127.0.0.1", port, "/small", args.conns)
            lat_proxy = await run_client("127.0.0.1", pport, f"http://{MIRROR}/small", args.conns)
            lat_sandbox = await in_sandbox(c, ws, f"http://{MIRROR}/small", args.conns)
            index = await from_index(args, c, ws, pport) if args.index_package else None
        nursery.cancel_scope.cancel()
    report(args, direct, proxied, sandboxed, lat_direct, lat_proxy, lat_sandbox)
    if index is not None:
        size, host_runs, proxy_runs, sandbox_runs = index
        h, p, b = mib_s(host_runs), mib_s(proxy_runs), mib_s(sandbox_runs)
        print(
            f"3. one download of {size / (1 << 20):.1f} MiB from the package index "
            f"(MiB/s, median of {args.index_runs})"
        )
        print(f"  host, direct (baseline)        {h:9.1f}")
        print(f"  host, through the proxy        {p:9.1f}   ratio {p / h:.2f} (goal >= 0.8)")
        print(f"  setup sandbox, via the proxy   {b:9.1f}   ratio {b / h:.2f} (goal >= 0.8)")


async def from_index(
    args: argparse.Namespace, c: AsyncClient, ws: str, pport: int
) -> tuple[int, Samples, Samples, Samples]:
    """Figure 3: the same file from the package index: the host straight, the host
    through the proxy (the same client: what the proxy itself costs), a `setup` sandbox."""
    urls, why = pip_index_urls()
    if not urls:
        raise SystemExit(f"no package index: {why}")
    page = urls[0].rstrip("/") + f"/{args.index_package}/"

    def host(script: str, arg: str, proxied: bool = False) -> tuple[int, float]:
        env = dict(os.environ)
        for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
            env.pop(name, None)
        if proxied:
            env["HTTPS_PROXY"] = f"http://127.0.0.1:{pport}"
        done = subprocess.run(
            [sys.executable, "-c", script, arg],
            capture_output=True,
            check=True,
            text=True,
            env=env,
        )
        n, _, t = done.stdout.strip().partition(" ")
        return (int(n), float(t)) if t else (0, 0.0)

    def pick() -> str:
        done = subprocess.run(
            [sys.executable, "-c", PICK, page], capture_output=True, check=True, text=True
        )
        return done.stdout.strip()

    url = await trio.to_thread.run_sync(pick)
    direct: list[tuple[int, float]] = []
    proxied: list[tuple[int, float]] = []
    sandboxed: list[tuple[int, float]] = []
    for _ in range(args.index_runs):
        direct.append(await trio.to_thread.run_sync(host, FETCH, url))
        proxied.append(await trio.to_thread.run_sync(host, FETCH, url, True))
        result = await c.call(
            "proc.run", workspace=ws, profile="setup", argv=["python3", "-c", FETCH, url]
        )
        if result["exit_code"] != 0:
            raise SystemExit(f"sandbox download failed: {result['stderr']}")
        n, t = result["stdout"]["inline"].split()
        sandboxed.append((int(n), float(t)))
    return direct[0][0], direct, proxied, sandboxed


def report(args: argparse.Namespace, *series: list[tuple[int, float]]) -> None:
    direct, proxied, sandboxed, lat_direct, lat_proxy, lat_sandbox = series
    d, p, s = mib_s(direct), mib_s(proxied), mib_s(sandboxed)
    print(f"1. one download of {args.mib} MiB over loopback (MiB/s, median of {args.runs})")
    print(f"  host, direct (baseline)        {d:9.1f}")
    print(f"  host, through the proxy        {p:9.1f}   ratio {p / d:.2f} (goal >= 0.8)")
    print(f"  egress sandbox, its listener   {s:9.1f}   ratio {s / d:.2f} (goal >= 0.8)")

    def ms(samples: list[tuple[int, float]]) -> float:
        return statistics.median(t for _, t in samples) * 1000

    a, b, c = ms(lat_direct), ms(lat_proxy), ms(lat_sandbox)
    print(f"2. one connection + small GET to its end (ms, median of {args.conns})")
    print(f"  host, direct (baseline)        {a:9.3f}")
    print(f"  host, through the proxy        {b:9.3f}   added {b - a:.3f} ms")
    print(f"  egress sandbox, its listener   {c:9.3f}   added {c - a:.3f} ms (vs host direct)")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--conns", type=int, default=200)
    parser.add_argument("--index-package", default="")
    parser.add_argument("--index-runs", type=int, default=3)
    return parser.parse_args()


if __name__ == "__main__":
    main(parse())
