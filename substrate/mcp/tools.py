"""The MCP tool table: which daemon method each tool calls, its hints, its input schema.

Theory of operation: a tool is a daemon method seen by an MCP client. `TOOLS` names
each one (`fs_read` for `fs.read`: dots are outside the function-name pattern several
model APIs accept), its annotations and its bounds; the input schema is generated
from the method's params Struct in `substrate.schema` (`msgspec.json.schema`), with
each field's source comment as its description, so the Structs stay the single source.
`proc_output` is the one tool that is not a single call: its params are a Struct of
its own (`substrate.mcp.output.OutputParams`) and it returns what that module collects.

Bounds: `clamps` caps a parameter (its Struct default included) before the call, so a
result is usually small enough as asked; `substrate.mcp.bounds` cuts whatever is still
over the size limit afterwards. Everything here is pure.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import msgspec.inspect as mi

from substrate.mcp.output import OutputParams
from substrate.schema import METHODS
from substrate.schema.reference import field_comments, shapes_of

#: The longest a `proc_wait` call waits, seconds (None, "until it ends", included).
MAX_WAIT_S = 120.0
#: Counts clamped before the call (the result is cut by bytes afterwards as well).
MAX_LIST = 2000
MAX_WALK = 5000
MAX_MATCHES = 1000
MAX_LINES = 2000

#: How a result over the size limit is cut (`substrate.mcp.bounds.fit`).
Fit = Literal["entries", "paths", "matches", "lines", "data", "proc", "changes", "applied", "none"]


@dataclass(frozen=True)
class Tool:
    """One MCP tool: the daemon `method` it calls and what a client is told about it."""

    name: str
    method: str
    title: str
    description: str
    read_only: bool
    #: May change or remove what exists (meaningful when not read-only).
    destructive: bool = False
    #: Calling it again with the same arguments changes nothing more.
    idempotent: bool = False
    #: May reach beyond the workspace (a command's network, if its profile allows one).
    open_world: bool = False
    #: Parameter → largest value sent (a None or larger value is lowered to it). The
    #: string "result" stands for the size limit of a result, in bytes.
    clamps: Mapping[str, float | str] = field(default_factory=dict)
    fit: Fit = "none"
    #: The params Struct when it is not the method's (`proc_output`).
    own_params: type[msgspec.Struct] | None = None

    @property
    def params(self) -> type[msgspec.Struct]:
        return self.own_params or METHODS[self.method].params


TOOLS: tuple[Tool, ...] = (
    Tool(
        "fs_stat",
        "fs.stat",
        "Stat a path",
        "Kind, size, mode, mtime and SHA-256 of a workspace path. Bind a write to its sha256.",
        read_only=True,
        idempotent=True,
    ),
    Tool(
        "fs_read",
        "fs.read",
        "Read a file",
        "A byte range of a file (UTF-8 text, else base64) and the whole file's sha256 (the "
        "base for fs_write/fs_patch). Page with offset; eof says the end was reached.",
        read_only=True,
        idempotent=True,
        clamps={"length": "result"},
        fit="data",
    ),
    Tool(
        "fs_list",
        "fs.list",
        "List a directory",
        "Entries of one directory (name, kind, size); symlinks are listed, never followed.",
        read_only=True,
        idempotent=True,
        clamps={"limit": MAX_LIST},
        fit="entries",
    ),
    Tool(
        "fs_walk",
        "fs.walk",
        "Walk a tree",
        "Every path beneath a directory (kind, size), bounded by max_entries and max_depth.",
        read_only=True,
        idempotent=True,
        clamps={"max_entries": MAX_WALK},
        fit="paths",
    ),
    Tool(
        "fs_search",
        "fs.search",
        "Search files",
        "Lines matching a regex (or a fixed string with fixed=true) under a path: "
        "path, line, column, text. glob narrows the files.",
        read_only=True,
        idempotent=True,
        clamps={"max_matches": MAX_MATCHES},
        fit="matches",
    ),
    Tool(
        "fs_write",
        "fs.write",
        "Write a file (guarded)",
        "Create (base_sha256 null: the file must not exist) or replace a file whose current "
        "sha256 is base_sha256; anything else is refused (stale_base) and nothing is "
        "written. dry_run returns the plan (diff, plan_digest) without writing; "
        "plan_digest applies only that exact plan.",
        read_only=False,
        destructive=True,
        idempotent=True,
    ),
    Tool(
        "fs_patch",
        "fs.patch",
        "Patch a file (guarded)",
        "Exact search/replace edits (each old must occur count times) or a strict unified "
        "diff of one file, bound to base_sha256; dry_run and plan_digest as for fs_write.",
        read_only=False,
        destructive=True,
        idempotent=True,
    ),
    Tool(
        "fs_delete",
        "fs.delete",
        "Delete a file (guarded)",
        "Delete a file whose current sha256 is base_sha256; dry_run and plan_digest as for "
        "fs_write.",
        read_only=False,
        destructive=True,
        idempotent=True,
    ),
    Tool(
        "proc_run",
        "proc.run",
        "Run a command",
        'Run argv (no shell: use ["sh", "-c", ...] for one) in the workspace\'s confined '
        "sandbox under an operator profile and wait for it to end: exit code, stdout and "
        "stderr inline or as an artifact (resource substrate://artifact/<id>). For long "
        "commands use proc_start, then proc_wait and proc_output.",
        read_only=False,
        destructive=True,
        open_world=True,
        fit="proc",
    ),
    Tool(
        "proc_start",
        "proc.start",
        "Start a command",
        "Start argv as proc_run does and answer {proc} once it runs; then proc_wait, "
        'proc_output, proc_signal. stdin: "stream" keeps its stdin open for proc_write.',
        read_only=False,
        destructive=True,
        open_world=True,
    ),
    Tool(
        "proc_wait",
        "proc.wait",
        "Wait for a command",
        f"The proc_run result once the process ends, or {{proc, state: running}} after "
        f"timeout_s (at most {MAX_WAIT_S:g} s per call here; call again to keep waiting).",
        read_only=True,
        idempotent=True,
        clamps={"timeout_s": MAX_WAIT_S},
        fit="proc",
    ),
    Tool(
        "proc_output",
        "proc.subscribe",
        "Read a command's output",
        "The output of a process so far (running or ended): stdout from stdout_since and "
        "stderr from stderr_since, bounded; each stream's `next` is where to continue.",
        read_only=True,
        idempotent=True,
        own_params=OutputParams,
    ),
    Tool(
        "proc_signal",
        "proc.signal",
        "Signal a command",
        "Send INT, TERM or KILL to every process of a command.",
        read_only=False,
        destructive=True,
    ),
    Tool(
        "proc_write",
        "proc.write",
        "Write to a command's stdin",
        "Send text (data) or bytes (data_b64) to the stdin of a command started with stdin: "
        '"stream"; eof: true closes it. Waits while the command has not read earlier bytes.',
        read_only=False,
    ),
    Tool(
        "artifact_read",
        "artifact.read",
        "Read an artifact",
        "A byte range of a stored command output (UTF-8 text, else base64); page with offset.",
        read_only=True,
        idempotent=True,
        clamps={"length": "result"},
        fit="data",
    ),
    Tool(
        "artifact_lines",
        "artifact.lines",
        "Lines of an artifact",
        "Lines of a stored command output by number (1-based); not eof: continue at "
        "start + number of lines returned.",
        read_only=True,
        idempotent=True,
        clamps={"count": MAX_LINES},
        fit="lines",
    ),
    Tool(
        "artifact_grep",
        "artifact.grep",
        "Grep an artifact",
        "Lines of a stored command output that match a regex (or fixed string), with numbers.",
        read_only=True,
        idempotent=True,
        clamps={"max_matches": MAX_MATCHES},
        fit="matches",
    ),
    Tool(
        "changes_get",
        "changes.get",
        "Show a change set",
        "A change set a layer command kept for review: each change (op, bases, diff "
        "preview) and its state.",
        read_only=True,
        idempotent=True,
        fit="changes",
    ),
    Tool(
        "changes_apply",
        "changes.apply",
        "Apply a change set",
        "Apply a kept change set (all, or the named paths) through the guarded path, bases "
        "re-checked: a file changed since is a conflict, never overwritten. Applying twice "
        "applies nothing twice; dry_run checks without writing.",
        read_only=False,
        destructive=True,
        idempotent=True,
        fit="applied",
    ),
    Tool(
        "changes_discard",
        "changes.discard",
        "Discard a change set",
        "Remove a kept change set; nothing of it lands afterwards.",
        read_only=False,
        destructive=True,
        idempotent=True,
    ),
    Tool(
        "workspace_list",
        "workspace.list",
        "List workspaces",
        "The adopted workspaces (handle, root_id, VCS head, effective policy).",
        read_only=True,
        idempotent=True,
    ),
    Tool(
        "workspace_info",
        "workspace.info",
        "Show a workspace",
        "One workspace: handle, root_id, VCS head, effective policy.",
        read_only=True,
        idempotent=True,
    ),
)

BY_NAME: dict[str, Tool] = {tool.name: tool for tool in TOOLS}


# -- schemas ------------------------------------------------------------------------------


def _describe(schema: dict[str, Any], cls: type) -> None:
    """Put each field's source comment into its property's `description`."""
    comments = field_comments(cls)
    for name, prop in schema.get("properties", {}).items():
        if name in comments and "description" not in prop:
            prop["description"] = comments[name]


def struct_schema(cls: type[msgspec.Struct]) -> dict[str, Any]:
    """The JSON Schema of a Struct with an object at its root (MCP requires one).

    msgspec answers `{"$ref": "#/$defs/Name", "$defs": {...}}`; the referenced object
    becomes the root and the other definitions stay in `$defs` (the `$ref`s still
    resolve). Field comments become descriptions, nested Structs' too.
    """
    generated = msgspec.json.schema(cls)
    defs: dict[str, Any] = generated.get("$defs", {})
    name = generated["$ref"].rsplit("/", 1)[-1]
    root = dict(defs.pop(name))
    _describe(root, cls)
    for nested in shapes_of([cls]):
        if nested.__name__ in defs:
            _describe(defs[nested.__name__], nested)
    if defs:
        root["$defs"] = defs
    return root


def clamp_value(limit: float | str, result_bytes: int) -> float:
    return float(result_bytes) if limit == "result" else float(limit)


def input_schema(tool: Tool, *, default_workspace: str | None, result_bytes: int) -> dict[str, Any]:
    """The tool's input schema: its params Struct's, adjusted for what this server adds.

    With a default workspace, `workspace` is no longer required (the server fills it
    in). Clamped parameters say their bound here in their description.
    """
    schema = copy.deepcopy(struct_schema(tool.params))
    props: dict[str, Any] = schema.get("properties", {})
    if default_workspace is not None and "workspace" in props:
        schema["required"] = [r for r in schema.get("required", []) if r != "workspace"]
        props["workspace"]["description"] = f"workspace handle (default: {default_workspace})"
    for param, limit in tool.clamps.items():
        if param in props:
            bound = clamp_value(limit, result_bytes)
            note = f"at most {bound:g} per call through MCP"
            old = props[param].get("description")
            props[param]["description"] = f"{old}; {note}" if old else note
    return schema


def _default(cls: type[msgspec.Struct], param: str) -> Any:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    for f in info.fields:
        if f.name == param:
            if f.default is not msgspec.NODEFAULT:
                return f.default
            if f.default_factory is not msgspec.NODEFAULT:
                return f.default_factory()
    return None


def unknown_fields(tool: Tool, arguments: Mapping[str, Any] | None) -> list[str]:
    """Argument names the tool's params Struct does not have (the daemon would refuse
    them as `invalid_params`; refused here, as one is a keyword of the client's call)."""
    fields = tool.params.__struct_fields__
    return sorted(name for name in arguments or {} if name not in fields)


def prepare_arguments(
    tool: Tool,
    arguments: Mapping[str, Any] | None,
    *,
    default_workspace: str | None,
    result_bytes: int,
) -> dict[str, Any]:
    """The daemon params of a call: the client's arguments, the default workspace filled
    in, clamped parameters lowered to their bound (a missing one to its bound when its
    default is larger or None). Values of the wrong type are left for the daemon to
    refuse (`invalid_params`, named by path)."""
    params = dict(arguments or {})
    fields = tool.params.__struct_fields__
    if default_workspace is not None and "workspace" in fields and "workspace" not in params:
        params["workspace"] = default_workspace
    for param, limit in tool.clamps.items():
        bound = clamp_value(limit, result_bytes)
        value = params[param] if param in params else _default(tool.params, param)
        if value is None or (
            isinstance(value, int | float) and not isinstance(value, bool) and value > bound
        ):
            params[param] = int(bound) if bound.is_integer() else bound
    return params
