"""`substrate mcp`: the MCP server over stdio, a client of the daemon's agent socket.

Theory of operation: one process per MCP client (the client spawns it). It runs on
Trio (the SDK runs on anyio, which runs on Trio) and holds one connection to the
daemon's agent socket (`DaemonLink`), opened again when the daemon closed it (an idle
connection is closed after `idle_timeout_s`). A tool call is one daemon call
(`substrate.mcp.tools`), its arguments passed as given with the default workspace
filled in and counts clamped; the daemon validates and refuses. A refusal becomes a
tool error (`isError`) carrying `{refusal, code, message, data}`, never a protocol
error or a crash; a result is cut to the size limit (`substrate.mcp.bounds`). Its text
is its JSON, but a finished command's (`proc_run`, `proc_wait`), which reads as text
(`substrate.protocol.proc_text`: exit code, output tails, changes, blocked paths) beside the JSON
as structured content.
`proc_output` subscribes on a connection of its own (`substrate.mcp.output`).
Artifacts are resources (`substrate.mcp.resources`). A call that names a progress token
(`_meta.progressToken`) gets a progress notification every `PROGRESS_INTERVAL_S` while
the daemon works on it (the seconds so far: total unknown), so a client that resets its
timeout on progress can wait for a long `proc_run` or `proc_wait`.

Nothing here writes to stdout: the transport owns it (`substrate.mcp.stdio`: fd 1 points
at stderr while it serves; a line that is not a JSON-RPC message is answered there).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import mcp.types as types
import msgspec
import outcome
import trio
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import Server
from mcp.shared.exceptions import MCPError

import substrate
from substrate.config import Config
from substrate.errors import InvalidParams
from substrate.mcp import bounds, resources
from substrate.mcp.output import OutputCollector, OutputParams
from substrate.mcp.stdio import open_stdio
from substrate.mcp.tools import (
    BY_NAME,
    TOOLS,
    Tool,
    input_schema,
    prepare_arguments,
    unknown_fields,
)
from substrate.protocol.client import AsyncClient, ConnectionLost, RpcError, open_client
from substrate.protocol.proc_text import is_proc_result, proc_text
from substrate.schema import METHODS

log = logging.getLogger("substrate.mcp")

T = TypeVar("T")

INVALID_PARAMS_CODE = InvalidParams.code
#: The longest `proc_output` listens for pieces the daemon already has, seconds.
OUTPUT_WAIT_S = 10.0
#: Seconds between progress notifications of a call that asked for them.
PROGRESS_INTERVAL_S = 1.0
#: The daemon's default request line limit: longer requests are refused here, unsent.
MAX_REQUEST_BYTES: int = next(
    f.default for f in msgspec.structs.fields(Config) if f.name == "max_request_bytes"
)

INSTRUCTIONS = """\
substrate: files and commands of an adopted workspace, through a daemon that guards them.
Read a file (fs_read) to get its sha256, then write or patch it bound to that base
(fs_write/fs_patch base_sha256); if the file changed since, the write is refused
(stale_base, with current_sha256) and nothing is written: read again. dry_run shows
the diff and plan_digest first. Commands take argv lists (no shell) and an operator
profile; large output is an artifact: read it with artifact_read/lines/grep or the
resource substrate://artifact/<id>. A finished command's text is its exit code, the
tails of its output and each changed path that did not land (blocked by the policy,
pending approval, in conflict with a host edit); its whole result is the structured
content. Refusals come back as tool errors naming the refusal. Results are bounded;
`elided` says what was cut and where the rest is."""


@dataclass(frozen=True)
class Options:
    socket: Path  # the daemon's agent socket
    workspace: str | None = None  # a handle, root id or absolute path to adopt; the default
    result_bytes: int = 64 << 10  # the largest tool result, bytes of JSON


class DaemonLink:
    """One agent connection to the daemon, reopened when the daemon closed it."""

    def __init__(self, path: Path, nursery: trio.Nursery) -> None:
        self.path = path
        self._nursery = nursery
        self._client: AsyncClient | None = None
        self._lock = trio.Lock()

    async def _connected(self) -> AsyncClient:
        async with self._lock:
            if self._client is None:
                stream = await trio.open_unix_socket(os.fspath(self.path))
                client = AsyncClient(
                    stream,
                    self._nursery,
                    notification_buffer=16,
                    max_request_bytes=MAX_REQUEST_BYTES,
                )
                self._client = client
                self._nursery.start_soon(self._watch, client)
            return self._client

    async def _watch(self, client: AsyncClient) -> None:
        """Forget `client` once its connection ends (its notifications channel closes)."""
        async for _ in client.notifications:
            pass  # this connection subscribes to nothing
        if self._client is client:
            self._client = None

    async def call(self, method: str, params: Mapping[str, Any]) -> Any:
        """One daemon call. Raises `RpcError` (a refusal), `ConnectionLost` or `OSError`.

        A call that changes nothing is sent once more on a new connection when the old
        one was lost under it; a change is never repeated (it may have been carried out).
        """
        client = await self._connected()
        try:
            return await client.call(method, **params)
        except ConnectionLost:
            if self._client is client:
                self._client = None
            if METHODS[method].mutating:
                raise
        client = await self._connected()
        return await client.call(method, **params)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


# -- results -------------------------------------------------------------------------------


def _text_result(value: Any, text: bytes, *, error: bool) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(text=text.decode("utf-8", "replace"))],
        structured_content=value,
        is_error=error,
    )


def error_result(
    message: str, *, refusal: str | None, code: int | None, data: Mapping[str, Any] | None
) -> types.CallToolResult:
    """A tool error: `{refusal, code, message, data}` as text and as structured content."""
    value = {"refusal": refusal, "code": code, "message": message, "data": dict(data or {})}
    value, text = bounds.fit(value, "none", 16 << 10)
    return _text_result(value, text, error=True)


def refusal_result(exc: RpcError) -> types.CallToolResult:
    return error_result(exc.message, refusal=exc.refusal, code=exc.code, data=exc.data)


# -- the bridge ----------------------------------------------------------------------------


class Bridge:
    """The MCP handlers, over one `DaemonLink`."""

    def __init__(self, link: DaemonLink, options: Options, workspace: str | None) -> None:
        self.link = link
        self.options = options
        self.workspace = workspace
        self.seen = resources.Seen()
        self.tools = [self._describe(tool) for tool in TOOLS]

    def _describe(self, tool: Tool) -> types.Tool:
        return types.Tool(
            name=tool.name,
            title=tool.title,
            description=f"{tool.description} (daemon method {tool.method})",
            input_schema=input_schema(
                tool, default_workspace=self.workspace, result_bytes=self.options.result_bytes
            ),
            annotations=types.ToolAnnotations(
                title=tool.title,
                read_only_hint=tool.read_only,
                destructive_hint=tool.destructive,
                idempotent_hint=tool.idempotent,
                open_world_hint=tool.open_world,
            ),
        )

    async def list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self.tools)

    async def call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        tool = BY_NAME.get(params.name)
        if tool is None:
            raise MCPError(types.INVALID_PARAMS, f"unknown tool {params.name!r}")
        unknown = unknown_fields(tool, params.arguments)
        if unknown:
            return error_result(
                f"Object contains unknown field `{unknown[0]}`",
                refusal="invalid_params",
                code=INVALID_PARAMS_CODE,
                data={"refusal": "invalid_params", "path": f"$.{unknown[0]}"},
            )
        limit = self.options.result_bytes
        args = prepare_arguments(
            tool, params.arguments, default_workspace=self.workspace, result_bytes=limit
        )

        async def call() -> Any:
            if tool.name == "proc_output":
                return await self._proc_output(args)
            return await self.link.call(tool.method, args)

        try:
            value = await _reporting_progress(ctx, tool.name, call)
        except RpcError as exc:
            return refusal_result(exc)
        except ConnectionLost as exc:
            return error_result(
                f"{exc}; the call may have been carried out: look before repeating a change",
                refusal=None,
                code=None,
                data={"error": "connection_lost"},
            )
        except OSError as exc:
            return error_result(
                f"cannot reach the daemon at {self.link.path}: {exc.strerror or exc}",
                refusal=None,
                code=None,
                data={"error": "daemon_unreachable"},
            )
        for seen in resources.artifacts_in(value):
            self.seen.add(seen)
        value, text = bounds.fit(value, tool.fit, limit)
        if tool.fit == "proc" and is_proc_result(value):
            # What a model reads first; the whole result stays the structured content.
            text = proc_text(value).encode("utf-8", "surrogatepass")
        return _text_result(value, text, error=False)

    async def _proc_output(self, args: dict[str, Any]) -> Any:
        try:
            p = msgspec.convert(args, OutputParams)
        except msgspec.ValidationError as exc:
            message = str(exc)  # "... - at `$.field`" when a field is to blame
            at = message.rsplit(" - at `", 1)
            path = at[1].rstrip("`") if len(at) == 2 else "$"
            data = {"refusal": "invalid_params", "path": path}
            raise RpcError(INVALID_PARAMS_CODE, message, data) from None
        status = await self.link.call("proc.status", {"proc": p.proc})
        sizes = {"stdout": int(status["stdout_bytes"]), "stderr": int(status["stderr_bytes"])}
        since = {"stdout": p.stdout_since, "stderr": p.stderr_since}
        budget = max(1024, self.options.result_bytes // 2 - 1024)
        collector = OutputCollector(p.proc, since, sizes, budget)
        if not collector.done:
            with trio.move_on_after(OUTPUT_WAIT_S):
                async with open_client(self.link.path, notification_buffer=64) as client:
                    start = collector.subscribe_since
                    await client.call("proc.subscribe", proc=p.proc, since=start)
                    async for notice in client.notifications:
                        if collector.feed(notice):
                            break
        out = collector.result(str(status["state"]), self.options.result_bytes - 1024)
        return msgspec.to_builtins(out)

    # -- resources ---------------------------------------------------------------------------

    async def list_resources(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        return types.ListResourcesResult(
            resources=[
                types.Resource(
                    uri=resources.artifact_uri(item.artifact),
                    name=item.artifact,
                    title=item.label,
                    mime_type="text/plain",
                    size=item.size,
                )
                for item in self.seen.newest_first()
            ]
        )

    async def list_templates(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(
            resource_templates=[
                types.ResourceTemplate(
                    uri_template=resources.TEMPLATE,
                    name="artifact",
                    title="Command output",
                    description=(
                        "A stored command output (stdout/stderr past the inline limit), read "
                        f"from offset, at most {self.options.result_bytes} bytes per read."
                    ),
                    mime_type="text/plain",
                )
            ]
        )

    async def read_resource(
        self, ctx: ServerRequestContext[Any], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        """`artifact.read` of the URI's range; a refusal is an MCP error carrying its data."""
        try:
            target = resources.parse_artifact_uri(params.uri)
        except resources.BadUri as exc:
            raise MCPError(types.INVALID_PARAMS, str(exc)) from None
        limit = self.options.result_bytes
        length = limit if target.length is None else min(target.length, limit)
        args = {"artifact": target.artifact, "offset": target.offset, "length": length}
        try:
            part = await self.link.call("artifact.read", args)
        except RpcError as exc:
            raise MCPError(exc.code, exc.message, exc.data) from None
        except (ConnectionLost, OSError) as exc:
            raise MCPError(types.INTERNAL_ERROR, f"daemon unreachable: {exc}") from None
        meta = {"offset": part["offset"], "eof": part["eof"]}
        content: types.TextResourceContents | types.BlobResourceContents
        if part["encoding"] == "utf-8":
            content = types.TextResourceContents(
                uri=params.uri, mime_type="text/plain", text=part["data"], _meta=meta
            )
        else:
            content = types.BlobResourceContents(
                uri=params.uri, mime_type="application/octet-stream", blob=part["data"], _meta=meta
            )
        return types.ReadResourceResult(contents=[content])

    def server(self) -> Server[Any]:
        return Server(
            "substrate",
            version=substrate.__version__,
            title="substrate",
            instructions=INSTRUCTIONS,
            on_list_tools=self.list_tools,
            on_call_tool=self.call_tool,
            on_list_resources=self.list_resources,
            on_list_resource_templates=self.list_templates,
            on_read_resource=self.read_resource,
        )


# -- running ---------------------------------------------------------------------------------


class StartupFailed(Exception):
    """The daemon cannot be reached, or the default workspace is unknown or refused."""


async def resolve_workspace(link: DaemonLink, spec: str) -> str:
    """A handle from `--workspace`: an absolute path to adopt, else a handle or root id of
    an adopted workspace. Raises `StartupFailed`."""
    try:
        if spec.startswith("/"):
            adopted = await link.call("workspace.adopt", {"path": spec})
            return str(adopted["workspace"])
        for ws in (await link.call("workspace.list", {}))["workspaces"]:
            if spec in (ws["workspace"], ws["root_id"]):
                return str(ws["workspace"])
    except RpcError as exc:
        raise StartupFailed(
            f"workspace {spec!r}: {exc.refusal or exc.code}: {exc.message}"
        ) from None
    raise StartupFailed(f"no workspace {spec!r}")


async def _start(link: DaemonLink, options: Options) -> str | None:
    """The default workspace's handle (None without one), once the daemon answered."""
    try:
        if options.workspace is not None:
            return await resolve_workspace(link, options.workspace)
        await link.call("workspace.list", {})  # the daemon answers: say so now if not
        return None
    except (OSError, ConnectionLost) as exc:
        raise StartupFailed(f"cannot reach the daemon at {options.socket}: {exc}") from None


async def serve(options: Options) -> None:
    """Serve MCP on stdin/stdout until the client closes stdin. Raises `StartupFailed`."""
    failed: StartupFailed | None = None
    async with trio.open_nursery() as nursery:
        link = DaemonLink(options.socket, nursery)
        try:
            workspace = await _start(link, options)
        except StartupFailed as exc:
            failed = exc
        else:
            server = Bridge(link, options, workspace).server()
            async with open_stdio() as (read, write):
                await server.run(read, write, server.create_initialization_options())
        await link.aclose()
        nursery.cancel_scope.cancel()
    if failed is not None:
        raise failed


def run(options: Options) -> int:
    """`substrate mcp`: serve until stdin closes; 2 when the daemon or workspace is not there."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        trio.run(serve, options)
    except StartupFailed as exc:
        print(f"substrate mcp: {exc}", file=sys.stderr)
        return 2
    return 0


def _progress_token(ctx: ServerRequestContext[Any]) -> str | int | None:
    meta = ctx.meta or {}
    token = meta.get("progress_token", meta.get("progressToken"))
    return token if isinstance(token, (str, int)) else None


async def _reporting_progress(
    ctx: ServerRequestContext[Any], name: str, call: Callable[[], Awaitable[T]]
) -> T:
    """`call()`, with progress reports beside it when the request asked for them; its
    exception as it raised it (not in a group)."""
    token = _progress_token(ctx)
    if token is None:
        return await call()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_report_progress, ctx, token, name)
        result = await outcome.acapture(call)
        nursery.cancel_scope.cancel()
    return result.unwrap()


async def _report_progress(ctx: ServerRequestContext[Any], token: str | int, name: str) -> None:
    """Every `PROGRESS_INTERVAL_S` until cancelled: the seconds `name` has taken so far.
    A notification that cannot be sent ends the reports, never the call."""
    started = trio.current_time()
    while True:
        await trio.sleep(PROGRESS_INTERVAL_S)
        elapsed = trio.current_time() - started
        try:
            await ctx.session.send_progress_notification(
                token,
                progress=round(elapsed, 1),
                message=f"{name}: working for {elapsed:.0f} s",
                related_request_id=None if ctx.request_id is None else str(ctx.request_id),
            )
        except Exception:  # the client went away: the call's own reply will say so
            log.debug("a progress notification could not be sent", exc_info=True)
            return
