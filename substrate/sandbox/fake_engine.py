"""An in-memory container engine and host view, for tests of logic without Docker.

Shipped with the package (httpcore's mock-backend idea) so that tests of
`substrate.sandbox.containers`, `substrate.process` and the intents run without an
engine. `FakeEngine` implements the `Engine` Protocol (`substrate.sandbox.engine`)
without `docker`: containers are records made from the create request, an exec is a
"program" (`FakeExec`) that writes framed output into a socket pair and exits when the
test (or a built-in program) says so. `FakeHost` is the `SandboxHost` of those
containers: it reports the confinement facts an honest engine and kernel would show for
the container's *own* create request, so a container made with weaker settings is
observed as weaker.

What it is not: a sandbox. Nothing runs, nothing is confined, no host process exists
for a fake pid (they are all above the kernel's `pid_max`, so the reaper finds nothing
and signals nothing), and the cgroup directories lead nowhere. Tests of confinement
itself stay under tests/integration/ with a real engine.

Built-in programs, by argv[0] (`builtin_program`): `true`, `false`, `echo ARGS...`,
`exit N`, `sleep ...` (runs until `FakeExec.exit`), and anything else is a program the
engine cannot start (exit 126 with the engine's message on stdout, no pid).
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import stat
import struct
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from substrate.errors import ImageMissing, RuntimeUnavailable
from substrate.sandbox import facts as F
from substrate.sandbox import observe, profiles, reaper
from substrate.sandbox.engine import ContainerGone, Engine, ExecStream
from substrate.sandbox.facts import Fact, FactValue
from substrate.sandbox.parsers import workspace_view
from substrate.sandbox.profiles import Profile
from substrate.sandbox.spec import HOME_TARGET, WORKSPACE_TARGET
from substrate.schema.journal import EngineStatus

__all__ = ["FakeContainer", "FakeEngine", "FakeExec", "FakeHost", "builtin_program"]

#: Fake host pids start above the kernel's largest `pid_max` (2**22): no real process
#: ever has one, so procfs and signals find nothing.
FAKE_PID_BASE = 5_000_000
#: Where a fake container's cgroup would be: nowhere (nothing is read or written there).
FAKE_CGROUP = Path("/nonexistent/substrate-fake-cgroup")
#: What the engine writes on stdout for a program it cannot start (see `argv.start_failure`).
NOT_FOUND = (
    b"OCI runtime exec failed: exec failed: unable to start container process: exec: "
    b'"%s": executable file not found in $PATH: unknown\r\n'
)

_HEADER = struct.Struct(">BxxxI")


@dataclass
class FakeContainer:
    """A container as the fake engine holds it: its create request and its state."""

    id: str
    name: str
    labels: dict[str, str]
    request: dict[str, Any]  # create_container's arguments (image, user, host_config, ...)
    image_id: str
    running: bool = False
    pid: int = 0  # the fake init's pid while running
    keepalive: int = 0  # its keep-alive child's
    generation: int = 0  # bumped by every (re)start: a new init process

    def boot(self) -> None:
        """(Re)start: a new init process and keep-alive."""
        self.pid, self.keepalive = _next_pid(), _next_pid()
        self.generation += 1
        self.running = True


@dataclass
class FakeExec:
    """One exec. A program drives it: `write` output, then `exit`."""

    id: str
    container: str
    argv: list[str]
    user: str
    workdir: str
    environment: dict[str, str]
    stdin: bool
    tty: bool
    pid: int = 0  # reported once it exited (a running fake exec shows none)
    started: bool = False
    running: bool = False
    exit_code: int | None = None
    peer: socket.socket | None = None  # the engine's end of the stream
    exited: trio.Event = field(default_factory=trio.Event)

    def write(self, data: bytes, stream: int = 1) -> None:
        """Output on stdout (1) or stderr (2); raw with a TTY. Small writes only: the
        socket pair's buffer must hold them (the pump drains it concurrently)."""
        if self.peer is None:
            return
        frame = data if self.tty else _HEADER.pack(stream, len(data)) + data
        self.peer.sendall(frame)

    def exit(self, code: int) -> None:
        """The program ended with `code`: its stream closes, inspect reports the code."""
        self.exit_code = code
        self.running = False
        if self.pid == 0 and self.started:
            self.pid = _next_pid()
        self._close()

    def vanish(self) -> None:
        """Its container went away: the stream closes, the exec is gone with it."""
        self.running = False
        self._close()

    def _close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        self.exited.set()


#: A program: called at the exec's start, it writes and exits now or later.
Program = Callable[[FakeExec], None]


def builtin_program(ex: FakeExec) -> None:
    """`true`, `false`, `echo`, `exit N`, `sleep` (until told), else "not found" (126)."""
    name = ex.argv[0].rsplit("/", 1)[-1]
    if name == "true":
        ex.exit(0)
    elif name == "false":
        ex.exit(1)
    elif name == "echo":
        ex.write((" ".join(ex.argv[1:]) + "\n").encode())
        ex.exit(0)
    elif name == "exit":
        ex.exit(int(ex.argv[1]))
    elif name == "sleep":
        return  # runs until the test calls `exit`
    else:
        ex.write(NOT_FOUND % ex.argv[0].encode())
        ex.pid = 0  # never had a process
        ex.exit_code = 126
        ex.running = False
        ex._close()


_pids = itertools.count(FAKE_PID_BASE)


def _next_pid() -> int:
    return next(_pids)


class FakeEngine:
    """`Engine` in memory. `images` maps references to ids (others are `image_missing`);
    `runtimes` are the registered runtimes; `program` runs every exec; `fail_next` makes
    a method's next calls raise. `calls` lists the method names called, in order."""

    def __init__(
        self,
        *,
        images: Mapping[str, str] | None = None,
        runtimes: Sequence[str] = ("runc", "runsc"),
        program: Program = builtin_program,
    ) -> None:
        self.images = dict(images if images is not None else {})
        self.registered = set(runtimes)
        self.program = program
        self._failures: dict[str, list[BaseException]] = {}
        self.calls: list[str] = []
        self.containers: dict[str, FakeContainer] = {}
        self.execs: dict[str, FakeExec] = {}

    # -- plumbing ------------------------------------------------------------------------

    async def _enter(self, method: str) -> None:
        self.calls.append(method)
        await trio.lowlevel.checkpoint()
        queued = self._failures.get(method)
        if queued:
            raise queued.pop(0)

    def fail_next(self, method: str, *failures: BaseException) -> None:
        """The next calls of `method` raise `failures`, one each, in order."""
        self._failures.setdefault(method, []).extend(failures)

    def _container(self, container: str) -> FakeContainer:
        found = self.containers.get(container)
        if found is None:
            raise ContainerGone(container)
        return found

    def _exec(self, exec_id: str) -> FakeExec:
        found = self.execs.get(exec_id)
        if found is None or found.container not in self.containers:
            raise ContainerGone(exec_id)
        return found

    def by_pid(self, pid: int) -> FakeContainer | None:
        """The running container whose init is fake pid `pid`."""
        for c in self.containers.values():
            if c.running and c.pid == pid:
                return c
        return None

    def restart(self, container: str) -> None:
        """The container's init is replaced (a restart under the daemon)."""
        self._container(container).boot()

    def running_execs(self) -> list[FakeExec]:
        return [e for e in self.execs.values() if e.running]

    # -- engine-wide -----------------------------------------------------------------------

    async def runtimes(self) -> set[str]:
        await self._enter("runtimes")
        return set(self.registered)

    async def require_runtime(self, runtime: str) -> None:
        """As the real engine's, over `runtimes` (read live: the fake caches nothing)."""
        if runtime not in await self.runtimes():
            raise RuntimeUnavailable(
                f"the engine has no runtime {runtime!r} registered", runtime=runtime
            )

    async def status(self) -> EngineStatus:
        await self._enter("status")
        return EngineStatus(reachable=True, version="fake", runtimes=sorted(self.registered))

    def close(self) -> None:
        """Nothing to release."""

    async def image_id(self, ref: str) -> str:
        await self._enter("image_id")
        if ref not in self.images:
            raise ImageMissing(f"image {ref!r} is not present in the engine", image=ref)
        return self.images[ref]

    # -- containers ------------------------------------------------------------------------

    async def create_container(
        self,
        *,
        image: str,
        command: Sequence[str],
        user: str,
        environment: Mapping[str, str],
        labels: Mapping[str, str],
        working_dir: str,
        name: str,
        host_config: Mapping[str, Any],
    ) -> str:
        await self._enter("create_container")
        if image not in self.images:
            raise ImageMissing(f"image {image!r} is not present in the engine", image=image)
        cid = secrets.token_hex(32)
        self.containers[cid] = FakeContainer(
            id=cid,
            name=name,
            labels=dict(labels),
            request={
                "image": image,
                "command": list(command),
                "user": user,
                "environment": dict(environment),
                "working_dir": working_dir,
                "host_config": dict(host_config),
            },
            image_id=self.images[image],
        )
        return cid

    async def start(self, container: str) -> None:
        await self._enter("start")
        self._container(container).boot()

    async def inspect(self, container: str) -> dict[str, Any]:
        await self._enter("inspect")
        return inspect_of(self._container(container))

    async def remove(self, container: str) -> None:
        await self._enter("remove")
        c = self.containers.pop(container, None)
        if c is None:
            return
        for ex in self.execs.values():
            if ex.container == container:
                ex.vanish()

    async def list_labelled(self, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        await self._enter("list_labelled")
        return [
            {
                "Id": c.id,
                "Names": ["/" + c.name],
                "Labels": dict(c.labels),
                "State": "running" if c.running else "created",
            }
            for c in self.containers.values()
            if all(c.labels.get(k) == v for k, v in labels.items())
        ]

    # -- exec --------------------------------------------------------------------------------

    async def exec_create(
        self,
        container: str,
        argv: Sequence[str],
        *,
        user: str,
        workdir: str,
        environment: Mapping[str, str],
        stdin: bool,
        tty: bool = False,
    ) -> str:
        await self._enter("exec_create")
        if not self._container(container).running:
            raise ContainerGone(container)
        exec_id = secrets.token_hex(32)
        self.execs[exec_id] = FakeExec(
            id=exec_id,
            container=container,
            argv=list(argv),
            user=user,
            workdir=workdir,
            environment=dict(environment),
            stdin=stdin,
            tty=tty,
        )
        return exec_id

    async def exec_start(self, exec_id: str, *, tty: bool = False) -> ExecStream:
        await self._enter("exec_start")
        ex = self._exec(exec_id)
        if not self._container(ex.container).running:
            raise ContainerGone(exec_id)
        ours, theirs = socket.socketpair()
        ex.peer, ex.started, ex.running = theirs, True, True
        self.program(ex)
        return ExecStream(ours, b"")

    async def exec_resize(self, exec_id: str, *, rows: int, cols: int) -> None:
        await self._enter("exec_resize")
        self._exec(exec_id)

    async def exec_inspect(self, exec_id: str) -> dict[str, Any]:
        await self._enter("exec_inspect")
        ex = self._exec(exec_id)
        return {"ID": ex.id, "Running": ex.running, "ExitCode": ex.exit_code, "Pid": ex.pid}


#: mypy proves here that `FakeEngine` has every method of the `Engine` Protocol.
_: type[Engine] = FakeEngine


def inspect_of(c: FakeContainer) -> dict[str, Any]:
    """The engine's inspect dict of a fake container, from its create request."""
    req = c.request
    hc: Mapping[str, Any] = req["host_config"]
    mounts = [
        {
            "Type": "bind",
            "Source": m["Source"],
            "Destination": m["Target"],
            "RW": not m.get("ReadOnly", False),
        }
        for m in hc.get("mounts") or ()
        if m.get("Type") == "bind"
    ]
    memory = hc.get("mem_limit")
    return {
        "Id": c.id,
        "Name": "/" + c.name,
        "Image": c.image_id,
        "State": {"Running": c.running, "Pid": c.pid if c.running else 0},
        "Config": {
            "Image": req["image"],
            "User": req["user"],
            "Env": [f"{k}={v}" for k, v in req["environment"].items()],
            "Labels": dict(c.labels),
            "WorkingDir": req["working_dir"],
        },
        "HostConfig": {
            "Runtime": hc.get("runtime", "runc"),
            "Privileged": bool(hc.get("privileged")),
            "NetworkMode": hc.get("network_mode", "default"),
            "ReadonlyRootfs": bool(hc.get("read_only")),
            "CapDrop": list(hc.get("cap_drop") or ()),
            "CapAdd": list(hc.get("cap_add") or ()),
            "SecurityOpt": list(hc.get("security_opt") or ()),
            "Tmpfs": dict(hc.get("tmpfs") or {}),
            "Memory": profiles.parse_size(memory) if isinstance(memory, str) else memory or 0,
            "NanoCpus": int(hc.get("nano_cpus") or 0),
            "PidsLimit": hc.get("pids_limit"),
        },
        "Mounts": mounts,
    }


def facts_of(
    inspect: Mapping[str, Any],
    readonly_dirs: Sequence[str],
    mounted: bool,
    *,
    home: bool = False,
) -> list[Fact]:
    """The facts an honest engine and kernel show for a container made as `inspect` says
    (pure, apart from the lstat of the bind sources for the workspace identities)."""
    hc: Mapping[str, Any] = inspect["HostConfig"]
    config: Mapping[str, Any] = inspect["Config"]
    security_opt = [str(o) for o in hc["SecurityOpt"]]
    uid, gid = observe.engine_user(str(config["User"]))
    kept = observe.engine_kept_caps(hc)
    binds = {str(m["Destination"]): m for m in inspect["Mounts"]}
    mode, ro_dirs = workspace_view(
        sorted(
            ((d, not m["RW"]) for d, m in binds.items()),
            key=lambda b: b[0].rstrip("/").count("/"),
        ),
        WORKSPACE_TARGET,
    )
    policy = F.seccomp_policy_of(security_opt)
    isolated = hc["NetworkMode"] == "none"
    values: dict[str, FactValue] = {
        "runtime": str(hc["Runtime"]),
        "privileged": bool(hc["Privileged"]),
        "network_mode": str(hc["NetworkMode"]),
        "image_id": str(inspect["Image"]),
        "docker_host_unset": not any(str(e).startswith("DOCKER_HOST=") for e in config["Env"]),
        "docker_socket_absent": observe.engine_socket_absent(inspect),
        "seccomp_policy": policy,
        "memory_limit": int(hc["Memory"]) or None,
        "pids_limit": hc["PidsLimit"],
        "cpu_quota": hc["NanoCpus"] / 1e9 if hc["NanoCpus"] else None,
        "net_links": ["lo"] if isolated else ["eth0", "lo"],
        "net_routes": [] if isolated else ["inet 0.0.0.0/0 via 172.17.0.1 dev eth0 table 254"],
        "no_new_privs": any(o.startswith("no-new-privileges") for o in security_opt),
        "cap_bnd": kept,
        "uid": uid,
        "gid": gid,
        "rootfs_readonly": bool(hc["ReadonlyRootfs"]),
        "workspace_mount": mode,
        "readonly_dirs": ro_dirs,
        "tmpfs": observe.engine_tmpfs(hc),
        "cap_eff": kept if uid == 0 else [],
        "cap_prm": kept if uid == 0 else [],
        "cap_amb": [],
        "seccomp_mode": 0 if policy == "unconfined" else F.SECCOMP_FILTER,
    }
    if hc["Runtime"] == "runsc":
        values |= {
            "sandbox_no_new_privs": True,
            "sandbox_seccomp_mode": F.SECCOMP_FILTER,
            "sandbox_userns": True,
            "sandbox_network": str(hc["NetworkMode"]),
            "sandbox_oci_seccomp": True,
        }
    if mounted:  # the profile mounts a workspace
        values["workspace_identity"] = _identity(binds.get(WORKSPACE_TARGET))
        for rel in readonly_dirs:
            values[f"workspace_identity:{rel}"] = _identity(binds.get(f"{WORKSPACE_TARGET}/{rel}"))
    if home:
        values["home_identity"] = _identity(binds.get(HOME_TARGET))
    return [F.make_fact(n, v, source="fake") for n, v in values.items()]


def _identity(bind: Mapping[str, Any] | None) -> str:
    if bind is None:
        return "absent"
    try:
        st = os.lstat(str(bind["Source"]))
    except OSError:
        return "absent"
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return "not-a-directory-or-file"
    return f"{st.st_dev}:{st.st_ino}"


class FakeHost:
    """The `SandboxHost` of a `FakeEngine`'s containers (see the module doc)."""

    def __init__(self, engine: FakeEngine) -> None:
        self._engine = engine

    def observe(
        self,
        init_pid: int,
        inspect: Mapping[str, Any],
        profile: Profile,
        readonly_dirs: Sequence[str],
        *,
        home: bool = False,
    ) -> list[Fact]:
        if self._engine.by_pid(init_pid) is None:
            raise ProcessLookupError(init_pid)
        return facts_of(inspect, readonly_dirs, profile.workspace != "none", home=home)

    def observe_mounts(
        self, init_pid: int, readonly_dirs: Sequence[str], *, engine_ok: bool
    ) -> list[Fact]:
        found = self._engine.by_pid(init_pid)
        if found is None:
            raise ProcessLookupError(init_pid)
        inspect = inspect_of(found)
        mounted = any(m["Destination"] == WORKSPACE_TARGET for m in inspect["Mounts"])
        kept = (*observe.MOUNT_FACTS, "workspace_identity")
        return [
            f for f in facts_of(inspect, readonly_dirs, mounted) if f.name.split(":", 1)[0] in kept
        ]

    def identity(self, pid: int) -> Hashable | None:
        found = self._engine.by_pid(pid)
        return None if found is None else (found.id, found.generation)

    def cgroups(self, pid: int) -> reaper.CgroupDirs:
        if self._engine.by_pid(pid) is None:
            raise ProcessLookupError(pid)
        return reaper.CgroupDirs(procs=FAKE_CGROUP / str(pid), memory=None, freezer=None, v2=True)

    def children_in(self, cgroups: reaper.CgroupDirs, pid: int) -> set[int]:
        found = self._engine.by_pid(pid)
        return set() if found is None else {found.keepalive}
