"""How an egress sandbox reaches the daemon's proxy, and how its refusals are attributed.

Theory of operation (docs/egress.md). An egress sandbox is created like any other, with
the engine's network "none": its namespace has `lo` and no route. Once it runs, and
before any command, `ProxyLinks.open` makes a TCP socket *inside that namespace* (on a
throwaway thread that `setns`es there and back, as `substrate.sandbox.netns` does for
netlink), binds it to 127.0.0.1:3128 there, listens, and hands it to the daemon's
`EgressProxy` with a `Gate` (the profile's allow-list). The daemon accepts on it from its
own namespace; the connection onwards leaves from the daemon's side. So:

- nothing runs in the sandbox for it (no forwarder to kill, replace or outlive), no
  socket file is mounted into it, and its namespace still shows only `lo`, no route;
- the port is taken before any command runs, by a socket no sandbox process can share
  (the daemon sets no SO_REUSEPORT); the `egress_listeners` fact checks from outside that
  it is the namespace's only listener and that its inode is the daemon's;
- every connection is the sandbox's (the socket is in its namespace), and `owner_of`
  finds the command: the connecting socket's inode in the namespace's `net/tcp`, the
  process in the container's cgroup holding it, and the command whose own cgroup holds
  that process (`reaper.owners`: its cgroup's, or its nearest ancestor's in one). Its
  `SUBSTRATE_PROC` says nothing: a refusal is never filed under another command.

A refused connection is filed in the sandbox's `SandboxLedger` (the command's result
reports it as `egress_blocked`) and journalled as `egress.denied` (container, profile,
proc, host, port: no path, no header, no byte of the request).

The link closes with its sandbox (`ProxyLink.aclose`): the listener is the last thing
holding the namespace once the container is gone, so it must not outlive it.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import trio

from substrate.egress import cabundle
from substrate.egress.allow import AllowList
from substrate.egress.authority import SandboxAuthority
from substrate.egress.inject import Injection
from substrate.egress.ledger import SandboxLedger
from substrate.egress.proxy import Attachment, EgressProxy, Gate
from substrate.errors import ConfinementUnmet, RuntimeUnavailable, SecretUnknown
from substrate.sandbox import facts as F
from substrate.sandbox import parsers as P
from substrate.sandbox import reaper
from substrate.sandbox.facts import Fact, FactValue
from substrate.sandbox.netns import socket_in
from substrate.sandbox.profiles import Profile
from substrate.sandbox.readings import why
from substrate.sandbox.spec import PROXY_HOST, PROXY_PORT
from substrate.secrets import SecretStore
from substrate.store.journal import Journal

log = logging.getLogger("substrate.sandbox.proxy_link")

#: Connections queued on a sandbox's listener before the daemon accepts them.
BACKLOG = 128
#: Longest the attribution of one refused connection may take (a procfs scan).
ATTRIBUTE_S = 5.0
#: Sandbox CAs made and not yet claimed by their link (creations that failed).
MAX_PENDING = 64


def open_listener(init_pid: int) -> socket.socket:
    """A TCP socket listening on 127.0.0.1:3128 inside the network namespace of host
    process `init_pid` (a sandbox's init). Blocking (a thread, a bind). Raises OSError
    (the process is gone, the port is taken, no CAP_SYS_ADMIN)."""
    ns_fd = os.open(f"/proc/{init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        sock = socket_in(ns_fd, socket.AF_INET, socket.SOCK_STREAM)
    finally:
        os.close(ns_fd)
    try:
        sock.bind((PROXY_HOST, PROXY_PORT))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def owner_of(init_pid: int, peer_port: int) -> str | None:
    """The command whose process holds the socket that connected from
    127.0.0.1:`peer_port` to the proxy in the namespace of `init_pid` (the command whose
    own cgroup holds that process, or its nearest ancestor: `reaper.owners`);
    None when none is found (gone already, or a process no command owns). Blocking:
    one `net/tcp` read and a scan of the fds of the container's processes (about 1 ms
    for a few hundred descriptors)."""
    try:
        text = Path(f"/proc/{init_pid}/net/tcp").read_text()
        dirs = reaper.CgroupDirs.of_pid(init_pid)
    except OSError:
        return None
    local, remote = f"{PROXY_HOST}:{peer_port}", f"{PROXY_HOST}:{PROXY_PORT}"
    inode = next(
        (s.inode for s in P.parse_proc_net_tcp(text) if s.local == local and s.remote == remote),
        0,
    )
    if not inode:
        return None
    pids = [p for p in reaper.cgroup_pids(dirs) if p != init_pid]
    link = f"socket:[{inode}]"
    holder = next((p for p in pids if _holds(p, link)), None)
    if holder is None:
        return None
    return reaper.owners(dirs, frozenset({init_pid})).get(holder)


def _holds(pid: int, link: str) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == link:
                return True
        except OSError:
            continue
    return False


def observe_link(
    init_pid: int,
    listener_inode: int,
    gate_digest: str,
    ca: bool,
    authority: SandboxAuthority | None = None,
) -> list[Fact]:
    """The egress facts of the sandbox whose init is `init_pid`, read from outside:
    `egress_listeners` (every listening TCP socket of its namespace, "ip:port=substrate"
    for the daemon's, "=other" for any other), `egress_allow_digest` (the list the
    proxy enforces for it), when `ca`, `ca_bundle` (the digest of the file it sees,
    read through its root without following a symlink) and, with an `authority` (the
    gate's), `egress_inject` (the hosts it injects for) and `egress_ca` (its CA's
    fingerprint). Blocking; a failed read is a None value with its reason in the source."""
    now = time.time()
    found = [
        F.make_fact("egress_allow_digest", gate_digest, source="egress:proxy", observed_at=now)
    ]
    if authority is not None:
        hosts = sorted(authority.hosts)
        found.append(F.make_fact("egress_inject", hosts, source="egress:proxy", observed_at=now))
        found.append(
            F.make_fact("egress_ca", authority.fingerprint, source="egress:proxy", observed_at=now)
        )
    try:
        entries = []
        for name in ("tcp", "tcp6"):
            entries += P.parse_proc_net_tcp(Path(f"/proc/{init_pid}/net/{name}").read_text())
        listening = sorted(
            f"{s.local}={'substrate' if s.inode == listener_inode else 'other'}"
            for s in entries
            if s.state == P.TCP_LISTEN
        )
        found.append(
            F.make_fact(
                "egress_listeners", listening, source="kernel:proc-net-tcp", observed_at=now
            )
        )
    except (OSError, ValueError) as exc:
        found.append(
            F.make_fact("egress_listeners", None, source=f"kernel:proc-net-tcp ({why(exc)})")
        )
    if ca:
        try:
            value: str | None = cabundle.digest(_read_in_root(init_pid, cabundle.CA_BUNDLE_TARGET))
            source = "kernel:proc-root"
        except (OSError, ValueError) as exc:
            value, source = None, f"kernel:proc-root ({why(exc)})"
        found.append(F.make_fact("ca_bundle", value, source=source, observed_at=now))
    return found


def _read_in_root(pid: int, path: str) -> bytes:
    """A file as process `pid` sees it, component by component under its root, refusing
    a symlink anywhere (an absolute one would resolve from *our* root)."""
    fd = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        parts = [p for p in path.split("/") if p]
        for part in parts[:-1]:
            nxt = os.open(
                part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
            )
            os.close(fd)
            fd = nxt
        leaf = os.open(
            parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd
        )
        with os.fdopen(leaf, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError("not a regular file")
            return f.read(cabundle.MAX_CA_BYTES + 1)
    finally:
        os.close(fd)


@dataclass(eq=False)
class ProxyLink:
    """One egress sandbox's connection to the proxy (made by `ProxyLinks.open`)."""

    attachment: Attachment
    ledger: SandboxLedger
    allow: AllowList
    listener_inode: int
    init_pid: int
    ca: bool
    #: With `egress_inject`: the sandbox's CA, and its own CA bundle file (removed here).
    authority: SandboxAuthority | None = None
    bundle_file: Path | None = None

    def observe(self) -> list[Fact]:
        """`observe_link` for this sandbox (blocking: call it from a worker thread)."""
        return observe_link(
            self.init_pid, self.listener_inode, self.allow.digest, self.ca, self.authority
        )

    async def aclose(self) -> None:
        """Stop accepting, end the open connections, close the listener; remove the
        sandbox's own CA bundle (no other sandbox binds it)."""
        await self.attachment.aclose()
        if self.bundle_file is not None:
            self.bundle_file.unlink(missing_ok=True)


async def prepare(
    links: ProxyLinks | None, profile: Profile
) -> tuple[str | None, dict[str, FactValue]]:
    """Before a sandbox of `profile` is created: (host path of its CA bundle copy, or
    None; the egress facts it must show, `facts.egress_required`), both empty for a
    `network = "none"` profile. Refuses `runtime_unavailable` (an egress profile, and
    this daemon runs no proxy), `ProxyLinks.authority_for`'s (`secret_unknown`) and
    `ProxyLinks.ca_bundle`'s."""
    if profile.network != "egress":
        return None, {}
    if links is None:
        raise RuntimeUnavailable("this daemon runs no egress proxy")
    authority = await links.authority_for(profile)
    ca = await links.ca_bundle(profile, authority)
    return (None if ca is None else ca[0]), F.egress_required(
        profile,
        ca_bundle=None if ca is None else ca[1],
        egress_ca=None if authority is None else authority.fingerprint,
    )


async def link(
    links: ProxyLinks | None,
    held: list[ProxyLink],
    container: str,
    workspace: str,
    profile: Profile,
    init_pid: int,
    required: Mapping[str, FactValue],
) -> list[Fact]:
    """A started egress sandbox: open its link (appended to `held`, which the caller
    closes if the sandbox is not used) and return its facts; [] for other profiles.
    Refuses as `ProxyLinks.open`."""
    if links is None or profile.network != "egress":
        return []
    ca = required.get("ca_bundle")
    claimed = links.claim(ca) if isinstance(ca, str) else None
    made = await links.open(
        container, workspace, profile, init_pid, ca=ca is not None, claimed=claimed
    )
    held.append(made)
    return await trio.to_thread.run_sync(made.observe, limiter=links.limiter)


async def observe_again(made: ProxyLink | None, limiter: trio.CapacityLimiter | None) -> list[Fact]:
    """The egress facts of a sandbox observed again (a working layer's swap); [] when it
    has no link."""
    if made is None:
        return []
    return await trio.to_thread.run_sync(made.observe, limiter=limiter)


class ProxyLinks:
    """Makes the links of one daemon's egress sandboxes (`Containers` holds it)."""

    def __init__(
        self,
        proxy: EgressProxy,
        journal: Journal,
        *,
        files_dir: Path | None,
        limiter: trio.CapacityLimiter | None = None,
        secrets: SecretStore | None = None,
    ) -> None:
        self.proxy = proxy
        self._journal = journal
        self._files_dir = files_dir
        self.limiter = limiter
        self._secrets = secrets
        #: Authorities made for sandboxes being created, by their bundle's digest, until
        #: their link claims them (`claim`); bounded: a creation that failed leaves one.
        self._pending: dict[str, tuple[SandboxAuthority, Path]] = {}

    async def authority_for(self, profile: Profile) -> SandboxAuthority | None:
        """A new CA for a sandbox of `profile` when it has `egress_inject` (else None),
        once every secret it names is set. Refuses `secret_unknown` naming the missing
        ones (nothing is made then). Cost: one lstat and read per secret, one EC key."""
        if profile.network != "egress" or not profile.egress_inject:
            return None
        names = sorted({rule.secret for rule in profile.egress_inject.values()})
        if self._secrets is None:
            raise SecretUnknown("this daemon keeps no secrets", secrets=names)
        store = self._secrets
        await trio.to_thread.run_sync(store.load, names, limiter=self.limiter)
        return await trio.to_thread.run_sync(
            SandboxAuthority, list(profile.egress_inject), limiter=self.limiter
        )

    def claim(self, digest: str) -> tuple[SandboxAuthority, Path] | None:
        """The authority (and bundle file) `ca_bundle` made for the bundle `digest`."""
        return self._pending.pop(digest, None)

    async def ca_bundle(
        self, profile: Profile, authority: SandboxAuthority | None = None
    ) -> tuple[str, str] | None:
        """(host path of the daemon's copy, digest) of `profile`'s CA bundle, with
        `authority`'s certificate appended when given (that file is the sandbox's own);
        None when it has none. Refuses `confinement_unmet` when the bundle no longer
        reads (the reason names a host path: it goes to the log). Blocking work in a
        worker thread."""
        if profile.network != "egress" or not profile.ca_bundle or self._files_dir is None:
            return None
        files_dir = self._files_dir

        def copy() -> tuple[str, str]:
            data = cabundle.read_bundle(cabundle.bundle_path(profile.ca_bundle))
            if authority is not None:
                data = data.rstrip(b"\n") + b"\n" + authority.cert_pem
            path, digest = cabundle.copy_into(files_dir, data)
            if authority is not None:
                self._hold(digest, authority, path)
            return str(path), digest

        try:
            return await trio.to_thread.run_sync(copy, limiter=self.limiter)
        except (OSError, ValueError) as exc:
            log.error("profile %s: the CA bundle no longer reads: %s", profile.name, exc)
            raise ConfinementUnmet(
                f"the CA bundle of profile {profile.name!r} no longer reads (see the log)",
                required={"ca_bundle": profile.ca_bundle},
                observed={"ca_bundle": "unreadable"},
            ) from None

    def _hold(self, digest: str, authority: SandboxAuthority, path: Path) -> None:
        while len(self._pending) >= MAX_PENDING:
            _, (_, stale) = self._pending.popitem()  # its sandbox was never linked
            stale.unlink(missing_ok=True)
        self._pending[digest] = (authority, path)

    async def open(
        self,
        container: str,
        workspace: str,
        profile: Profile,
        init_pid: int,
        *,
        ca: bool,
        claimed: tuple[SandboxAuthority, Path] | None = None,
    ) -> ProxyLink:
        """Listen inside the sandbox's namespace and attach the listener to the proxy.
        Refuses `runtime_unavailable` (the sandbox is gone, the port is taken, the proxy
        is not running). Cost: about 1 ms."""
        try:
            sock = await trio.to_thread.run_sync(open_listener, init_pid, limiter=self.limiter)
        except OSError as exc:
            raise RuntimeUnavailable(
                f"the egress listener of profile {profile.name!r} could not be opened: "
                f"{exc.strerror or type(exc).__name__}"
            ) from None
        inode = os.fstat(sock.fileno()).st_ino
        allow = AllowList.of(profile.egress_allow)
        ledger = SandboxLedger()
        short = container[:12]
        journal = self._journal
        limiter = self.limiter

        async def denied(peer_port: int, host: str, port: int) -> None:
            proc = None
            with trio.move_on_after(ATTRIBUTE_S):
                proc = await trio.to_thread.run_sync(owner_of, init_pid, peer_port, limiter=limiter)
            if not ledger.record(proc, host, port):
                return
            data = {
                "container": short,
                "profile": profile.name,
                "proc": proc,
                "host": host,
                "port": port,
            }
            await trio.to_thread.run_sync(
                lambda: journal.append("egress.denied", data, workspace=workspace),
                limiter=limiter,
            )

        authority, bundle_file = claimed if claimed is not None else (None, None)
        inject = {
            host: Injection(header=rule.header, secret=rule.secret)
            for host, rule in profile.egress_inject.items()
        }
        store = self._secrets

        async def secret(name: str) -> str:
            # Read when a connection opens: a value set again reaches the next one.
            if store is None:
                raise SecretUnknown("this daemon keeps no secrets", secrets=[name])
            values = await trio.to_thread.run_sync(store.load, [name], limiter=limiter)
            return values[name]

        gate = Gate(
            allow=allow,
            label=short,
            denied=denied,
            inject=inject if authority is not None else {},
            authority=authority,
            secret=secret if authority is not None else None,
        )
        attachment = self.proxy.attach(sock, gate)
        return ProxyLink(
            attachment=attachment,
            ledger=ledger,
            allow=allow,
            listener_inode=inode,
            init_pid=init_pid,
            ca=ca,
            authority=authority,
            bundle_file=bundle_file,
        )
