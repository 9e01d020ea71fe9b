"""Confinement facts observed from real containers (runc and runsc) and compared with what
a profile requires: a confined container meets every fact; a weaker one is caught, each
weakening named. No packet is sent anywhere: the network namespace is only dumped."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from substrate.sandbox import facts as F
from substrate.sandbox import observe, observe_gvisor, profiles
from substrate.sandbox.profiles import Profile
from tests.harness import wait_until

ROOT = Path(__file__).resolve().parents[2]

# The confinement the tests ask the engine for, and the profile that requires it.
# runsc's Sentry and its per-process stubs are host tasks in the container's pids cgroup
# (about 70 for an idle sandbox, about 9 more per sandboxed process): a small pids limit
# kills the sandbox itself, so the runsc container gets a larger one.
MEMORY = "256m"
PIDS = {"runc": 128, "runsc": 1024}
CPUS = 1.5
PROFILE_TMPFS = {"/tmp": "64m"}


def profile_for(runtime: str) -> Profile:
    return Profile(
        runtime="runsc" if runtime == "runsc" else "runc",
        image="substrate-tiny:latest",
        memory=MEMORY,
        pids=PIDS[runtime],
        cpus=CPUS,
        tmpfs=PROFILE_TMPFS,
        seccomp="engine-default",
    )


def required_for(runtime: str, image_id: str, *, seccomp_expected: bool = False) -> dict[str, Any]:
    return F.required_facts(
        profile_for(runtime),
        run_uid=1000,
        run_gid=1000,
        workspace_mode="rw",
        readonly_dirs=[".git"],
        seccomp_expected=seccomp_expected,
        image_id=image_id,
    )


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    (ws / ".git").mkdir(parents=True)
    (ws / "README").write_text("hello\n")
    for path in (ws, ws / ".git", ws / "README"):
        os.chown(path, 1000, 1000)
    return ws


class Containers:
    """Starts containers with the session's test labels; removes them at teardown."""

    def __init__(self, client: Any, image: str, labels: dict[str, str]) -> None:
        self.client, self.image, self.labels = client, image, labels
        self.made: list[Any] = []

    def start(self, **kw: Any) -> tuple[int, dict[str, Any]]:
        """Run `sleep` with `kw` as the engine's options; (host pid, inspect dict)."""
        container = self.client.containers.run(
            self.image, ["sleep", "600"], detach=True, labels=self.labels, **kw
        )
        self.made.append(container)
        inspect = self.client.api.inspect_container(container.id)
        assert inspect["State"]["Running"], inspect["State"]
        return int(inspect["State"]["Pid"]), inspect

    def confined(self, workspace: Path, runtime: str) -> tuple[int, dict[str, Any]]:
        return self.start(
            runtime=runtime,
            read_only=True,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],  # and the engine's default seccomp
            network_mode="none",
            mem_limit=MEMORY,
            memswap_limit=MEMORY,
            pids_limit=PIDS[runtime],
            nano_cpus=int(CPUS * 1e9),
            user="1000:1000",
            tmpfs={"/tmp": "rw,nosuid,nodev,size=64m"},
            volumes={
                str(workspace): {"bind": "/workspace", "mode": "rw"},
                str(workspace / ".git"): {"bind": "/workspace/.git", "mode": "ro"},
            },
        )

    def remove_all(self) -> None:
        for container in self.made:
            container.remove(force=True, v=True)


@pytest.fixture
def containers(
    docker_client: Any, tiny_image: str, test_labels: dict[str, str]
) -> Iterator[Containers]:
    made = Containers(docker_client, tiny_image, {**test_labels, "substrate.test.facts": "1"})
    try:
        yield made
    finally:
        made.remove_all()


def by_name(found: list[F.Fact]) -> dict[str, F.Fact]:
    return {f.name: f for f in found}


def test_confined_runc_container_meets_every_fact(containers: Containers, workspace: Path) -> None:
    pid, inspect = containers.confined(workspace, "runc")
    found = observe.observe(pid, inspect)
    assert F.compare(required_for("runc", inspect["Image"]), found) == []
    facts = by_name(found)
    # Each fact from the source that can show it best.
    # Sources name the kind and a stable id, never a host path or pid.
    assert facts["cap_bnd"].source == "kernel:proc-status"
    assert facts["readonly_dirs"].source == "kernel:mountinfo"
    assert facts["memory_limit"].source in ("cgroup:memory.max", "cgroup:memory.limit_in_bytes")
    assert facts["net_routes"].source == "netns:rtnetlink"
    assert facts["image_id"].source == "engine:inspect"
    assert all("/" not in f.source for f in found)
    assert all(f.observed_at > 0 for f in found)


def test_exec_pid_is_observed_like_the_init(
    docker_client: Any, containers: Containers, workspace: Path
) -> None:
    pid, inspect = containers.confined(workspace, "runc")
    exec_id = docker_client.api.exec_create(inspect["Id"], ["sleep", "600"], user="1000:1000")["Id"]
    docker_client.api.exec_start(exec_id, detach=True)
    # The engine reports the pid once the exec has started.
    exec_pid = wait_until(lambda: int(docker_client.api.exec_inspect(exec_id)["Pid"] or 0), 30)
    assert exec_pid and exec_pid != pid
    assert (
        F.compare(required_for("runc", inspect["Image"]), observe.observe(exec_pid, inspect)) == []
    )


def test_engine_default_seccomp_is_not_strict(containers: Containers, workspace: Path) -> None:
    # Both show "Seccomp: 2" in the kernel; only the engine can say which policy it is.
    strict = Profile(runtime="runc", seccomp="strict")
    opts = profiles.security_opts(strict, ROOT / "seccomp")
    required = F.required_facts(
        strict,
        run_uid=1000,
        run_gid=1000,
        workspace_mode="rw",
        readonly_dirs=[],
        seccomp_expected=True,
        security_opt=opts,
    )
    pid, inspect = containers.start(runtime="runc", security_opt=opts, user="1000:1000")
    facts = by_name(observe.observe(pid, inspect))
    assert facts["seccomp_policy"].value == required["seccomp_policy"]
    assert facts["seccomp_mode"].value == 2

    pid, inspect = containers.start(
        runtime="runc", security_opt=["no-new-privileges"], user="1000:1000"
    )
    found = observe.observe(pid, inspect)
    assert by_name(found)["seccomp_mode"].value == 2
    mismatch = next(m for m in F.compare(required, found) if m.name == "seccomp_policy")
    assert mismatch.observed == "engine-default"


def test_weaker_runc_container_is_caught(containers: Containers, workspace: Path) -> None:
    # Writable root, an extra capability, no no-new-privileges, the default bridge
    # network (eth0 and a default route: only dumped, nothing sent), no limits, root.
    pid, inspect = containers.start(
        runtime="runc",
        cap_drop=["ALL"],
        cap_add=["NET_ADMIN"],
        user="0:0",
        volumes={str(workspace): {"bind": "/workspace", "mode": "rw"}},
    )
    mismatches = {
        m.name: m
        for m in F.compare(required_for("runc", inspect["Image"]), observe.observe(pid, inspect))
    }
    assert set(mismatches) == {
        "network_mode",
        "memory_limit",
        "pids_limit",
        "cpu_quota",
        "net_links",
        "net_routes",
        "no_new_privs",
        "cap_bnd",
        "cap_eff",
        "cap_prm",
        "uid",
        "gid",
        "rootfs_readonly",
        "readonly_dirs",
        "tmpfs",
    }
    assert mismatches["cap_bnd"].observed == ["NET_ADMIN"]
    assert mismatches["rootfs_readonly"].observed is False
    assert mismatches["net_links"].observed == ["eth0", "lo"]
    routes = mismatches["net_routes"].observed
    assert isinstance(routes, list) and any(r.startswith("inet 0.0.0.0/0 via ") for r in routes)
    assert mismatches["memory_limit"].observed is None  # no limit at all


def test_confined_runsc_container(
    docker_client: Any, containers: Containers, workspace: Path
) -> None:
    if "runsc" not in docker_client.info().get("Runtimes", {}):
        pytest.fail("runtime runsc is not registered with the engine (scripts/engine-up)")
    pid, inspect = containers.confined(workspace, "runsc")
    found = observe.observe(pid, inspect)
    assert F.compare(required_for("runsc", inspect["Image"]), found) == []
    facts = by_name(found)
    # The host pid is the Sentry: its own credentials are shown as sandbox_* facts, the
    # command's come from the engine.
    assert facts["sandbox_uid"].value != 1000
    assert facts["sandbox_seccomp_mode"].source == "kernel:proc-status"
    assert facts["uid"].source == "engine:inspect"
    assert facts["sandbox_network"].source == "kernel:proc-cmdline"
    # The gofer opens the container's files on the host: its root is the container's,
    # read-only in the host kernel, with the workspace in it (the Sentry's root is empty).
    gofer = observe_gvisor.gofer_pid(pid)
    assert gofer is not None and gofer != pid
    assert facts["rootfs_readonly"].source == "kernel:gofer-mountinfo"
    seen = os.stat(f"/proc/{gofer}/root/workspace/.git")
    real = os.stat(workspace / ".git")
    assert (seen.st_dev, seen.st_ino) == (real.st_dev, real.st_ino)
    assert not os.path.exists(f"/proc/{pid}/root/workspace")
    # Whether the command gets the OCI seccomp filter is runsc's registration.
    args = docker_client.info()["Runtimes"]["runsc"].get("runtimeArgs") or []
    assert facts["sandbox_oci_seccomp"].value == ("--oci-seccomp" in args)
    strict = F.compare(required_for("runsc", inspect["Image"], seccomp_expected=True), found)
    assert [m.name for m in strict] == ([] if "--oci-seccomp" in args else ["sandbox_oci_seccomp"])


def test_weaker_runsc_container_is_caught(
    docker_client: Any, containers: Containers, workspace: Path
) -> None:
    if "runsc" not in docker_client.info().get("Runtimes", {}):
        pytest.fail("runtime runsc is not registered with the engine (scripts/engine-up)")
    pid, inspect = containers.start(
        runtime="runsc",
        cap_drop=["ALL"],
        cap_add=["NET_ADMIN"],
        user="1000:1000",
        pids_limit=PIDS["runsc"],
        volumes={str(workspace): {"bind": "/workspace", "mode": "rw"}},
    )
    names = {
        m.name
        for m in F.compare(required_for("runsc", inspect["Image"]), observe.observe(pid, inspect))
    }
    assert {"cap_bnd", "rootfs_readonly", "no_new_privs", "network_mode", "memory_limit"} <= names
    assert {"readonly_dirs", "tmpfs", "cpu_quota"} <= names


async def test_observe_from_a_trio_worker_thread_leaves_no_trace(
    containers: Containers, workspace: Path
) -> None:
    pid, inspect = containers.confined(workspace, "runc")
    home = os.readlink("/proc/thread-self/ns/net")
    fds = len(os.listdir("/proc/self/fd"))
    threads = threading.active_count()
    for _ in range(3):
        found = await trio.to_thread.run_sync(observe.observe, pid, inspect)
        assert by_name(found)["net_links"].value == ["lo"]
        # The worker thread (reused by trio) is back in the daemon's namespace.
        assert await trio.to_thread.run_sync(os.readlink, "/proc/thread-self/ns/net") == home
    assert os.readlink("/proc/thread-self/ns/net") == home
    assert len(os.listdir("/proc/self/fd")) == fds
    assert threading.active_count() <= threads + 1  # trio's idle worker may linger


def test_no_gofer_for_a_runc_container(containers: Containers, workspace: Path) -> None:
    pid, _ = containers.confined(workspace, "runc")
    assert observe_gvisor.gofer_pid(pid) is None


def test_observe_a_missing_process() -> None:
    with open("/proc/sys/kernel/pid_max") as f:
        beyond = int(f.read()) + 1
    with pytest.raises(ProcessLookupError):
        observe.observe(beyond, {})
