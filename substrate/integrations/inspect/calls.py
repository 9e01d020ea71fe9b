"""The blocking calls the Inspect provider makes to the daemon, each on its own connection.

Every function here blocks (the synchronous `substrate.protocol.client.Client`); the
provider runs them in worker threads. A connection per call lets Inspect's concurrent
tool calls overlap on the daemon, which serves each connection on its own. Refusals are
translated to the exceptions Inspect's callers expect in one place, `map_refusal`.
"""

from __future__ import annotations

import base64
import errno
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from inspect_ai.util import OutputLimitExceededError
from inspect_ai.util._sandbox.environment import SandboxUnavailableError

from substrate.protocol.client import (
    DEFAULT_MAX_REQUEST_BYTES,
    Client,
    ConnectionLost,
    RpcError,
    socket_path,
)

#: Bytes per `fs.read` / `artifact.read` (the daemon's bound on one artifact read).
READ_BYTES = 1 << 20
#: Bytes per `proc.write` (its bound is 256 KiB decoded).
STDIN_CHUNK = 192 << 10
#: stdin at most this big goes with `proc.run`; more is streamed (`proc.write`).
INLINE_STDIN_BYTES = 256 << 10
#: The daemon's argv caps (docs/protocol.md §1, named refusals: `argv_denied`), items and
#: bytes (each argument's UTF-8 and its NUL). An argv past either, or a request line past
#: `max_request_bytes`, is not sent: the provider stages it (commands.py).
MAX_ARGV_ITEMS = 4096
MAX_ARGV_BYTES = 1 << 20
#: What a request line holds besides its params (`jsonrpc`, `id`, `method`), at most.
ENVELOPE_BYTES = 96
#: Refusals that say the sandbox cannot run at all (Inspect's `SandboxUnavailableError`).
UNAVAILABLE = frozenset(
    {"runtime_unavailable", "image_missing", "confinement_unmet", "unknown_workspace"}
)
#: Refusals of a path the sample may not touch.
DENIED = frozenset({"path_denied", "symlink_refused", "path_escape", "unauthorized"})


def map_refusal(exc: RpcError, file: str | None = None) -> Exception:
    """The exception an Inspect caller expects for a refusal (or the `RpcError` itself)."""
    refusal = exc.refusal
    if refusal in UNAVAILABLE:
        return SandboxUnavailableError(f"substrate: {exc}")
    if file is not None:
        if refusal == "not_found":
            return FileNotFoundError(errno.ENOENT, "No such file or directory", file)
        if refusal == "not_a_file":
            return IsADirectoryError(errno.EISDIR, "Is a directory", file)
        if refusal in DENIED:
            return PermissionError(errno.EACCES, f"Permission denied ({refusal})", file)
    return exc


@dataclass(frozen=True)
class Daemon:
    """One daemon's agent socket and its request line limit."""

    socket: Path
    max_request_bytes: int
    adopt_roots: tuple[str, ...]

    @classmethod
    def open(cls, state_dir: str | None, adopt_root: str | None = None) -> Daemon:
        """The daemon of `state_dir` (None: `$SUBSTRATE_STATE_DIR`, else the default);
        `SandboxUnavailableError` when nothing answers there.

        Its adopt roots and line limit come from `daemon.info`, an operator method: asked
        on the operator socket when this process may connect to it (the daemon's own
        user, root). Otherwise the agent socket is asked `daemon.status`, the roots are
        `adopt_root` (or `$SUBSTRATE_ADOPT_ROOT`) and the limit the daemon's default."""
        agent = socket_path(state_dir)
        try:
            with Client(socket_path(state_dir, operator=True), timeout=60) as client:
                info = client.call("daemon.info")
        except (OSError, ConnectionLost, RpcError):
            info = None
        if info is None:
            try:
                with Client(agent, timeout=60) as client:
                    client.call("daemon.status")
            except (OSError, ConnectionLost) as exc:
                raise SandboxUnavailableError(
                    f"no substrate daemon answers at {agent}: {exc}"
                ) from exc
            root = adopt_root or os.environ.get("SUBSTRATE_ADOPT_ROOT")
            roots: tuple[str, ...] = (root,) if root else ()
            return cls(socket=agent, max_request_bytes=DEFAULT_MAX_REQUEST_BYTES, adopt_roots=roots)
        config = info.get("config", {})
        limit = int(config.get("max_request_bytes", DEFAULT_MAX_REQUEST_BYTES))
        found = tuple(str(root) for root in config.get("adopt_roots", []))
        return cls(socket=agent, max_request_bytes=limit, adopt_roots=found)

    def call(self, method: str, **params: Any) -> Any:
        """One call on a connection of its own; a lost connection is `SandboxUnavailableError`."""
        try:
            with Client(self.socket, timeout=None, max_request_bytes=self.max_request_bytes) as c:
                return c.call(method, **params)
        except (OSError, ConnectionLost) as exc:
            raise SandboxUnavailableError(f"substrate daemon: {exc}") from exc

    # -- commands ----------------------------------------------------------------------

    def fits(self, params: dict[str, Any]) -> bool:
        """Whether one request line of the daemon carries `params`."""
        return len(msgspec.json.encode(params)) + ENVELOPE_BYTES <= self.max_request_bytes

    def carries(
        self, workspace: str, profile: str, argv: list[str], *, cwd: str, timeout: int | None
    ) -> bool:
        """Whether one `proc.start` carries `argv` (stdin streamed): within the daemon's
        argv caps and its request line limit. Cost: one pass over the argv."""
        if len(argv) > MAX_ARGV_ITEMS:
            return False
        if sum(len(arg.encode("utf-8", "surrogatepass")) + 1 for arg in argv) > MAX_ARGV_BYTES:
            return False
        return self.fits(_params(workspace, profile, argv, cwd, timeout) | {"stdin": "stream"})

    def run(
        self,
        workspace: str,
        profile: str,
        argv: list[str],
        *,
        cwd: str,
        stdin: bytes | None,
        timeout: int | None,
    ) -> dict[str, Any]:
        """Run `argv` to its end; the `proc.run` result. Stdin is streamed when big, or
        when it would not fit the request line with `argv`."""
        params = _params(workspace, profile, argv, cwd, timeout)
        if stdin is None:
            result: dict[str, Any] = self.call("proc.run", **params)
            return result
        if len(stdin) <= INLINE_STDIN_BYTES:
            inline = params | {"stdin_b64": base64.b64encode(stdin).decode("ascii")}
            if self.fits(inline):
                result = self.call("proc.run", **inline)
                return result
        proc = self.call("proc.start", stdin="stream", **params)["proc"]
        view = memoryview(stdin)
        try:
            for start in range(0, len(view), STDIN_CHUNK):
                chunk = base64.b64encode(view[start : start + STDIN_CHUNK]).decode("ascii")
                self.call("proc.write", proc=proc, data_b64=chunk)
            self.call("proc.write", proc=proc, eof=True)
        except RpcError as exc:
            if exc.refusal != "stdin_closed":  # the command stopped reading: its result tells
                raise
        waited: dict[str, Any] = self.call("proc.wait", proc=proc)
        return waited

    def output(self, ref: dict[str, Any], limit: int, limit_str: str) -> bytes:
        """The bytes of one output stream of a result (inline, or read from its artifact);
        `OutputLimitExceededError` past `limit` bytes."""
        if int(ref.get("bytes", 0)) > limit:
            raise OutputLimitExceededError(limit_str, truncated_output=ref.get("preview_tail"))
        inline = ref.get("inline")
        if inline is not None:
            return _decoded(str(inline), ref.get("encoding"))
        artifact = ref.get("artifact")
        if artifact is None:
            return b""
        out = io.BytesIO()
        while True:
            piece = self.call(
                "artifact.read", artifact=artifact, offset=out.tell(), length=READ_BYTES
            )
            out.write(_decoded(piece["data"], piece.get("encoding")))
            if piece.get("eof") or not piece["data"]:
                return out.getvalue()

    # -- files in the checkout ----------------------------------------------------------

    def stat(self, workspace: str, path: str, file: str) -> dict[str, Any]:
        """`fs.stat` with the digest; refusals as Inspect's file exceptions."""
        try:
            result: dict[str, Any] = self.call("fs.stat", workspace=workspace, path=path, hash=True)
        except RpcError as exc:
            raise map_refusal(exc, file) from exc
        return result

    def read(self, workspace: str, path: str, file: str) -> bytes:
        """A checkout file's bytes, by `fs.read` pieces."""
        out = io.BytesIO()
        try:
            while True:
                piece = self.call(
                    "fs.read", workspace=workspace, path=path, offset=out.tell(), length=READ_BYTES
                )
                out.write(_decoded(piece["data"], piece.get("encoding")))
                if piece.get("eof") or not piece["data"]:
                    return out.getvalue()
        except RpcError as exc:
            raise map_refusal(exc, file) from exc


def _params(
    workspace: str, profile: str, argv: list[str], cwd: str, timeout: int | None
) -> dict[str, Any]:
    params: dict[str, Any] = {"workspace": workspace, "profile": profile, "argv": argv}
    params["cwd"] = cwd
    if timeout is not None:
        params["timeout_s"] = timeout
    return params


def _decoded(data: str, encoding: Any) -> bytes:
    return base64.b64decode(data) if encoding == "base64" else data.encode("utf-8")


def owner_of(spec: str | None) -> tuple[int, int]:
    """`"UID:GID"` (None: 1000:1000, the sandbox image's user) as numbers."""
    uid, _, gid = (spec or "1000:1000").partition(":")
    return int(uid), int(gid or uid)


def writable(root: str) -> bool:
    return os.access(root, os.W_OK | os.X_OK)
