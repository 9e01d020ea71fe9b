"""`substrate doctor`: a table of what works on this machine (docs/protocol.md §9).

Each check is a small function returning (ok, detail); none changes anything. The engine
checks use the same blocking client the daemon uses; this runs outside Trio.

A running daemon is asked first (`daemon.info` on its operator socket, `RunningDaemon`):
its own configuration, the profiles it has in force and the engine it sees are checked,
not the defaults. Without one, the checks read `--config` (or the defaults) and say so.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from substrate.config import Config
from substrate.errors import Refusal
from substrate.fs import paths
from substrate.fs.state import StatePaths
from substrate.protocol.client import Client, RpcError, socket_path

Check = tuple[str, bool, str]


@dataclass(frozen=True)
class RunningDaemon:
    """What a running daemon said of itself: `daemon.info`, and each profile's image."""

    info: dict[str, Any]
    images: list[str]


def ask_daemon(state_dir: str | None) -> tuple[RunningDaemon | None, str]:
    """The running daemon's account of itself over its operator socket, or None and why
    not (not running, not ours to ask, or too old to have `daemon.info`)."""
    path = socket_path(state_dir, operator=True)
    try:
        with Client(path, timeout=30) as client:
            info = client.call("daemon.info")
            images = sorted(
                {str(client.call("profile.get", name=p["name"])["image"]) for p in info["profiles"]}
            )
    except OSError as exc:
        return None, f"no daemon answers at {path} ({exc.strerror or exc})"
    except RpcError as exc:
        return None, f"the daemon at {path} did not answer daemon.info ({exc.refusal or exc.code})"
    return RunningDaemon(info, images), f"pid {info['pid']}, substrate {info['version']}"


def _engine_info() -> dict[str, Any] | None:
    from substrate.sandbox.docker_engine import DockerEngine

    engine = DockerEngine()
    try:
        return engine.info_sync()
    except Refusal:
        return None
    finally:
        engine.close()


def _cgroup() -> tuple[bool, str]:
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return True, "v2 (unified)"
    if Path("/sys/fs/cgroup/memory").is_dir():
        return True, "v1 (memory, pids, cpu controllers)"
    return False, "no cgroup hierarchy found"


def _kernel_seccomp() -> tuple[bool, str]:
    status = Path("/proc/self/status").read_text()
    return ("Seccomp:" in status), "kernel reports Seccomp in /proc/<pid>/status"


def _openat2() -> tuple[bool, str]:
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        paths.open_dir(fd, ("tmp",))
    except Refusal:
        pass
    finally:
        os.close(fd)
    works = paths._has_openat2()
    return True, "openat2(RESOLVE_BENEATH) in use" if works else "fallback O_NOFOLLOW walk"


def _socket(path: Path, mode: int) -> tuple[bool, str]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True, "not running (no socket yet)"
    if not stat.S_ISSOCK(st.st_mode):
        return False, "exists but is not a socket"
    actual = stat.S_IMODE(st.st_mode)
    return actual == mode, f"mode {actual:04o} (want {mode:04o})"


def _state_dir(path: Path) -> tuple[bool, str]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True, "not created yet (made 0700 at first start)"
    if stat.S_ISLNK(st.st_mode):
        return False, "is a symlink"
    actual = stat.S_IMODE(st.st_mode)
    return actual == 0o700, f"mode {actual:04o} (want 0700)"


def run_checks(config: Config, running: RunningDaemon | None = None) -> list[Check]:
    """Every check, in the order printed; with `running`, the daemon's profiles, images
    and engine as it reports them."""
    checks: list[Check] = []

    def add(name: str, fn: Callable[[], tuple[bool, str]]) -> None:
        try:
            ok, detail = fn()
        except Exception as exc:  # a check that crashes is a failed check, not a crash
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        checks.append((name, ok, detail))

    info = _engine_info()
    checks.append(
        (
            "engine reachable",
            info is not None,
            f"Docker {info.get('ServerVersion')}"
            if info
            else "no engine answers: scripts/engine-up",
        )
    )
    add("cgroups", _cgroup)
    add("kernel seccomp", _kernel_seccomp)
    if info is not None:
        opts = " ".join(info.get("SecurityOptions") or [])
        checks.append(("engine seccomp", "seccomp" in opts, opts or "none"))
        runtimes = sorted((info.get("Runtimes") or {}).keys())
        checks.append(("gVisor runsc", "runsc" in runtimes, "runtimes: " + ", ".join(runtimes)))
        add("images", lambda: _images(config, running))
    add("openat2", _openat2)
    state = config.state_path()
    add("state dir", lambda: _state_dir(state))
    add("agent socket", lambda: _socket(StatePaths(state).agent_socket, 0o660))
    add("operator socket", lambda: _socket(StatePaths(state).operator_socket, 0o600))
    add("profiles", lambda: _profiles(config, running))
    add("secrets", lambda: _secrets(config))
    if running is not None:
        engine = running.info["engine"]
        checks.append(
            (
                "daemon's engine",
                bool(engine["reachable"]),
                f"Docker {engine.get('version')}" if engine["reachable"] else "not reachable",
            )
        )
    return checks


def _images(config: Config, running: RunningDaemon | None) -> tuple[bool, str]:
    from substrate.sandbox.images import build as imagebuild
    from substrate.sandbox.profiles import load_profiles

    if running is not None:
        wanted = running.images
    else:
        loaded = load_profiles(Path(config.profiles_dir), Path(config.seccomp_dir))
        wanted = sorted({p.image for p in loaded.values()})
    client = imagebuild.engine_client()
    try:
        missing = [tag for tag in wanted if not imagebuild.image_present(client, tag)]
    finally:
        client.close()
    if missing:
        return False, "missing: " + ", ".join(missing) + " (substrate image build --all)"
    return True, "present: " + ", ".join(wanted)


def _profiles(config: Config, running: RunningDaemon | None) -> tuple[bool, str]:
    from substrate.sandbox.profiles import load_profiles

    if running is not None:
        names = [p["name"] for p in running.info["profiles"]]
        return True, f"{config.profiles_dir}: " + (", ".join(names) or "none") + " (in force)"
    loaded = load_profiles(Path(config.profiles_dir), Path(config.seccomp_dir))
    return True, f"{config.profiles_dir}: " + ", ".join(sorted(loaded))


def _secrets(config: Config) -> tuple[bool, str]:
    """Every secret a profile names is set (names only, never a value)."""
    from substrate.sandbox.profiles import load_profiles
    from substrate.secrets import SecretStore

    loaded = load_profiles(Path(config.profiles_dir), Path(config.seccomp_dir))
    have = set(SecretStore(config.state_path()).names())
    missing = sorted(
        f"{name}: {secret}"
        for name, profile in loaded.items()
        for secret in set(profile.secrets.values()) - have
    )
    if missing:
        return False, "not set: " + ", ".join(missing) + " (substrate secret set NAME)"
    return True, f"{len(have)} set; every one the profiles name is"


def render(checks: list[Check]) -> str:
    width = max(len(name) for name, _, _ in checks)
    lines = [f"{'check':<{width}}  ok    detail", f"{'-' * width}  ----  ------"]
    for name, ok, detail in checks:
        lines.append(f"{name:<{width}}  {'yes' if ok else 'NO':<4}  {detail}")
    return "\n".join(lines)
