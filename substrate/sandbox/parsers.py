"""Pure parsers of what the kernel shows about a process: status, mounts, cgroups, routes.

`/proc/<pid>/status`, the mount facts of a `mountinfo` (the table itself:
`substrate.layer.mounts.mountinfo`), `cgroup` and the cgroup limit files, rtnetlink
routes, `net/tcp`. No I/O: the text comes from `substrate.sandbox.observe`, which turns
the parsed values into facts.

Each parser takes the text as the kernel writes it and raises ValueError on a malformed
value of a line it reads; tested in tests/sandbox/test_parsers.py with texts from real
hosts.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from substrate.layer.mounts.mountinfo import Mount, visible_mounts
from substrate.sandbox import profiles

#: Capability names by bit (linux/capability.h, no CAP_ prefix), 0..40.
CAP_NAMES: tuple[str, ...] = tuple(
    sorted(profiles.CAPABILITIES, key=lambda name: profiles.CAPABILITIES[name])
)
#: cgroup v1 reports "no memory limit" as PAGE_COUNTER_MAX pages (about 2**63 bytes).
_V1_UNLIMITED = 1 << 62
#: Mount points whose tmpfs mounts are the runtime's, not the profile's (/dev, /dev/shm, …).
_RUNTIME_TREES = ("/dev", "/proc", "/sys")
#: rtnetlink route types that deliver nowhere (blackhole, unreachable, prohibit, throw).
_DEAD_ROUTE_TYPES = frozenset({6, 7, 8, 9})
_RT_TABLE_LOCAL = 255
_SIZE_OPT_RE = re.compile(r"(?P<n>[0-9]+)(?P<unit>[kmgKMG]?)")


class ProcStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The confinement lines of /proc/<pid>/status. None/empty where a line is missing."""

    no_new_privs: bool | None
    seccomp_mode: int | None
    cap_eff: list[str]
    cap_prm: list[str]
    cap_bnd: list[str]
    cap_amb: list[str]
    uids: tuple[int, ...]  # real, effective, saved, filesystem
    gids: tuple[int, ...]


class Route(msgspec.Struct, frozen=True, kw_only=True):
    """One rtnetlink route, as much of it as the facts need."""

    family: int  # 2 = inet, 10 = inet6
    table: int
    type: int  # 1 unicast, 2 local, 3 broadcast, 6.. dead ends
    dst: str | None
    dst_len: int
    gateway: str | None
    oif: str | None  # the output link's name


# -- procfs -----------------------------------------------------------------------


def cap_names(mask: int) -> list[str]:
    """Capability names in a CapEff-style mask, sorted; unknown bits as "CAP_<bit>"."""
    out = []
    bit = 0
    while mask >> bit:
        if mask >> bit & 1:
            out.append(CAP_NAMES[bit] if bit < len(CAP_NAMES) else f"CAP_{bit}")
        bit += 1
    return sorted(out)


def parse_status(text: str) -> ProcStatus:
    """The confinement lines of a /proc/<pid>/status text (pure).

    Raises ValueError on a malformed value of a line it reads.
    """
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key] = value.strip()

    def caps(key: str) -> list[str]:
        return cap_names(int(fields[key], 16)) if key in fields else []

    def ids(key: str) -> tuple[int, ...]:
        return tuple(int(v) for v in fields.get(key, "").split())

    nnp = fields.get("NoNewPrivs")
    seccomp = fields.get("Seccomp")
    return ProcStatus(
        no_new_privs=None if nnp is None else nnp == "1",
        seccomp_mode=None if seccomp is None else int(seccomp),
        cap_eff=caps("CapEff"),
        cap_prm=caps("CapPrm"),
        cap_bnd=caps("CapBnd"),
        cap_amb=caps("CapAmb"),
        uids=ids("Uid"),
        gids=ids("Gid"),
    )


def parse_status_field(text: str, key: str) -> str | None:
    """One field of a /proc/<pid>/status text ("PPid" → "4242"), None when absent."""
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name == key:
            return value.strip()
    return None


def one_id(ids: tuple[int, ...]) -> int | str | None:
    """The id when real, effective, saved and filesystem ids agree; else "r/e/s/fs".

    A process whose saved id differs can switch back to it, so a split is reported as
    the string (which never equals a required int).
    """
    if not ids:
        return None
    if len(set(ids)) == 1:
        return ids[0]
    return "/".join(str(i) for i in ids)


def topmost(mounts: Sequence[Mount]) -> dict[str, Mount]:
    """Mount point → the mount visible there (`visible_mounts`; the last if several)."""
    return {m.mount_point: m for m in visible_mounts(mounts)}


def rootfs_readonly(mounts: Sequence[Mount]) -> bool | None:
    """Is the mount at "/" read-only? None when there is none."""
    root = topmost(mounts).get("/")
    return None if root is None else root.read_only


def workspace_view(mounts: Iterable[tuple[str, bool]], target: str) -> tuple[str, list[str]]:
    """(`workspace_mount`, `readonly_dirs`) from (mount point, read-only) pairs.

    `workspace_mount` is "rw" | "ro" | "absent", or "mixed" for a read-only workspace
    with a writable mount inside it. `readonly_dirs` are the target-relative mount points
    that are read-only with no writable mount below them, sorted. Pure.
    """
    base = target.rstrip("/")
    under: dict[str, bool] = {}
    mode = "absent"
    for point, ro in mounts:
        if point == base:
            mode = "ro" if ro else "rw"
            under = {}  # a mount on the target hides whatever was mounted under it before
        elif point.startswith(base + "/"):
            under[point[len(base) + 1 :]] = ro
    if mode == "absent":
        return mode, []
    writable = [rel for rel, ro in under.items() if not ro]
    if mode == "ro" and writable:
        mode = "mixed"
    ro_dirs = sorted(
        rel
        for rel, ro in under.items()
        if ro and not any(w.startswith(rel + "/") for w in writable)
    )
    return mode, ro_dirs


def tmpfs_facts(mounts: Sequence[Mount]) -> list[str]:
    """The profile-visible tmpfs mounts as sorted "path=bytes" (runtime trees excluded)."""
    out = []
    for point, m in topmost(mounts).items():
        if m.fstype != "tmpfs" or _in_trees(point, _RUNTIME_TREES):
            continue
        size = next((o[5:] for o in m.super_options if o.startswith("size=")), None)
        out.append(f"{point}={size_option_bytes(size) if size else 'unlimited'}")
    return sorted(out)


def _in_trees(path: str, trees: Iterable[str]) -> bool:
    return any(path == t or path.startswith(t + "/") for t in trees)


def size_option_bytes(text: str) -> int:
    """Bytes of a mount `size=` value: digits with an optional k/m/g (binary). ValueError."""
    m = _SIZE_OPT_RE.fullmatch(text)
    if m is None:
        raise ValueError(f"invalid size option {text!r}")
    return int(m.group("n")) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group("unit").lower()]


# -- cgroups ------------------------------------------------------------------------------


def parse_cgroup(text: str) -> dict[str, str]:
    """/proc/<pid>/cgroup → controller → path; the v2 unified entry under "" (pure).

    v1 lines name their controllers ("4:memory:/docker/…", "1:cpu,cpuacct:/…"); named
    hierarchies keep their name ("name=systemd").
    """
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line:
            continue
        _, controllers, path = line.split(":", 2)
        if not controllers:
            out[""] = path
        for name in controllers.split(","):
            if name:
                out[name] = path
    return out


def cgroup_dir(
    controller: str, proc_cgroup: Mapping[str, str], host_mounts: Sequence[Mount]
) -> tuple[str, str] | None:
    """("v1" | "v2", host directory) holding `controller`'s files for a process.

    `proc_cgroup` is `parse_cgroup` of the process; `host_mounts` the *reader's* mounts
    (where the hierarchies are mounted, e.g. /sys/fs/cgroup/memory). A v1 hierarchy with
    the controller wins over the unified one (hybrid hosts). None when it cannot be found,
    or the path leaves the mounted hierarchy (another cgroup namespace).
    """
    if controller in proc_cgroup:
        for m in host_mounts:
            if m.fstype == "cgroup" and controller in m.super_options:
                found = _under_mount(m, proc_cgroup[controller])
                if found is not None:
                    return "v1", found
    if "" in proc_cgroup:
        for m in host_mounts:
            if m.fstype == "cgroup2":
                found = _under_mount(m, proc_cgroup[""])
                if found is not None:
                    return "v2", found
    return None


def _under_mount(m: Mount, path: str) -> str | None:
    parts = [p for p in path.split("/") if p]
    if ".." in parts:
        return None
    root = [p for p in m.root.split("/") if p]
    if parts[: len(root)] != root:
        return None
    rest = parts[len(root) :]
    return "/".join([m.mount_point.rstrip("/"), *rest]) or "/"


def parse_memory_limit_v1(text: str) -> int | None:
    """memory.limit_in_bytes → bytes, None when unlimited."""
    n = int(text.strip())
    return None if n >= _V1_UNLIMITED else n


def parse_max(text: str) -> int | None:
    """pids.max (v1 and v2), memory.max (v2): an integer or "max" (None)."""
    value = text.strip()
    return None if value == "max" else int(value)


def parse_cpu_v1(quota_text: str, period_text: str) -> float | None:
    """cpu.cfs_quota_us / cpu.cfs_period_us → cores; None when the quota is -1."""
    quota, period = int(quota_text.strip()), int(period_text.strip())
    return None if quota < 0 or period <= 0 else quota / period


def parse_cpu_max(text: str) -> float | None:
    """v2 cpu.max ("150000 100000", "max 100000") → cores; None when "max"."""
    quota, _, period = text.strip().partition(" ")
    if quota == "max":
        return None
    return int(quota) / int(period or "100000")


# -- network ------------------------------------------------------------------------------


def route_text(r: Route) -> str:
    """A route as one line: "inet 0.0.0.0/0 via 172.17.0.1 dev eth0 table 254"."""
    family = {2: "inet", 10: "inet6"}.get(r.family, f"family{r.family}")
    dst = f"{r.dst or ('::' if r.family == 10 else '0.0.0.0')}/{r.dst_len}"
    via = f" via {r.gateway}" if r.gateway else ""
    dev = f" dev {r.oif}" if r.oif else ""
    return f"{family} {dst}{via}{dev} table {r.table}"


def outside_routes(routes: Iterable[Route]) -> list[str]:
    """The routes that could carry a packet anywhere, as sorted `route_text` lines.

    Left out: the local table (the host's own addresses), dead ends (blackhole,
    unreachable, prohibit, throw), and the kernel's loopback routes (a loopback
    destination on lo with no gateway, as IPv6 puts ::1/128 in the main table).
    """
    out = []
    for r in routes:
        if r.table == _RT_TABLE_LOCAL or r.type in _DEAD_ROUTE_TYPES:
            continue
        if r.oif == "lo" and r.gateway is None and _loopback(r.dst, r.dst_len, r.family):
            continue
        out.append(route_text(r))
    return sorted(out)


def _loopback(dst: str | None, dst_len: int, family: int) -> bool:
    if dst is None:
        return False
    if family == 10:
        return dst == "::1" and dst_len == 128
    return dst.startswith("127.") and dst_len >= 8


# -- /proc/<pid>/net/tcp ----------------------------------------------------------------

#: `st` of a listening socket in /proc/net/tcp.
TCP_LISTEN = 0x0A


class TcpSocket(msgspec.Struct, frozen=True, kw_only=True):
    """One line of /proc/<pid>/net/tcp or tcp6: addresses as "ip:port"."""

    local: str
    remote: str
    state: int
    uid: int
    inode: int


def parse_proc_net_tcp(text: str) -> list[TcpSocket]:
    """The sockets of a /proc/<pid>/net/tcp or tcp6 text (the namespace of that process).
    Addresses are the kernel's hex in host byte order per 32-bit word: decoded to
    "127.0.0.1:3128" / "::1:3128". Raises ValueError on a malformed line."""
    out = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        out.append(
            TcpSocket(
                local=_hex_address(fields[1]),
                remote=_hex_address(fields[2]),
                state=int(fields[3], 16),
                uid=int(fields[7]),
                inode=int(fields[9]),
            )
        )
    return out


def _hex_address(field: str) -> str:
    addr, _, port = field.partition(":")
    raw = bytes.fromhex(addr)
    if len(raw) not in (4, 16):
        raise ValueError(f"malformed address {field!r}")
    # Each 32-bit word is in host (little-endian on every supported host) byte order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    return f"{ip}:{int(port, 16)}"
