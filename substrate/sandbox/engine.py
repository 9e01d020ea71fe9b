"""What substrate asks of a container engine: the `Engine` Protocol and its two signals.

Everything above the engine (`containers`, `supervisor`, `substrate.process`,
`substrate.pty`, the daemon) is typed against `Engine`, the exact set of calls it makes,
and never against an implementation. Two implement it: `docker_engine.DockerEngine`,
the real one over docker-py (the only module of the daemon importing `docker`), and
`fake_engine.FakeEngine`, in memory, for tests of logic. Neither is imported here.

The contract every implementation keeps: an engine that does not answer is
`runtime_unavailable` (from any method); a container or exec that was removed or
stopped under the caller is `ContainerGone`, which the container layer acts on by
dropping and recreating; anything else the engine refuses, in a way no refusal names,
is `EngineError`. Nothing is ever pulled (a missing image is `image_missing`), and a
container's environment is exactly what the caller gives.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from substrate.schema.journal import EngineStatus

__all__ = ["ContainerGone", "Engine", "EngineError", "ExecStream"]


class ContainerGone(Exception):
    """The container was removed or stopped under us (404/409): drop it and recreate."""


class EngineError(Exception):
    """The engine refused a request in a way no refusal names; `status` is its HTTP code."""

    def __init__(self, status: int | None, explanation: str) -> None:
        super().__init__(f"engine error {status}: {explanation}")
        self.status = status
        self.explanation = explanation


@dataclass
class ExecStream:
    """A started exec's raw stream: the socket, and bytes already read past the headers."""

    sock: socket.socket
    initial: bytes


class Engine(Protocol):
    """The container engine as substrate calls it. Every method may refuse
    `runtime_unavailable` when the engine does not answer."""

    # -- engine-wide -----------------------------------------------------------------------

    async def require_runtime(self, runtime: str) -> None:
        """Refuse `runtime_unavailable` unless the engine has `runtime` registered."""

    async def status(self) -> EngineStatus:
        """Reachability, version and runtimes, for `daemon.status`; never refuses."""

    def close(self) -> None:
        """Release the connection to the engine (the daemon's way out); idempotent."""

    # -- images ----------------------------------------------------------------------------

    async def image_id(self, ref: str) -> str:
        """The local image id of `ref`. Refuses `image_missing` (nothing is ever pulled)."""

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
        """Create (not start) a container from `spec.container_spec`'s request; return its
        full id. Refuses `image_missing`; other engine errors raise `EngineError`."""

    async def start(self, container: str) -> None:
        """Start a created container. Raises `ContainerGone` when it does not exist; an
        engine that cannot start it is `runtime_unavailable`."""

    async def inspect(self, container: str) -> dict[str, Any]:
        """The engine's inspect dict of a container (`State`, `Config`, `HostConfig`,
        `Mounts`, `Image`). Raises `ContainerGone` when it does not exist."""

    async def remove(self, container: str) -> None:
        """Force-remove a container and its anonymous volumes; absent already is fine."""

    async def list_labelled(self, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Every container (running or not) carrying all of `labels`: `Id`, `Names`,
        `Labels`, `State`."""

    # -- exec ------------------------------------------------------------------------------

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
        """Create an exec of exactly `argv` (no shell); return its id.

        With `tty` the exec gets a pseudo-terminal and its stream is raw (not multiplexed).
        Raises `ContainerGone` when the container is gone or not running.
        """

    async def exec_start(self, exec_id: str, *, tty: bool = False) -> ExecStream:
        """Start an exec; return its stream (blocking socket), multiplexed unless `tty`.

        The caller owns the stream: read it to EOF (see `substrate.process.stream.Demuxer`), write stdin and
        `shutdown(SHUT_WR)` to close the process's stdin, then `close()` it. Raises
        `ContainerGone` when the exec's container is gone or stopped.
        """

    async def exec_resize(self, exec_id: str, *, rows: int, cols: int) -> None:
        """Set the terminal size of a TTY exec (the process gets SIGWINCH). Raises
        `ContainerGone` when the exec's container is gone."""

    async def exec_inspect(self, exec_id: str) -> dict[str, Any]:
        """`Running`, `ExitCode` and host `Pid` of an exec. Raises `ContainerGone` when
        the exec's container is gone."""
