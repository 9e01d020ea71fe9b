"""The container engine over docker-py: `DockerEngine`, the daemon's only `docker` import.

`DockerEngine` implements `substrate.sandbox.engine.Engine` (that module holds the
contract and its signals; this one the transport; the CLI's offline image builder,
`images.build`, keeps its own client). Theory of operation: every engine
call is a blocking docker-py call made from a Trio worker thread
(`trio.to_thread.run_sync`) under one `CapacityLimiter`, so a slow or hung engine never
blocks the event loop and cannot take every thread. docker-py keys its errors off
message text and is untyped; here they are translated once, by HTTP status code, into
substrate's refusals (`runtime_unavailable`, `image_missing`) or into the two signals
the container layer acts on (`ContainerGone`, `EngineError`). Refusal messages never
quote the engine's explanation, which can name host paths; the explanation goes to the
log instead.

What the engine is never asked to do: pull an image (a missing image is `image_missing`),
mount its own socket anywhere, or pass `DOCKER_HOST` or proxy settings into a container
(`use_config_proxy=False`; a container's environment is exactly what the caller gives).
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

import docker
import docker.errors
import docker.utils
import requests.exceptions
import trio

from substrate.errors import ImageMissing, Internal, Refusal, RuntimeUnavailable
from substrate.sandbox.engine import ContainerGone, Engine, EngineError, ExecStream
from substrate.schema.journal import EngineStatus

# The name the engine's log lines have always carried, whichever module makes them.
log = logging.getLogger("substrate.sandbox.engine")

T = TypeVar("T")

#: The engine API version we speak (dockerd 20.10 = 1.41); newer engines accept it.
API_VERSION = "1.41"
#: Seconds an ordinary engine call may take before the engine counts as unavailable.
CALL_TIMEOUT_S = 60.0


def _status(exc: docker.errors.APIError) -> int | None:
    code = exc.status_code
    return int(code) if code is not None else None


@contextmanager
def map_exceptions(
    what: str, on_status: Mapping[int, Callable[[], Exception]] | None = None
) -> Iterator[None]:
    """Translate docker-py / requests errors raised in the block, by status code.

    `on_status` maps an HTTP status to the exception to raise instead; other API errors
    become `EngineError`; a failed connection or timeout is `runtime_unavailable`.
    """
    try:
        yield
    except docker.errors.APIError as exc:
        status = _status(exc)
        log.info("engine: %s: %s %s", what, status, exc.explanation)
        factory = (on_status or {}).get(status or 0)
        if factory is not None:
            raise factory() from None
        raise EngineError(status, str(exc.explanation or "")) from None
    except (requests.exceptions.RequestException, docker.errors.DockerException, OSError) as exc:
        log.warning("engine: %s: unreachable: %s", what, exc)
        raise RuntimeUnavailable(f"the container engine does not answer ({what})") from None


class DockerEngine:
    """`Engine` over one `docker.APIClient`, created lazily on first use.

    `base_url` defaults to the environment (`DOCKER_HOST`, else the local socket). All
    methods may raise `runtime_unavailable` when the engine does not answer.
    """

    def __init__(self, base_url: str | None = None, *, threads: int = 32) -> None:
        self._base_url = base_url
        self._threads = threads
        self.limiter = trio.CapacityLimiter(threads)
        self._client: docker.APIClient | None = None
        self._client_lock = threading.Lock()
        self._info: dict[str, Any] | None = None

    # -- plumbing ------------------------------------------------------------------------

    def client(self) -> docker.APIClient:
        """The docker-py client (blocking; call from a worker thread)."""
        with self._client_lock:
            if self._client is None:
                kwargs: dict[str, Any] = docker.utils.kwargs_from_env()
                if self._base_url is not None:
                    kwargs["base_url"] = self._base_url
                with map_exceptions("connect"):
                    self._client = docker.APIClient(
                        version=API_VERSION,
                        timeout=int(CALL_TIMEOUT_S),
                        # One pooled connection per worker thread, so no call waits for
                        # (or discards) a connection.
                        max_pool_size=self._threads,
                        **kwargs,
                    )
            return self._client

    async def call(self, fn: Callable[[], T]) -> T:
        """Run a blocking engine call in a worker thread under the engine's limiter."""
        return await trio.to_thread.run_sync(fn, limiter=self.limiter)

    def close(self) -> None:
        """Close the docker-py client; the next call connects again."""
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    # -- engine-wide -----------------------------------------------------------------------

    def info_sync(self) -> dict[str, Any]:
        """`docker info` (blocking). Not part of `Engine`: only `doctor`, which builds its
        own `DockerEngine`, reads the engine's security options and server version."""
        with map_exceptions("info"):
            info: dict[str, Any] = self.client().info()
        self._info = info
        return info

    async def runtimes(self) -> set[str]:
        """Names of the OCI runtimes the engine has registered (cached after the first call)."""
        info = self._info if self._info is not None else await self.call(self.info_sync)
        return set((info.get("Runtimes") or {}).keys())

    async def require_runtime(self, runtime: str) -> None:
        """Refuse `runtime_unavailable` unless the engine has `runtime` registered."""
        found = await self.runtimes()
        if runtime not in found:
            # Re-read once: the operator may have registered it since we cached.
            self._info = None
            found = await self.runtimes()
        if runtime not in found:
            raise RuntimeUnavailable(
                f"the engine has no runtime {runtime!r} registered", runtime=runtime
            )

    async def status(self) -> EngineStatus:
        """Reachability, version and runtimes, for `daemon.status` and `doctor`."""

        def run() -> EngineStatus:
            with map_exceptions("version"):
                version = self.client().version()
            info = self.info_sync()
            return EngineStatus(
                reachable=True,
                version=str(version.get("Version") or "") or None,
                runtimes=sorted((info.get("Runtimes") or {}).keys()),
            )

        try:
            return await self.call(run)
        except Refusal:
            return EngineStatus(reachable=False)

    # -- images ----------------------------------------------------------------------------

    async def image_id(self, ref: str) -> str:
        """The local image id of `ref`. Refuses `image_missing` (nothing is ever pulled)."""

        def run() -> str:
            missing = functools.partial(
                ImageMissing, f"image {ref!r} is not present in the engine", image=ref
            )
            with map_exceptions("inspect image", {404: missing}):
                return str(self.client().inspect_image(ref)["Id"])

        return await self.call(run)

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
        """Create (not start) a container; return its full id.

        Refuses `image_missing` (404), `runtime_unavailable`; other engine errors raise
        `EngineError`. Costs one engine round trip (tens of milliseconds).
        """

        def run() -> str:
            client = self.client()
            missing = functools.partial(
                ImageMissing, f"image {image!r} is not present in the engine", image=image
            )
            with map_exceptions("create container", {404: missing}):
                created = client.create_container(
                    image=image,
                    command=list(command),
                    user=user,
                    environment=dict(environment),
                    labels=dict(labels),
                    working_dir=working_dir,
                    name=name,
                    network_disabled=False,
                    use_config_proxy=False,
                    host_config=client.create_host_config(**host_config),
                )
            return str(created["Id"])

        return await self.call(run)

    async def start(self, container: str) -> None:
        """Start a created container. An engine failure here is `runtime_unavailable`."""

        def run() -> None:
            gone = functools.partial(ContainerGone, container)
            with map_exceptions("start container", {404: gone}):
                self.client().start(container)

        try:
            await self.call(run)
        except EngineError as exc:
            # The runtime could not start it (a broken runsc, a bad seccomp document):
            # the environment's fault, not the caller's.
            raise RuntimeUnavailable(
                f"the engine could not start the sandbox (status {exc.status})"
            ) from None

    async def inspect(self, container: str) -> dict[str, Any]:
        """`docker inspect` of a container. Raises `ContainerGone` when it does not exist."""

        def run() -> dict[str, Any]:
            gone = functools.partial(ContainerGone, container)
            with map_exceptions("inspect container", {404: gone}):
                found: dict[str, Any] = self.client().inspect_container(container)
                return found

        return await self.call(run)

    async def remove(self, container: str) -> None:
        """Force-remove a container and its anonymous volumes; absent already is fine."""

        def run() -> None:
            with map_exceptions("remove container", {404: lambda: ContainerGone(container)}):
                self.client().remove_container(container, v=True, force=True)

        try:
            await self.call(run)
        except ContainerGone:
            pass
        except EngineError as exc:
            if exc.status != 409:  # 409: removal already in progress
                raise

    async def list_labelled(self, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Every container (running or not) carrying all of `labels`."""

        def run() -> list[dict[str, Any]]:
            wanted = [f"{k}={v}" for k, v in labels.items()]
            with map_exceptions("list containers"):
                found: list[dict[str, Any]] = self.client().containers(
                    all=True, filters={"label": wanted}
                )
                return found

        return await self.call(run)

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
        """Create an exec of exactly `argv` (no shell); return its id.

        With `tty` the exec gets a pseudo-terminal and its stream is raw (not multiplexed).
        Raises `ContainerGone` when the container is gone or not running.
        """

        def run() -> str:
            gone = functools.partial(ContainerGone, container)
            with map_exceptions("exec create", {404: gone, 409: gone}):
                created = self.client().exec_create(
                    container,
                    list(argv),
                    stdout=True,
                    stderr=True,
                    stdin=stdin,
                    tty=tty,
                    privileged=False,
                    user=user,
                    environment=[f"{k}={v}" for k, v in environment.items()],
                    workdir=workdir,
                )
            return str(created["Id"])

        return await self.call(run)

    async def exec_start(self, exec_id: str, *, tty: bool = False) -> ExecStream:
        """Start an exec; return its stream (blocking socket), multiplexed unless `tty`.

        The caller owns the stream: read it to EOF (see `substrate.process.stream.Demuxer`), write stdin and
        `shutdown(SHUT_WR)` to close the process's stdin, then `close()` it. Raises
        `ContainerGone` when the exec's container is gone or stopped.
        """
        return await self.call(lambda: self._exec_start_sync(exec_id, tty))

    def _exec_start_sync(self, exec_id: str, tty: bool) -> ExecStream:
        path = self._unix_path()
        if path is None:
            gone = functools.partial(ContainerGone, exec_id)
            with map_exceptions("exec start", {404: gone, 409: gone}):
                raw = self.client().exec_start(exec_id, socket=True, tty=tty)
            return ExecStream(_unwrap_socket(raw), b"")
        # Over the Unix socket the upgrade is done by hand: docker-py reads the response
        # headers through a buffered reader, which can swallow the first output bytes
        # when they arrive with the headers; here they are kept (`initial`).
        body = json.dumps({"Detach": False, "Tty": tty}).encode()
        request = (
            f"POST /v{API_VERSION}/exec/{exec_id}/start HTTP/1.1\r\n"
            "Host: docker\r\nContent-Type: application/json\r\n"
            "Connection: Upgrade\r\nUpgrade: tcp\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CALL_TIMEOUT_S)
            sock.connect(path)
            sock.sendall(request)
            status, rest = _read_response_head(sock)
            if status in (404, 409):
                raise ContainerGone(exec_id)
            if status not in (101, 200):
                raise EngineError(status, "exec start refused")
            sock.settimeout(None)
            return ExecStream(sock, rest)
        except OSError as exc:
            sock.close()
            log.warning("engine: exec start: unreachable: %s", exc)
            raise RuntimeUnavailable("the container engine does not answer (exec start)") from None
        except BaseException:
            sock.close()
            raise

    def _unix_path(self) -> str | None:
        base = self._base_url or docker.utils.kwargs_from_env().get("base_url")
        base = base or "unix:///var/run/docker.sock"
        for prefix in ("unix://", "http+unix://"):
            if base.startswith(prefix):
                return str(base[len(prefix) :])
        return None

    async def exec_resize(self, exec_id: str, *, rows: int, cols: int) -> None:
        """Set the terminal size of a TTY exec (the process gets SIGWINCH)."""

        def run() -> None:
            gone = functools.partial(ContainerGone, exec_id)
            with map_exceptions("exec resize", {404: gone, 409: gone}):
                self.client().exec_resize(exec_id, height=rows, width=cols)

        await self.call(run)

    async def exec_inspect(self, exec_id: str) -> dict[str, Any]:
        """`Running`, `ExitCode` and host `Pid` of an exec."""

        def run() -> dict[str, Any]:
            gone = functools.partial(ContainerGone, exec_id)
            with map_exceptions("exec inspect", {404: gone}):
                found: dict[str, Any] = self.client().exec_inspect(exec_id)
                return found

        return await self.call(run)


#: Largest response head accepted when upgrading an exec stream.
MAX_HEAD_BYTES = 64 << 10


def _read_response_head(sock: socket.socket) -> tuple[int, bytes]:
    """Read an HTTP response head; return (status, bytes received after it)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        if len(buf) > MAX_HEAD_BYTES:
            raise EngineError(None, "response head too large")
        chunk = sock.recv(4096)
        if not chunk:
            raise EngineError(None, "connection closed before the response")
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    status_line = head.split(b"\r\n", 1)[0].split()
    try:
        status = int(status_line[1])
    except (IndexError, ValueError):
        raise EngineError(None, "malformed response") from None
    return status, rest


def _unwrap_socket(raw: object) -> socket.socket:
    """docker-py returns a `socket.SocketIO` over the hijacked connection or the socket
    itself (TLS); substrate needs the socket for `recv` and `shutdown`."""
    sock = getattr(raw, "_sock", raw)
    if not isinstance(sock, socket.socket):
        unsupported(f"an exec stream of type {type(raw).__name__}")
    if sock is not raw:
        # Drop the SocketIO's reference, or closing the socket later leaves its fd open.
        raw.close()  # type: ignore[attr-defined]
    return sock


def unsupported(what: str) -> NoReturn:
    raise Internal(f"unsupported engine transport: {what}")


#: mypy proves here that `DockerEngine` has every method of the `Engine` Protocol.
_: type[Engine] = DockerEngine
