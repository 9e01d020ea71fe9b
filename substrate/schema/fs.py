"""Wire schema of reads (docs/protocol.md §3) and guarded writes (docs/protocol.md §4).

Two guarded writes take "exactly one of" two fields: `fs.write` its bytes as `content`
(text) or `content_b64`, `fs.patch` its change as `edits` or a `unified_diff`. The wire
keeps that shape (clients depend on it); `write_request` and `patch_request` check the
pair once, at the edge, and turn it into one of two tagged Structs (`TextContent |
BytesContent`, `Edits | UnifiedDiff`) inside a request the writer `match`es on.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Literal

import msgspec

from substrate.errors import InvalidParams
from substrate.schema.common import (
    NonNegative,
    Params,
    RelPath,
    Result,
    Sha256,
    WorkspaceId,
    method,
)

MAX_READ = 4 << 20

Kind = Literal["file", "dir", "symlink", "other"]


class StatParams(Params):
    workspace: WorkspaceId
    path: RelPath
    # Hash a file over `inline_hash_bytes` too (a pass over the whole file, off the reader
    # threads); without it such a file's digest is deferred unless already known.
    hash: bool = False


class StatResult(Result):
    path: str
    kind: Kind
    size: int
    mode: int
    mtime_ns: int
    sha256: str | None = None
    # True when a file's sha256 is left out because it is over `inline_hash_bytes` and
    # not known yet: ask again with `hash: true`.
    sha256_deferred: bool = False


class ReadParams(Params):
    workspace: WorkspaceId
    path: RelPath
    offset: NonNegative = 0
    # Bounded in `reads` (too_large), not here, so the refusal is the named one.
    length: NonNegative = 262144
    # As `StatParams.hash`: the whole file's digest even over `inline_hash_bytes`.
    hash: bool = False


class ReadResult(Result):
    path: str
    size: int
    # The whole file's digest, or null with `sha256_deferred` (see `StatResult`).
    sha256: str | None
    offset: int
    eof: bool
    encoding: Literal["utf-8", "base64"]
    data: str
    sha256_deferred: bool = False


class ListParams(Params):
    workspace: WorkspaceId
    path: RelPath = "."
    limit: Annotated[int, msgspec.Meta(ge=1, le=100000)] = 1000


class ListEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    # A name that is not UTF-8 has its other bytes written `\xNN` here, and its exact
    # bytes in `name_b64` (absent for UTF-8 names).
    name: str
    kind: Kind
    size: int
    name_b64: str | None = None


class ListResult(Result):
    entries: list[ListEntry]
    truncated: bool


#: One `exclude` glob: the policy dialect (docs/protocol.md §2), matched against the whole
#: workspace-relative path.
ExcludeGlob = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
#: At most 256 of them per call.
Excludes = Annotated[list[ExcludeGlob], msgspec.Meta(max_length=256)]


class WalkParams(Params):
    workspace: WorkspaceId
    path: RelPath = "."
    max_entries: Annotated[int, msgspec.Meta(ge=1, le=1000000)] = 10000
    max_depth: Annotated[int, msgspec.Meta(ge=0, le=4096)] | None = None
    include_git: bool = False
    # Globs whose matches are neither listed nor entered (a directory's whole subtree).
    exclude: Excludes = msgspec.field(default_factory=list)
    # Leave out what git ignores: `.gitignore` files at any depth and `.git/info/exclude`.
    gitignore: bool = False


class WalkEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    path: str  # escaped as `ListEntry.name` when not UTF-8, with the bytes in `path_b64`
    kind: Kind
    size: int
    path_b64: str | None = None


class WalkResult(Result):
    paths: list[WalkEntry]
    truncated: bool


class SearchParams(Params):
    workspace: WorkspaceId
    pattern: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    path: RelPath = "."
    glob: str | None = None
    fixed: bool = False
    ignore_case: bool = False
    max_matches: Annotated[int, msgspec.Meta(ge=1, le=100000)] = 200
    max_line_bytes: Annotated[int, msgspec.Meta(ge=16, le=65536)] = 512
    # As `WalkParams.exclude`: files and directories not searched.
    exclude: Excludes = msgspec.field(default_factory=list)
    # As `WalkParams.gitignore`: what git ignores is not searched.
    gitignore: bool = False


class SearchMatch(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    path: str  # escaped as `ListEntry.name` when not UTF-8, with the bytes in `path_b64`
    line: int
    column: int
    text: str
    path_b64: str | None = None


class SearchResult(Result):
    matches: list[SearchMatch]
    truncated: bool
    files_scanned: int
    bytes_scanned: int


Mode = Annotated[int, msgspec.Meta(ge=0, le=0o7777)]


class WriteParams(Params):
    workspace: WorkspaceId
    path: RelPath
    base_sha256: Sha256 | None
    content: str | None = None
    content_b64: str | None = None
    mode: Mode | None = None
    create_parents: bool = False
    dry_run: bool = False
    plan_digest: Sha256 | None = None


class Edit(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    old: Annotated[str, msgspec.Meta(min_length=1)]
    new: str
    # How many times `old` must occur (every one is replaced); "all": at least once.
    count: Annotated[int, msgspec.Meta(ge=1)] | Literal["all"] = 1


class PatchParams(Params):
    workspace: WorkspaceId
    path: RelPath
    base_sha256: Sha256
    edits: list[Edit] | None = None
    unified_diff: str | None = None
    dry_run: bool = False
    plan_digest: Sha256 | None = None


class DeleteParams(Params):
    workspace: WorkspaceId
    path: RelPath
    base_sha256: Sha256
    dry_run: bool = False
    plan_digest: Sha256 | None = None


class Plan(Result, omit_defaults=False):
    path: str
    op: Literal["create", "replace", "delete"]
    base_sha256: str | None
    new_sha256: str | None
    size: int
    mode: int | None
    diff: str
    diff_truncated: bool
    plan_digest: str
    applied: bool


# --- decoded forms of guarded writes (internal: never on the wire) ------------------------


class TextContent(msgspec.Struct, frozen=True, tag=True):
    """`fs.write`'s `content`: text, written as UTF-8 (lone surrogates kept as given)."""

    text: str


class BytesContent(msgspec.Struct, frozen=True, tag=True):
    """`fs.write`'s `content_b64`, decoded."""

    data: bytes


class Edits(msgspec.Struct, frozen=True, tag=True):
    """`fs.patch`'s `edits`: exact string replacements, applied in order."""

    edits: list[Edit]


class UnifiedDiff(msgspec.Struct, frozen=True, tag=True):
    """`fs.patch`'s `unified_diff`: a strict unified diff of one file."""

    text: str


class WriteRequest(msgspec.Struct, frozen=True, kw_only=True):
    """`fs.write` as the writer takes it: `WriteParams` with its content decoded."""

    path: str
    base_sha256: str | None
    content: TextContent | BytesContent
    mode: int | None = None
    create_parents: bool = False
    dry_run: bool = False
    plan_digest: str | None = None


class PatchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """`fs.patch` as the writer takes it: `PatchParams` with its change as one union."""

    path: str
    base_sha256: str
    change: Edits | UnifiedDiff
    dry_run: bool = False
    plan_digest: str | None = None


def write_request(p: WriteParams) -> WriteRequest:
    """Decode `fs.write`'s params. Refuses `invalid_params` unless exactly one of
    `content` and `content_b64` is given, or when `content_b64` is not base64. Costs a
    base64 decode: call it off the event loop."""
    content: TextContent | BytesContent
    if (p.content is None) == (p.content_b64 is None):
        raise InvalidParams("give exactly one of content, content_b64", path="$.content")
    if p.content is not None:
        content = TextContent(p.content)
    else:
        try:
            content = BytesContent(base64.b64decode(p.content_b64 or "", validate=True))
        except binascii.Error:
            raise InvalidParams("content_b64 is not base64", path="$.content_b64") from None
    return WriteRequest(
        path=p.path,
        base_sha256=p.base_sha256,
        content=content,
        mode=p.mode,
        create_parents=p.create_parents,
        dry_run=p.dry_run,
        plan_digest=p.plan_digest,
    )


def patch_request(p: PatchParams) -> PatchRequest:
    """Decode `fs.patch`'s params. Refuses `invalid_params` unless exactly one of
    `edits` and `unified_diff` is given."""
    change: Edits | UnifiedDiff
    if p.edits is not None and p.unified_diff is None:
        change = Edits(p.edits)
    elif p.unified_diff is not None and p.edits is None:
        change = UnifiedDiff(p.unified_diff)
    else:
        raise InvalidParams("give exactly one of edits, unified_diff", path="$.edits")
    return PatchRequest(
        path=p.path,
        base_sha256=p.base_sha256,
        change=change,
        dry_run=p.dry_run,
        plan_digest=p.plan_digest,
    )


method("fs.stat", StatParams, StatResult)
method("fs.read", ReadParams, ReadResult)
method("fs.list", ListParams, ListResult)
method("fs.walk", WalkParams, WalkResult)
method("fs.search", SearchParams, SearchResult)
# Writes are shielded: a started write finishes (and is answered) across a shutdown.
method(
    "fs.write",
    WriteParams,
    Plan,
    mutating=True,
    shielded=True,
    doc="Guarded create or replace, bound to base_sha256.",
)
method(
    "fs.patch",
    PatchParams,
    Plan,
    mutating=True,
    shielded=True,
    doc="Guarded search/replace edits or a strict unified diff.",
)
method(
    "fs.delete",
    DeleteParams,
    Plan,
    mutating=True,
    shielded=True,
    doc="Guarded delete, bound to base_sha256.",
)
